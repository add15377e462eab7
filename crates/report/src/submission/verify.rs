//! `harness verify BUNDLE`: checks a submission bundle the way a package
//! checker does, and says for each rule it breaks what is wrong and what to
//! do. The checks, in order (docs/rules.md, "Verification"):
//!
//! 1. every file the manifest lists is there, with its size and sha256;
//! 2. the result file reads, and every planned entry has a result;
//! 3. the suite is byte-identical to a standard suite this harness releases;
//! 4. each entered plugin's artifact is the one that ran (its sha256), and
//!    says it is the plugin the result names;
//! 5. the plan is the one the released suite gives for this entry: repeats,
//!    seeds, steps, warm-up and the baselines unmodified;
//! 6. each entry ran the workload's steps and warm-up, and its step
//!    histogram agrees with its step counts;
//! 7. every failure is reported: no entry failed, and the run's log reports
//!    no failure the result lacks;
//! 8. the run is official (hardware class, GPU count, sandboxed plugin, no
//!    switch that changed the measured work).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde::Serialize;

use super::{sha256_hex, Manifest, BUNDLE_FORMAT, LOG, MANIFEST, RESULT, SUITE};
use crate::results::{EntryStatus, RunResult, Submission};
use crate::suite::standard::{self, Entry};
use crate::suite::Suite;

/// One broken rule: what is wrong, and what to do about it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Violation {
    /// The rule (the check's short name: files, result, suite, plugin,
    /// plan, steps, histograms, failures, official).
    pub rule: &'static str,
    pub what: String,
    pub todo: String,
}

/// What `verify` found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Verdict {
    pub violations: Vec<Violation>,
    /// Facts worth saying that break no rule.
    pub notes: Vec<String>,
}

impl Verdict {
    pub fn verified(&self) -> bool {
        self.violations.is_empty()
    }

    fn add(&mut self, rule: &'static str, what: impl Into<String>, todo: impl Into<String>) {
        self.violations.push(Violation { rule, what: what.into(), todo: todo.into() });
    }

    /// The one-line reasons, for a leaderboard row.
    pub fn reasons(&self) -> Vec<String> {
        self.violations.iter().map(|v| format!("{}: {}", v.rule, v.what)).collect()
    }
}

const RESUBMIT: &str = "run `harness submit` again on the original result file";

/// Reads a plugin artifact's manifest (name, version, kind): the caller
/// decides how, since reading one means loading it. The report layer holds
/// no plugin runtime.
pub type Inspect<'a> = &'a dyn Fn(&Path) -> anyhow::Result<crate::plugin::Manifest>;

/// Checks the bundle in `dir`; `inspect` reads the bundled artifacts' manifests.
pub fn verify(dir: &Path, inspect: Inspect) -> Verdict {
    let mut v = Verdict::default();
    let manifest = match read_manifest(dir) {
        Ok(m) => m,
        Err(what) => {
            v.add("files", what, "verify the folder that `harness submit` wrote (it holds MANIFEST.json)");
            return v;
        }
    };
    check_files(dir, &manifest, &mut v);
    let result = match RunResult::read(&dir.join(RESULT)) {
        Ok(r) => r,
        Err(e) => {
            v.add("result", format!("{RESULT} cannot be read as a result: {e}"), RESUBMIT);
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
    let suite = check_suite(dir, &manifest, &result, &mut v);
    check_plugins(dir, &manifest, &sub, inspect, &mut v);
    if let Some(suite) = &suite {
        check_plan(suite, &sub, &result, &mut v);
        check_steps(suite, &result, &mut v);
    }
    check_failures(dir, &result, &mut v);
    check_official(suite.as_ref(), &sub, &result, &mut v);
    v
}

fn read_manifest(dir: &Path) -> Result<Manifest, String> {
    let path = dir.join(MANIFEST);
    let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let probe: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{MANIFEST} is not JSON: {e}"))?;
    let found = probe.get("bundle_format").and_then(|f| f.as_u64()).unwrap_or(0);
    if found > BUNDLE_FORMAT as u64 {
        return Err(format!("the bundle has format {found}; this harness reads format {BUNDLE_FORMAT} (upgrade harness)"));
    }
    serde_json::from_value(probe).map_err(|e| format!("{MANIFEST} is not a bundle manifest: {e}"))
}

/// Rule 1: every listed file is there, whole and unchanged.
fn check_files(dir: &Path, m: &Manifest, v: &mut Verdict) {
    for f in &m.files {
        match std::fs::read(dir.join(&f.path)) {
            Err(e) => v.add("files", format!("{} is missing: {e}", f.path), RESUBMIT),
            Ok(bytes) if bytes.len() as u64 != f.bytes => v.add(
                "files",
                format!(
                    "{} has {} bytes, the manifest says {}{}",
                    f.path,
                    bytes.len(),
                    f.bytes,
                    if (bytes.len() as u64) < f.bytes { " (truncated?)" } else { "" }
                ),
                RESUBMIT,
            ),
            Ok(bytes) if sha256_hex(&bytes) != f.sha256 => {
                v.add("files", format!("{} was changed after it was bundled (its sha256 is not the manifest's)", f.path), RESUBMIT)
            }
            Ok(_) => {}
        }
    }
    for required in [RESULT, SUITE] {
        if !m.files.iter().any(|f| f.path == required) {
            v.add("files", format!("the manifest lists no {required}"), RESUBMIT);
        }
    }
}

/// Rule 3: the suite that ran is a released standard suite, unchanged.
/// Returns it, parsed, when it is.
fn check_suite(dir: &Path, m: &Manifest, r: &RunResult, v: &mut Verdict) -> Option<Suite> {
    let text = &r.suite.text;
    if sha256_hex(text.as_bytes()) != r.suite.sha256 {
        v.add("suite", "the result's suite text does not match its recorded sha256", RESUBMIT);
    }
    if std::fs::read_to_string(dir.join(SUITE)).is_ok_and(|s| s != *text) {
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
        Ok(s) => Some(s),
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

/// Rule 4: the bundled artifacts are the ones that ran.
fn check_plugins(dir: &Path, m: &Manifest, sub: &Submission, inspect: Inspect, v: &mut Verdict) {
    if sub.entered.is_empty() {
        v.add("plugin", "the run entered no plugin", "enter one with `harness run SUITE --plugin KIND=PATH`");
    }
    for p in &sub.entered {
        let Some(mp) = m.plugins.iter().find(|mp| mp.kind == p.kind) else {
            v.add("plugin", format!("the manifest does not list the entered {} `{}`", p.kind, p.name), RESUBMIT);
            continue;
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
            v.notes.push(format!("the {} `{}` {} is bundled as its sha256 and size only", p.kind, p.name, p.version));
            continue;
        };
        let path = dir.join(file);
        let Ok(bytes) = std::fs::read(&path) else { continue }; // reported by rule 1
        let sha = sha256_hex(&bytes);
        if sha != p.sha256 {
            v.add(
                "plugin",
                format!("{file} is not the artifact that ran: its sha256 is {}, the run loaded {}", short(&sha), short(&p.sha256)),
                "bundle the artifact that ran: `harness submit` copies it from the path the run loaded",
            );
            continue;
        }
        match inspect(&path) {
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
            Err(e) => v.add("plugin", format!("{file} does not load: {e:#}"), "bundle the artifact that ran"),
        }
    }
}

/// Rule 5: the plan is what the released suite gives for this entry.
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
    let got: BTreeMap<&str, &crate::suite::PlanEntry> = r.plan.iter().map(|p| (p.id.as_str(), p)).collect();
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

/// Rule 6: steps, warm-up and step histograms.
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
        let h = match crate::measure::decode(encoded) {
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

/// Rule 7: no entry failed, and the log reports no failure the result lacks.
fn check_failures(dir: &Path, r: &RunResult, v: &mut Verdict) {
    let failed: BTreeSet<&str> =
        r.entries.iter().filter(|e| matches!(e.status, EntryStatus::Failed { .. })).map(|e| e.id.as_str()).collect();
    for e in &r.entries {
        if let EntryStatus::Failed { error, kind } = &e.status {
            v.add(
                "failures",
                format!("{} failed ({}): {}", e.id, kind.as_deref().unwrap_or("error"), error.lines().next().unwrap_or("")),
                "fix the cause and run again: a submission scores only when every entry trained",
            );
        }
    }
    match std::fs::read_to_string(dir.join(LOG)) {
        Err(_) => v.add(
            "failures",
            format!("the bundle has no run log ({LOG})"),
            "submit from where `harness run` wrote the result (its log is <result>.log next to it), or pass --log",
        ),
        Ok(log) => {
            let in_log: BTreeSet<&str> = log.lines().filter_map(|l| l.trim_start().split_once(" FAILED: ").map(|(id, _)| id)).collect();
            let unreported: Vec<&str> = in_log.difference(&failed).copied().collect();
            if !unreported.is_empty() {
                v.add(
                    "failures",
                    format!("the run's log reports failures the result does not: {}", list(&unreported)),
                    "submit the result of the run as it was written; a failed entry may not be run again to replace it",
                );
            }
        }
    }
}

/// Rule 8: official hardware, GPU count and a sandboxed plugin, judged
/// again from the result's own fingerprint (an edited suite is rule 3's).
fn check_official(suite: Option<&Suite>, sub: &Submission, r: &RunResult, v: &mut Verdict) {
    let Some(s) = suite else { return };
    let as_released = Submission { released_suite: true, ..sub.clone() };
    for why in as_released.unofficial_reasons(s, &r.machine, &r.switches) {
        v.add(
            "official",
            format!("the run is unofficial: {why}"),
            "run on the suite's hardware class and one of its GPU counts, with a WebAssembly plugin and no HARNESS_* switch set",
        );
    }
}

fn short(sha: &str) -> &str {
    &sha[..sha.len().min(12)]
}

fn list<S: AsRef<str>>(xs: &[S]) -> String {
    const SHOWN: usize = 6;
    let mut s = xs.iter().take(SHOWN).map(|x| x.as_ref().to_owned()).collect::<Vec<_>>().join(", ");
    if xs.len() > SHOWN {
        s.push_str(&format!(", and {} more", xs.len() - SHOWN));
    }
    s
}

/// The text `harness verify` prints.
pub fn render(dir: &Path, v: &Verdict) -> String {
    let mut out = String::new();
    for n in &v.notes {
        out.push_str(&format!("note: {n}\n"));
    }
    if v.verified() {
        out.push_str(&format!("{}: verified\n", dir.display()));
        return out;
    }
    for x in &v.violations {
        out.push_str(&format!("violation [{}]: {}\n  what to do: {}\n", x.rule, x.what, x.todo));
    }
    out.push_str(&format!("{}: NOT verified ({} violations)\n", dir.display(), v.violations.len()));
    out
}
