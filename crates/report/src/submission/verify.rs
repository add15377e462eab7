//! `harness verify BUNDLE`: checks a submission bundle the way a package
//! checker does, and says for each rule it breaks what is wrong and what to
//! do. A bundle comes from someone else: verify trusts no figure or label
//! it can work out itself, and runs nothing from it. The checks, in order
//! (docs/rules.md, "Verification"):
//!
//! 1. files: every file the manifest lists is inside the bundle's folder,
//!    a regular file within the size caps ([`super::files`]), with its size
//!    and sha256;
//! 2. result: the result file reads, holds no field this harness does not
//!    know, every planned entry has one result, labelled as planned, and
//!    every finished entry has its metrics;
//! 3. suite: byte-identical to a standard suite this harness releases;
//! 4. plugin: each entered plugin's artifact is the one that ran (its
//!    sha256, and the plugin records of the entries that ran it), it is a
//!    WebAssembly component by its bytes (anything else is never loaded),
//!    and, inspected in the sandbox, it says it is the plugin the result
//!    names;
//! 5. labels: the suite version, hardware class, GPU count, tracks and
//!    plugins that the result and the manifest state are the released
//!    suite's and each other's ([`hardware`]);
//! 6. hardware: the fingerprint has the class's GPUs, as many as the run
//!    used, and every entry ran on them ([`hardware`]);
//! 7. plan: the plan is the one the released suite gives for this entry:
//!    repeats, seeds and the baselines unmodified;
//! 8. steps and histograms: each entry ran the workload's steps and
//!    warm-up, and its step histogram agrees with its step counts;
//! 9. figures: every figure the tables and the leaderboard use is worked
//!    out again from the raw records (histograms, curves, the suite's
//!    batch, sequence length, targets and data table, collective records)
//!    and compared ([`figures`]);
//! 10. log and failures: no entry failed, and the run's log agrees with the
//!     result: a line per entry, in the order the plan runs them, with the
//!     result's figures, and no failure the result lacks ([`log`]);
//! 11. official: the run is official by the fingerprint, the GPU count,
//!     the artifact's own bytes and the switches.
//!
//! What verify cannot prove is that the numbers were measured: a forger
//! who makes every record agree with every other passes. Reproducing the
//! run (`harness reproduce`) proves that.

mod figures;
mod hardware;
mod log;
#[cfg(test)]
mod tests;
mod verdict;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use super::{files, sha256_hex, Manifest, BUNDLE_FORMAT, LOG, MACHINE, MANIFEST, RESULT, SUITE};
use harness_format::plugin::{head_hex, ArtifactFormat};
use harness_format::results::{EntryStatus, RunResult, Submission};
use harness_format::suite::standard::{self, Entry, Released};
use harness_format::suite::Suite;
use verdict::{list, short, RESUBMIT};
pub use verdict::{render, Verdict, Violation};

/// Reads a plugin artifact's manifest (name, version, kind) from its
/// bytes: the caller decides how, since reading one means running it. The
/// report layer holds no plugin runtime. `verify` calls it only with the
/// bytes of a WebAssembly component (by its first bytes) whose sha256 is
/// the one the run loaded; `harness` passes `plugin::inspect_component`,
/// which instantiates it in the wasm sandbox with its memory and time
/// limits.
pub type Inspect<'a> = &'a dyn Fn(&[u8]) -> anyhow::Result<harness_format::plugin::Manifest>;

/// The bundle's files as they were read (within the caps), by their path
/// in the manifest.
type Contents = BTreeMap<String, Vec<u8>>;

/// Checks the bundle in `dir`; `inspect` reads the bundled components'
/// manifests.
pub fn verify(dir: &Path, inspect: Inspect) -> Verdict {
    let mut v = Verdict::default();
    let manifest = match read_manifest(dir) {
        Ok(m) => m,
        Err(what) => {
            v.add("files", what, "verify the folder that `harness submit` wrote (it holds MANIFEST.json)");
            return v;
        }
    };
    let contents = check_files(dir, &manifest, &mut v);
    let result = match contents.get(RESULT).map(|raw| RunResult::parse(&String::from_utf8_lossy(raw), &dir.join(RESULT))) {
        Some(Ok(r)) => r,
        Some(Err(e)) => {
            v.add("result", format!("{RESULT} cannot be read as a result: {e}"), RESUBMIT);
            return v;
        }
        None => {
            v.add("result", format!("{RESULT} cannot be read (see the files rule)"), RESUBMIT);
            return v;
        }
    };
    let Some(sub) = result.submission.clone() else {
        v.add(
            "result",
            format!("{RESULT} is not the result of a submission run (no `submission` record)"),
            "enter the plugin with `harness run SUITE --plugin KIND=PATH` and submit that result",
        );
        return v;
    };
    if let Some(raw) = contents.get(RESULT) {
        check_known_fields(raw, &result, &mut v);
    }
    check_complete(&result, &mut v);
    let suite = check_suite(&contents, &manifest, &result, &mut v);
    let formats = check_plugins(&contents, &manifest, &sub, inspect, &mut v);
    check_plugin_records(&sub, &formats, &result, &mut v);
    if let Some((suite, released)) = &suite {
        hardware::check_labels(suite, released, &manifest, &sub, &result, &mut v);
        hardware::check_hardware(suite, &sub, &result, contents.get(MACHINE).map(Vec::as_slice), &mut v);
        check_plan(suite, &sub, &result, &mut v);
        check_steps(suite, &result, &mut v);
        figures::check(suite, &result, &mut v);
    }
    log::check(contents.get(LOG).map(Vec::as_slice), &result, &mut v);
    check_failures(&result, &mut v);
    check_official(suite.as_ref().map(|s| &s.0), &sub, &formats, &result, &mut v);
    v
}

fn read_manifest(dir: &Path) -> Result<Manifest, String> {
    let bytes =
        files::read(dir, MANIFEST, files::MANIFEST_CAP).map_err(|e| format!("cannot read the manifest of {}: {e}", dir.display()))?;
    let probe: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| format!("{MANIFEST} is not JSON: {e}"))?;
    let found = probe.get("bundle_format").and_then(|f| f.as_u64()).unwrap_or(0);
    if found > BUNDLE_FORMAT as u64 {
        return Err(format!("the bundle has format {found}; this harness reads format {BUNDLE_FORMAT} (upgrade harness)"));
    }
    serde_json::from_value(probe).map_err(|e| format!("{MANIFEST} is not a bundle manifest: {e}"))
}

/// Rule 1: every listed file is inside the bundle, within the caps, whole
/// and unchanged. Returns what was read, by path (files that could not be
/// read are left out; their violations say why).
fn check_files(dir: &Path, m: &Manifest, v: &mut Verdict) -> Contents {
    let mut contents = Contents::new();
    if m.files.len() > files::MAX_FILES {
        v.add("files", format!("the manifest lists {} files; a bundle holds at most {}", m.files.len(), files::MAX_FILES), RESUBMIT);
        return contents;
    }
    let mut budget = files::TOTAL_CAP;
    for f in &m.files {
        if contents.contains_key(&f.path) {
            v.add("files", format!("the manifest lists {} twice", f.path), RESUBMIT);
            continue;
        }
        let cap = files::cap(&f.path).min(budget);
        if f.bytes > cap {
            v.add(
                "files",
                format!("the manifest says {} has {} bytes; verify reads at most {cap} bytes of it (a bundle's files: {} bytes each, {} in all; docs/rules.md, \"Size limits\")", f.path, f.bytes, files::cap(&f.path), files::TOTAL_CAP),
                RESUBMIT,
            );
            continue;
        }
        let bytes = match files::read(dir, &f.path, cap) {
            Ok(b) => b,
            Err(e) => {
                v.add("files", e, RESUBMIT);
                continue;
            }
        };
        budget -= bytes.len() as u64;
        if bytes.len() as u64 != f.bytes {
            let truncated = if (bytes.len() as u64) < f.bytes { " (truncated?)" } else { "" };
            v.add("files", format!("{} has {} bytes, the manifest says {}{truncated}", f.path, bytes.len(), f.bytes), RESUBMIT);
        } else if sha256_hex(&bytes) != f.sha256 {
            v.add("files", format!("{} was changed after it was bundled (its sha256 is not the manifest's)", f.path), RESUBMIT);
        }
        contents.insert(f.path.clone(), bytes);
    }
    for required in [RESULT, SUITE, MACHINE] {
        if !m.files.iter().any(|f| f.path == required) {
            v.add("files", format!("the manifest lists no {required}"), RESUBMIT);
        }
    }
    contents
}

/// Rule 2: every planned entry has one result, labelled as its plan
/// entry, nothing else has one, and every finished entry carries its
/// figures: an entry `ok` without metrics would be skipped by every check
/// below and by the board's pairing, which would then drop its repeat.
fn check_complete(result: &RunResult, v: &mut Verdict) {
    let missing: Vec<&str> = result.plan.iter().filter(|p| !result.entries.iter().any(|e| e.id == p.id)).map(|p| p.id.as_str()).collect();
    if !missing.is_empty() || !result.complete {
        v.add(
            "result",
            format!(
                "the run is incomplete: {} of {} planned entries have no result ({})",
                missing.len(),
                result.plan.len(),
                list(&missing)
            ),
            "finish it with `harness run SUITE --plugin ... --out RESULT --resume`, then submit it again",
        );
    }
    let mut seen = BTreeSet::new();
    let (mut twice, mut unplanned, mut relabelled, mut bare) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for e in &result.entries {
        if !seen.insert(e.id.as_str()) {
            twice.push(e.id.as_str());
        }
        match result.plan.iter().find(|p| p.id == e.id) {
            None => unplanned.push(e.id.as_str()),
            Some(p) if p.strategy.name != e.strategy || p.repeat != e.repeat || p.seed != e.seed => relabelled.push(format!(
                "{} says strategy `{}`, repeat {}, seed {}; its plan entry `{}`, {}, {}",
                e.id, e.strategy, e.repeat, e.seed, p.strategy.name, p.repeat, p.seed
            )),
            Some(_) => {}
        }
        if e.status == EntryStatus::Ok && e.metrics.is_none() {
            bare.push(e.id.as_str());
        }
    }
    const AS_WRITTEN: &str = "submit the result of the run as it was written: every planned entry has one result";
    if !twice.is_empty() {
        v.add("result", format!("entries have more than one result: {}", list(&twice)), AS_WRITTEN);
    }
    if !unplanned.is_empty() {
        v.add("result", format!("entries have a result but are not in the plan: {}", list(&unplanned)), AS_WRITTEN);
    }
    if !relabelled.is_empty() {
        v.add("result", format!("entries are labelled otherwise than their plan entry: {}", list(&relabelled)), AS_WRITTEN);
    }
    if !bare.is_empty() {
        v.add(
            "result",
            format!(
                "{} entries finished (`ok`) without metrics, so none of their figures can be checked or ranked: {}",
                bare.len(),
                list(&bare)
            ),
            "submit the result of the run as it was written: every finished entry records its figures",
        );
    }
}

/// Rule 2: the result file holds no field that this harness does not
/// know. Such a field would be dropped when the result is read, so it
/// changes nothing that is checked or ranked, only the bundle's bytes: a
/// result this harness writes never has one. Every object key of the file
/// must come back when the result as read is written again (fields that
/// an older result format lacks are read with their defaults and written
/// only when set, so older files still pass).
fn check_known_fields(raw: &[u8], result: &RunResult, v: &mut Verdict) {
    let (Ok(file), Ok(known)) = (serde_json::from_slice::<serde_json::Value>(raw), serde_json::to_value(result)) else { return };
    let mut unknown = Vec::new();
    unknown_keys(&file, &known, "", &mut unknown);
    if !unknown.is_empty() {
        v.add(
            "result",
            format!("{RESULT} has fields this harness does not know (they would be dropped unread): {}", list(&unknown)),
            "submit the result of the run as it was written, without fields added to it",
        );
    }
}

/// The paths (`entries[3].metrics.extra`) of the object keys of `file`
/// that `known` lacks.
fn unknown_keys(file: &serde_json::Value, known: &serde_json::Value, path: &str, out: &mut Vec<String>) {
    use serde_json::Value;
    match (file, known) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, x) in a {
                let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                match b.get(k) {
                    None => out.push(format!("`{p}`")),
                    Some(y) => unknown_keys(x, y, &p, out),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                unknown_keys(x, y, &format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

/// Rule 3: the suite that ran is a released standard suite, unchanged.
/// Returns it, parsed, and the release it is, when it is.
fn check_suite(contents: &Contents, m: &Manifest, r: &RunResult, v: &mut Verdict) -> Option<(Suite, &'static Released)> {
    let text = &r.suite.text;
    if sha256_hex(text.as_bytes()) != r.suite.sha256 {
        v.add("suite", "the result's suite text does not match its recorded sha256", RESUBMIT);
    }
    if contents.get(SUITE).is_some_and(|s| s.as_slice() != text.as_bytes()) {
        v.add("suite", format!("{SUITE} is not the suite text recorded in {RESULT}"), RESUBMIT);
    }
    if m.suite.sha256 != r.suite.sha256 {
        v.add("suite", format!("the manifest's suite hash is not the one in {RESULT}"), RESUBMIT);
    }
    let Some(rel) = standard::released(text) else {
        let what = match closest_released(&r.suite.name, text) {
            Some((file, line, got, want)) => format!(
                "the suite is not a released standard suite: it differs from {file} at line {line}: `{}` (released: `{}`)",
                got.trim(),
                want.trim()
            ),
            None => format!("the suite `{}` is not a standard suite released with this harness", r.suite.name),
        };
        v.add("suite", what, "run the released suite file unchanged: harness run suites/<class>.toml --plugin KIND=PATH");
        return None;
    };
    match Suite::parse(Path::new(rel.file), rel.text.to_owned()) {
        Ok(s) => Some((s, rel)),
        Err(e) => {
            v.add("suite", format!("the released suite {} does not parse: {e}", rel.file), "report this as a harness bug");
            None
        }
    }
}

/// The released suite named `name` and the first line where `text`
/// differs from it: (file, line number, line in text, released line).
fn closest_released(name: &str, text: &str) -> Option<(&'static str, usize, String, String)> {
    let r = standard::RELEASED.iter().find(|r| {
        r.text.parse::<toml::Table>().ok().and_then(|t| t.get("suite")?.get("name")?.as_str().map(str::to_owned)).as_deref() == Some(name)
    })?;
    let (a, b): (Vec<&str>, Vec<&str>) = (text.lines().collect(), r.text.lines().collect());
    let n = a.len().max(b.len());
    (0..n)
        .find(|&i| a.get(i) != b.get(i))
        .map(|i| (r.file, i + 1, a.get(i).unwrap_or(&"").to_string(), b.get(i).unwrap_or(&"").to_string()))
}

/// Rule 4: the bundled artifacts are the ones that ran, and components.
/// Returns, per entered plugin, what its bundled artifact is by its bytes
/// (None when there is no artifact whose sha256 is the one that ran).
fn check_plugins(contents: &Contents, m: &Manifest, sub: &Submission, inspect: Inspect, v: &mut Verdict) -> Vec<Option<ArtifactFormat>> {
    if sub.entered.is_empty() {
        v.add("plugin", "the run entered no plugin", "enter one with `harness run SUITE --plugin KIND=PATH`");
    }
    let mut formats = Vec::new();
    for p in &sub.entered {
        formats.push(check_artifact(contents, m, p, inspect, v));
    }
    formats
}

/// [`check_plugins`] for one entered plugin.
fn check_artifact(
    contents: &Contents,
    m: &Manifest,
    p: &harness_format::results::EnteredPlugin,
    inspect: Inspect,
    v: &mut Verdict,
) -> Option<ArtifactFormat> {
    let Some(mp) = m.plugins.iter().find(|mp| mp.kind == p.kind) else {
        v.add("plugin", format!("the manifest does not list the entered {} `{}`", p.kind, p.name), RESUBMIT);
        return None;
    };
    if mp.sha256 != p.sha256 || mp.bytes != p.bytes {
        v.add(
            "plugin",
            format!(
                "the manifest's {} `{}` (sha256 {}) is not the one that ran (sha256 {})",
                p.kind,
                mp.name,
                short(&mp.sha256),
                short(&p.sha256)
            ),
            RESUBMIT,
        );
    }
    let Some(file) = &mp.file else {
        v.add(
            "plugin",
            format!(
                "the {} `{}` {} is bundled as its sha256 and size only (`--no-artifacts`): verify cannot check that it is the plugin the result names, nor that it is a WebAssembly component that ran sandboxed",
                p.kind, p.name, p.version
            ),
            "submit without --no-artifacts: the artifact that ran goes into the bundle",
        );
        return None;
    };
    if !m.files.iter().any(|f| f.path == *file) {
        v.add(
            "plugin",
            format!("the manifest names {file} as the {} `{}` but does not list it with its sha256 among its files", p.kind, p.name),
            RESUBMIT,
        );
        return None;
    }
    let bytes = contents.get(file)?; // unreadable: reported by rule 1
    let sha = sha256_hex(bytes);
    if sha != p.sha256 {
        v.add(
            "plugin",
            format!("{file} is not the artifact that ran: its sha256 is {}, the run loaded {}", short(&sha), short(&p.sha256)),
            "bundle the artifact that ran: `harness submit` copies it from the path the run loaded",
        );
        return None;
    }
    let format = ArtifactFormat::of(bytes);
    if format != ArtifactFormat::Component {
        let label = if p.transport == "wasm" { ", whatever the result's transport label `wasm` says" } else { "" };
        v.add(
            "plugin",
            format!(
                "{file} is {} (it starts with {}), not a WebAssembly component{label}: verify loads nothing but components, and those only in the sandbox, so it was not loaded",
                format.describe(),
                head_hex(bytes, 8)
            ),
            "enter a WebAssembly component (built for wasm32-wasip2): submissions run sandboxed",
        );
        return Some(format);
    }
    match inspect(bytes) {
        Ok(info) if info.kind.name() != p.kind || info.name != p.name || info.version != p.version => v.add(
            "plugin",
            format!(
                "{file} says it is the {} `{}` {}, the result names the {} `{}` {}",
                info.kind.name(),
                info.name,
                info.version,
                p.kind,
                p.name,
                p.version
            ),
            RESUBMIT,
        ),
        Ok(_) => {}
        Err(e) => v.add("plugin", format!("{file} does not load in the sandbox: {e:#}"), "bundle the artifact that ran"),
    }
    Some(format)
}

/// Rule 4, the entries' side: every entry of a submission strategy
/// recorded running the entered plugin (its sha256, name and version),
/// with the transport its bytes give. An entry from a run of another
/// plugin, or a relabelled one, names another.
fn check_plugin_records(sub: &Submission, formats: &[Option<ArtifactFormat>], r: &RunResult, v: &mut Verdict) {
    for (p, format) in sub.entered.iter().zip(formats) {
        let transport = match format {
            Some(ArtifactFormat::Component) => Some(harness_format::plugin::Transport::Wasm),
            Some(f) if f.is_native() => Some(harness_format::plugin::Transport::Native),
            _ => None,
        };
        if let Some(t) = transport.filter(|t| (*t == harness_format::plugin::Transport::Wasm) != (p.transport == "wasm")) {
            v.add(
                "labels",
                format!("the result labels the entered plugin's transport `{}`; its bytes make it `{}`", p.transport, transport_name(t)),
                RESUBMIT,
            );
        }
        let mut wrong = Vec::new();
        for e in r.entries.iter().filter(|e| p.strategies.contains(&e.strategy)) {
            let Some(m) = &e.metrics else { continue };
            match m.plugins.iter().find(|rec| rec.manifest.kind.name() == p.kind) {
                None => wrong.push(format!("{} recorded no {} plugin", e.id, p.kind)),
                Some(rec) if rec.manifest.sha256 != p.sha256 || rec.manifest.name != p.name || rec.manifest.version != p.version => wrong
                    .push(format!(
                        "{} ran the {} `{}` {} (sha256 {})",
                        e.id,
                        p.kind,
                        rec.manifest.name,
                        rec.manifest.version,
                        short(&rec.manifest.sha256)
                    )),
                Some(rec) if transport.is_some_and(|t| t != rec.manifest.transport) => wrong.push(format!(
                    "{} records the plugin's transport as `{}`; its bytes make it `{}`",
                    e.id,
                    transport_name(rec.manifest.transport),
                    transport.map_or("", transport_name)
                )),
                Some(_) => {}
            }
        }
        if !wrong.is_empty() {
            v.add(
                "plugin",
                format!(
                    "entries of the submission do not record running the entered {} `{}` {} (sha256 {}): {}",
                    p.kind,
                    p.name,
                    p.version,
                    short(&p.sha256),
                    list(&wrong)
                ),
                "submit the result of the run as it was written: every entry of a submission runs the plugin that is bundled",
            );
        }
    }
}

fn transport_name(t: harness_format::plugin::Transport) -> &'static str {
    match t {
        harness_format::plugin::Transport::Wasm => "wasm",
        harness_format::plugin::Transport::Native => "native",
    }
}

/// Rule 7: the plan is what the released suite gives for this entry.
fn check_plan(released: &Suite, sub: &Submission, r: &RunResult, v: &mut Verdict) {
    let mut suite = released.clone();
    suite.spec.suite.world_size = sub.gpus;
    let entry = sub.entered.first().map(|p| Entry {
        kind: p.kind.clone(),
        path: p.path.clone().into(),
        config: p.config.parse::<toml::Table>().ok().filter(|t| !t.is_empty()),
    });
    let track = match sub.tracks.as_slice() {
        [one] => Some(one.as_str()),
        _ => None,
    };
    let tracks = match suite.select(track, entry.as_ref()) {
        Ok((tracks, _)) => tracks,
        Err(e) => {
            v.add("plan", format!("the released suite does not take this entry: {e}"), "enter the plugin as `harness run` takes it");
            return;
        }
    };
    if tracks != sub.tracks {
        v.add(
            "plan",
            format!("the result ran tracks {}; the suite on {} GPUs gives {}", list(&sub.tracks), sub.gpus, list(&tracks)),
            "run every track of the plugin's kind (no --track), or one track",
        );
    }
    let want = suite.plan().entries;
    let got: BTreeMap<&str, &harness_format::suite::PlanEntry> = r.plan.iter().map(|p| (p.id.as_str(), p)).collect();
    let want_ids: BTreeSet<&str> = want.iter().map(|p| p.id.as_str()).collect();
    let lacking: Vec<&str> = want.iter().map(|p| p.id.as_str()).filter(|id| !got.contains_key(id)).collect();
    let extra: Vec<&str> = r.plan.iter().map(|p| p.id.as_str()).filter(|id| !want_ids.contains(id)).collect();
    // Repeats: per workload and strategy, as the suite asks.
    let mut repeats: BTreeMap<(String, String), (usize, usize)> = BTreeMap::new();
    for p in &want {
        repeats.entry((suite.spec.workloads[p.workload].name.clone(), p.strategy.name.clone())).or_default().1 += 1;
    }
    for e in &r.entries {
        if let Some(c) = repeats.get_mut(&(e.workload.clone(), e.strategy.clone())) {
            c.0 += 1;
        }
    }
    for ((w, s), (ran, asked)) in &repeats {
        if ran < asked {
            v.add(
                "plan",
                format!("{w}/{s} ran {ran} of the {asked} repeats the suite asks for"),
                "run every repeat: the released suite unchanged, without editing the result",
            );
        }
    }
    if !lacking.is_empty() {
        v.add(
            "plan",
            format!("the plan lacks {} entries of the released suite: {}", lacking.len(), list(&lacking)),
            "run the released suite unchanged",
        );
    }
    if !extra.is_empty() {
        v.add("plan", format!("the plan has entries the released suite does not: {}", list(&extra)), "run the released suite unchanged");
    }
    let relabelled: Vec<String> = r
        .entries
        .iter()
        .filter_map(|e| {
            let p = want.iter().find(|p| p.id == e.id)?;
            let w = &suite.spec.workloads[p.workload].name;
            (*w != e.workload).then(|| format!("{} says workload `{}`; the suite's entry is of `{w}`", e.id, e.workload))
        })
        .collect();
    if !relabelled.is_empty() {
        v.add("plan", format!("entries are labelled with another workload: {}", list(&relabelled)), "run the released suite unchanged");
    }
    for p in &want {
        let Some(g) = got.get(p.id.as_str()) else { continue };
        if g.seed != p.seed || g.repeat != p.repeat {
            v.add(
                "plan",
                format!("{} ran with seed {} (repeat {}); the suite gives seed {} (repeat {})", p.id, g.seed, g.repeat, p.seed, p.repeat),
                "run the released suite unchanged",
            );
        } else if g.strategy != p.strategy {
            let who = if p.strategy.baseline { "the baseline" } else { "the strategy" };
            v.add("plan", format!("{} ran {who} `{}` modified", p.id, p.strategy.name), "run the released suite unchanged");
        }
    }
}

/// Rule 8: steps, warm-up and step histograms.
fn check_steps(suite: &Suite, r: &RunResult, v: &mut Verdict) {
    for e in &r.entries {
        let (EntryStatus::Ok, Some(m)) = (&e.status, &e.metrics) else { continue };
        let Some(w) = suite.spec.workloads.iter().find(|w| w.name == e.workload) else { continue };
        if let Some(steps) = w.steps {
            // An entry that stops at its target ends at the evaluation that
            // reached it, within its steps.
            let stopped_at_target = w.stop_at_target && m.steps <= steps && m.steps_to_target == Some(m.steps);
            if m.steps != steps && !stopped_at_target {
                let why = if w.stop_at_target { format!(" and did not reach its target at step {}", m.steps) } else { String::new() };
                v.add(
                    "steps",
                    format!("{} trained {} steps{why}; the workload has {steps}", e.id, m.steps),
                    "run the released suite unchanged",
                );
            }
        }
        let warmup = suite.spec.suite.warmup_steps.min(m.steps);
        if m.warmup_steps != warmup {
            v.add(
                "steps",
                format!("{} left {} warm-up steps out of timing; the suite says {warmup}", e.id, m.warmup_steps),
                "run the released suite unchanged",
            );
        }
        let Some(encoded) = e.histograms.get("step") else {
            v.add("histograms", format!("{} has no step histogram", e.id), RESUBMIT);
            continue;
        };
        let h = match harness_format::histogram::decode(encoded) {
            Ok(h) => h,
            Err(err) => {
                v.add("histograms", format!("{}'s step histogram does not decode: {err}", e.id), RESUBMIT);
                continue;
            }
        };
        let count = h.len();
        if m.step.as_ref().map_or(0, |s| s.count) != count {
            v.add(
                "histograms",
                format!("{}'s step summary counts {} steps, its histogram {count}", e.id, m.step.as_ref().map_or(0, |s| s.count)),
                RESUBMIT,
            );
        }
        let timed = m.steps - m.warmup_steps;
        // Steps redone after a failure or an out-of-memory retry are timed
        // too: the count lies between the useful steps and those executed.
        let redone = m.resilience.as_ref().filter(|x| !x.failures.is_empty() || !x.out_of_memory.is_empty());
        let ok = match redone {
            None => count == timed,
            Some(x) => count >= timed && count <= x.steps_executed,
        };
        if !ok {
            v.add(
                "histograms",
                format!(
                    "{}'s step histogram holds {count} steps; {} steps after {} of warm-up{}",
                    e.id,
                    m.steps,
                    m.warmup_steps,
                    redone.map(|x| format!(", {} executed", x.steps_executed)).unwrap_or_default()
                ),
                RESUBMIT,
            );
        }
    }
}

/// Rule 10, the result's side: no entry failed (the log's side is [`log`]).
fn check_failures(r: &RunResult, v: &mut Verdict) {
    for e in &r.entries {
        if let EntryStatus::Failed { error, kind } = &e.status {
            v.add(
                "failures",
                format!("{} failed ({}): {}", e.id, kind.as_deref().unwrap_or("error"), error.lines().next().unwrap_or("")),
                "fix the cause and run again: a submission scores only when every entry trained",
            );
        }
    }
}

/// Rule 11: official hardware, GPU count and a sandboxed plugin, judged
/// again from the result's own fingerprint and the artifact's own bytes
/// (`formats`, from [`check_plugins`]), never from the result's labels (an
/// edited suite is rule 3's).
fn check_official(suite: Option<&Suite>, sub: &Submission, formats: &[Option<ArtifactFormat>], r: &RunResult, v: &mut Verdict) {
    let Some(s) = suite else { return };
    const TODO: &str = "run on the suite's hardware class and one of its GPU counts, with a WebAssembly plugin and no HARNESS_* switch set";
    // The transports are judged below from the bytes: the labels are set
    // so that they add no reason of their own.
    let mut as_released = Submission { released_suite: true, ..sub.clone() };
    for p in &mut as_released.entered {
        p.transport = "wasm".into();
    }
    let reasons = as_released.unofficial_reasons(s, &r.machine, &r.switches);
    for why in &reasons {
        v.add("official", format!("the run is unofficial: {why}"), TODO);
    }
    let mut native = false;
    for (p, f) in sub.entered.iter().zip(formats) {
        if let Some(f) = f.filter(|f| f.is_native()) {
            native = true;
            v.add(
                "official",
                format!(
                    "the run is unofficial: the entered plugin {} is {} by its bytes (unsandboxed); submissions are WebAssembly components",
                    p.name,
                    f.describe()
                ),
                TODO,
            );
        }
    }
    if reasons.is_empty() && !native && !sub.unofficial.is_empty() {
        v.add(
            "official",
            format!(
                "the run recorded itself as unofficial ({}), and the result as bundled says otherwise: its fingerprint or labels were edited",
                sub.unofficial.join("; ")
            ),
            "submit the result of the run as it was written",
        );
    }
}
