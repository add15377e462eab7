//! `harness validate`: each suite checked, and its plugins configured.

use std::path::Path;

use super::args::ValidateArgs;
use harness_format::exit;
use harness_format::fmt::{counted, printable, printable_path};
use harness_format::suite::Suite;

/// Which strategies [`configure_all`] configures.
pub(super) enum Configure<'a> {
    /// Every strategy of the suite (`harness validate`).
    All,
    /// The strategies of a plugin entered with `--plugin` (`harness run`;
    /// their names).
    Entered(&'a [String]),
}

/// Configures every plugin of the strategies `which` names with the
/// strategy's config (an instance on the CPU, as a rank would make it); the
/// errors, each at the strategy's config key in the suite file, or, for a
/// plugin entered with `--plugin`, at its `--plugin-config` keys, once
/// however many tracks it runs in.
pub(super) fn configure_all(s: &Suite, set: &harness_sandbox::plugin::PluginSet, which: Configure<'_>) -> Vec<String> {
    use harness_sandbox::plugin::Kind;
    let entered: &[String] = match which {
        Configure::All => &[],
        Configure::Entered(names) => names,
    };
    let mut errors: Vec<String> = Vec::new();
    for (i, st) in s.spec.strategies.iter().enumerate() {
        if matches!(which, Configure::Entered(_)) && !entered.contains(&st.name) {
            continue;
        }
        let slots = [
            (&st.compressor, "compressor", "compressor_config", Kind::Compressor, st.compressor_config.as_ref()),
            (&st.batch_policy, "batch_policy", "batch_policy_config", Kind::BatchPolicy, st.batch_policy_config.as_ref()),
            (&st.checkpoint, "checkpoint", "checkpoint_config", Kind::CheckpointPolicy, st.checkpoint_config.as_ref()),
        ];
        for (name, key, config_key, kind, config) in slots {
            if !set.has(name) {
                continue;
            }
            if let Err(e) = set.instance(name, key, kind, config, tch::Device::Cpu) {
                let why = harness_format::error::without_backtrace(&format!("{e:#}"));
                let error = if entered.contains(&st.name) {
                    format!("error: --plugin-config: {why}\nhint: fix the --plugin-config keys; the plugin says what it accepts")
                } else {
                    let at = if config.is_some() { config_key } else { key };
                    let hint = format!("fix `{at}` of strategy `{}`; the plugin says what it accepts", st.name);
                    s.strategy_error(i, at, format!("strategy `{}`: {why}", st.name), Some(hint)).to_string()
                };
                if !errors.contains(&error) {
                    errors.push(error);
                }
            }
        }
    }
    errors
}

/// `harness validate`: checks each suite ([`validate_one`]); any invalid
/// suite or plugin is [`exit::INVALID_SUITE`], after all were checked.
pub(super) fn validate(args: ValidateArgs) -> anyhow::Result<i32> {
    let mut code = exit::OK;
    for suite in &args.suites {
        if validate_one(suite)? != exit::OK {
            code = exit::INVALID_SUITE;
        }
    }
    Ok(code)
}

/// Loads the suite, loads each of its plugins and configures it as the
/// suite does, and prints what it found; an invalid suite or plugin is
/// [`exit::INVALID_SUITE`].
fn validate_one(suite: &Path) -> anyhow::Result<i32> {
    let s = match Suite::load(suite) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return Ok(exit::INVALID_SUITE);
        }
    };
    let dir = s.path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let set = harness_sandbox::plugin::PluginSet::new(&s.spec.plugins, dir);
    if check_plugins(&s, &set) > 0 {
        return Ok(exit::INVALID_SUITE);
    }
    // Each plugin configured as the suite configures it, so a
    // misspelt key fails here and not when its entry runs.
    let errors = configure_all(&s, &set, Configure::All);
    for e in &errors {
        eprintln!("{e}");
    }
    if !errors.is_empty() {
        return Ok(exit::INVALID_SUITE);
    }
    let plan = s.plan();
    println!(
        "{}: ok ({}, {}, {})",
        printable_path(suite),
        counted(s.spec.workloads.len(), "workload", "workloads"),
        counted(s.strategies().len(), "strategy", "strategies"),
        counted(plan.entries.len(), "entry", "entries")
    );
    Ok(exit::OK)
}

/// Loads every plugin of the suite: prints what each is, or (to stderr) why
/// it cannot be loaded. Returns how many could not.
fn check_plugins(s: &Suite, set: &harness_sandbox::plugin::PluginSet) -> usize {
    let mut bad = 0;
    for (spec, r) in s.spec.plugins.iter().zip(set.check_all()) {
        match r {
            Ok(m) => {
                let transport = match m.transport {
                    harness_sandbox::plugin::Transport::Wasm => format!("wasm, contract {}", m.abi),
                    harness_sandbox::plugin::Transport::Native => "native, unsandboxed".to_owned(),
                };
                // The artifact chose its name and version.
                let line =
                    format!("plugin `{}`: {} {} ({}, {transport}) from {}", spec.name, m.name, m.version, m.kind.name(), m.path.display());
                println!("{}", printable(&line));
            }
            Err(e) => {
                bad += 1;
                eprintln!("error: {}", printable(&e.to_string()));
            }
        }
    }
    bad
}
