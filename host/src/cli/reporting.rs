//! The subcommands on result files: `harness report`, `submit`, `verify`,
//! `reproduce`, `keygen`, `compare` and `project`.

use anyhow::Context;

use super::args::{CompareArgs, KeygenArgs, ProjectArgs, ReportArgs, ReproduceArgs, RunArgs, SubmitArgs, VerifyArgs};
use super::child::Child;
use harness_format::exit;
use harness_format::fmt::{printable, printable_path};
use harness_format::results;

/// `harness report`: scores result files and submission bundles, and writes
/// LEADERBOARD.md, index.html and the bundles' copies to `--out-dir`
/// (`harness_report::inputs::load`, `harness_report::output::write`).
pub(super) fn report(args: ReportArgs) -> anyhow::Result<i32> {
    let ReportArgs { results, out_dir, reproductions, public_key } = args;
    let loaded = harness_report::inputs::load(&results, &harness_sandbox::plugin::inspect_component)?;
    for n in &loaded.notes {
        eprintln!("{n}");
    }
    let operator = match &public_key {
        Some(key) => {
            let (records, notes) = harness_report::reproduction::load_signed(&reproductions, &crate::reproduce::public_key(key)?);
            for n in &notes {
                eprintln!("{n}");
            }
            records
        }
        None => Vec::new(),
    };
    let written = harness_report::output::write(&out_dir, &loaded, &operator)?;
    let verified = loaded.bundles.iter().filter(|b| b.verdict.verified()).count();
    let copies = loaded.bundles.iter().filter(|b| b.same_as.is_some()).count();
    println!(
        "{} result files ({} bundles, {verified} verified{}), {} tables, {} submission tables -> {}, {}",
        loaded.results.len(),
        loaded.bundles.len(),
        if copies == 0 { String::new() } else { format!(", {copies} of them copies of another") },
        written.boards.len(),
        written.submission_boards,
        harness_report::escape::terminal(&written.leaderboard.display().to_string()),
        harness_report::escape::terminal(&written.page.display().to_string())
    );
    if public_key.is_some() {
        let reproduced = operator.iter().filter(|o| o.record.reproduced).count();
        println!("{} signed reproduction records ({reproduced} reproduced): the submission tables rank their reruns", operator.len());
    } else if !loaded.bundles.is_empty() {
        println!("no reproduction records given (--reproductions, --public-key): every submission is shown as self-reported, none ranked");
    }
    Ok(exit::OK)
}

/// `harness submit`: bundles a standard-suite result and verifies the
/// bundle at once; a bundle that breaks a rule is [`exit::NOT_VERIFIED`].
pub(super) fn submit(args: SubmitArgs) -> anyhow::Result<i32> {
    let SubmitArgs { result, out, log, no_artifacts } = args;
    let opts = harness_report::submission::SubmitOptions { out, log, no_artifacts };
    let dir = harness_report::submission::submit(&result, &opts)?;
    println!("bundle: {}", printable_path(&dir));
    let verdict = harness_report::submission::verify::verify(&dir, &harness_sandbox::plugin::inspect_component);
    print!("{}", harness_report::submission::verify::render(&dir, &verdict));
    Ok(if verdict.verified() { exit::OK } else { exit::NOT_VERIFIED })
}

/// `harness verify`: checks each bundle against the rules and prints its
/// verdict; [`exit::NOT_VERIFIED`] if any breaks a rule.
pub(super) fn verify(args: VerifyArgs) -> anyhow::Result<i32> {
    let mut code = exit::OK;
    for b in &args.bundles {
        let verdict = harness_report::submission::verify::verify(b, &harness_sandbox::plugin::inspect_component);
        print!("{}", harness_report::submission::verify::render(b, &verdict));
        if !verdict.verified() {
            code = exit::NOT_VERIFIED;
        }
    }
    if let (Some(record), Some(key)) = (&args.reproduction, &args.public_key) {
        let [bundle] = args.bundles.as_slice() else { anyhow::bail!("--reproduction checks the record of one bundle; name one") };
        match crate::reproduce::public_key(key).and_then(|k| crate::reproduce::check_signed(bundle, record, &k)) {
            // The record's machine and time are what its signer wrote.
            Ok(r) => {
                println!(
                    "{}: signed reproduction record: {} on {} ({}), {}",
                    printable_path(record),
                    if r.reproduced { "reproduced" } else { "NOT reproduced" },
                    printable(r.machine.gpus.first().map_or(r.machine.cpu.as_str(), |g| g.name.as_str())),
                    printable(&r.machine.hostname),
                    printable(&r.reproduced_at)
                );
                // A genuine record of a failed reproduction checks, but
                // proves the opposite of the claim.
                if !r.reproduced {
                    for d in &r.comparison.differences {
                        println!("  difference: {}", printable(&d.to_string()));
                    }
                    code = exit::NOT_REPRODUCED;
                }
            }
            Err(e) => {
                println!("{}: the reproduction record does not check: {}", printable_path(record), printable(&format!("{e:#}")));
                code = exit::NOT_VERIFIED;
            }
        }
    }
    Ok(code)
}

/// `harness reproduce`: verifies each bundle, trains it again (or takes the
/// kept rerun of the same inputs), compares and writes the record.
pub(super) fn reproduce(args: ReproduceArgs) -> anyhow::Result<i32> {
    use crate::reproduce::{self as rp, Options};
    let ReproduceArgs { bundles, out, key, fresh, quiet } = args;
    if let Some(k) = &key {
        // A key that cannot sign is found before anything trains.
        let secret = harness_format::files::read_capped(k, harness_format::files::KEY_MAX_BYTES)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .with_context(|| format!("cannot read the key {}", k.display()))?;
        harness_report::reproduction::sign(b"", &secret).with_context(|| format!("{} is not a key `harness keygen` wrote", k.display()))?;
    }
    let opts = Options { out, key, fresh, quiet };
    let mut code = exit::OK;
    for dir in &bundles {
        // Read once: the copy is verified, rerun and hashed into the
        // record; the bundle's folder is not read again.
        let staged = match rp::stage(dir, &opts.out) {
            Ok(s) => s,
            Err(e) => {
                let verdict = harness_report::submission::verify::verify(dir, &harness_sandbox::plugin::inspect_component);
                print!("{}", harness_report::submission::verify::render(dir, &verdict));
                println!("{}: not reproduced: {}", printable_path(dir), printable(&format!("{e:#}")));
                code = exit::NOT_REPRODUCED;
                continue;
            }
        };
        let verdict = harness_report::submission::verify::verify(&staged.dir, &harness_sandbox::plugin::inspect_component);
        if !verdict.verified() {
            print!("{}", harness_report::submission::verify::render(dir, &verdict));
            println!("{}: not reproduced: the bundle does not verify", printable_path(dir));
            code = exit::NOT_REPRODUCED;
            continue;
        }
        let bundle = harness_report::submission::Bundle::read(&staged.dir)?;
        let rerun = rp::prepare(&staged.dir, &bundle, &opts)?;
        if rerun.done {
            println!(
                "{}: a finished rerun of the same inputs is in {}; comparing with it (--fresh trains again)",
                printable_path(dir),
                printable_path(&rerun.dir)
            );
        } else {
            println!("{}: training it again in {}", printable_path(dir), printable_path(&rerun.dir));
            let exe = std::env::current_exe().context("cannot find the harness executable")?;
            let args = RunArgs {
                suite: rerun.suite.clone(),
                out: Some(rerun.result.clone()),
                resume: rerun.resume,
                results_dir: rerun.dir.clone(),
                quiet: opts.quiet,
                plugin: Some(rerun.plugin.clone()),
                plugin_config: rerun.plugin_config.clone(),
                track: rerun.track.clone(),
                gpus: Some(rerun.gpus),
                trace: false,
            };
            let status = std::process::Command::new(exe).args(Child::Run(args).argv()).status()?;
            // What the child left is this operator's: sealed, so that it is
            // compared or resumed, and nothing planted in its place is.
            rp::seal_rerun(&rerun)?;
            // Failed entries are compared (a claim of success they refute);
            // anything else stopped the rerun.
            if !matches!(status.code(), Some(exit::OK | exit::ENTRY_FAILED)) {
                anyhow::bail!(
                    "the rerun of {} stopped ({status})\nhint: run the same `harness reproduce` again to resume it",
                    dir.display()
                );
            }
        }
        let (record, path) = rp::record(&staged, &bundle, &rerun, &opts)?;
        print!("{}", harness_report::reproduction::render(&record));
        println!("record: {}{}", printable_path(&path), if opts.key.is_some() { " (signed: .sig)" } else { "" });
        if !record.reproduced {
            code = exit::NOT_REPRODUCED;
        }
    }
    Ok(code)
}

/// `harness keygen`: writes a new key pair and prints the public key.
pub(super) fn keygen(args: KeygenArgs) -> anyhow::Result<i32> {
    let public = crate::reproduce::keygen(&args.file)?;
    let file = printable_path(&args.file);
    println!("secret key: {file} (keep it private; it signs your reproduction records)");
    println!("public key: {public} (also in {file}.pub; publish it with the board)");
    Ok(exit::OK)
}

/// `harness compare`: the two result files side by side.
pub(super) fn compare(args: CompareArgs) -> anyhow::Result<i32> {
    let ra = results::RunResult::read(&args.a)?;
    let rb = results::RunResult::read(&args.b)?;
    print!("{}", harness_report::compare_table(&[ra], &[rb]));
    Ok(exit::OK)
}

/// `harness project`: the model's projection, or with --check its error
/// on the measured entries.
pub(super) fn project(args: ProjectArgs) -> anyhow::Result<i32> {
    use harness_report::project;
    let sources = args.results.iter().map(|p| project::Source::read(p)).collect::<anyhow::Result<Vec<_>>>()?;
    let benches = args.bench.iter().map(|b| project::calibrate::Bench::read(b)).collect::<anyhow::Result<Vec<_>>>()?;
    if args.check {
        let c = project::check(&sources, &benches);
        anyhow::ensure!(!c.rows.is_empty(), "nothing to check: {}", c.skipped.join("; "));
        print!("{}", project::render::check(&c));
        return Ok(exit::OK);
    }
    anyhow::ensure!(!args.cluster.is_empty(), "give at least one --cluster (e.g. `1-16x8:net=100Gbps`), or --check");
    let mut clusters = Vec::new();
    for c in &args.cluster {
        clusters.extend(project::Cluster::parse(c)?);
    }
    let p = project::project(&sources, &benches, &clusters, args.slowdown, &args.strategy)?;
    let mut text = project::render::projection(&p);
    if args.summary {
        text.push('\n');
        text.push_str(&project::render::summary(&p));
    }
    print!("{text}");
    let plots = harness_report::html::projection::plots(&p);
    if let Some(path) = &args.svg {
        std::fs::write(path, harness_report::html::projection::stack(&plots)).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.html {
        let page = harness_report::html::projection::page(project::render::LABEL, &plots, &text);
        std::fs::write(path, page).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(exit::OK)
}
