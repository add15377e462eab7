//! `harness plugin test`: the test kit for plugin authors. It runs one
//! artifact, outside training, the way a run would, and checks what a run
//! relies on:
//!
//! - a compressor on synthetic gradient buckets ([`BUCKET_SIZES`]
//!   elements, [`COMPRESSOR_STEPS`] steps) on simulated ranks: thread ranks
//!   over the in-process collective, one configured instance per rank, as
//!   a CPU run makes them. Checked: determinism (two fresh sets of
//!   instances, bit for bit), agreement across ranks (every rank holds the
//!   same reduced bucket, bit for bit), the round-trip error against the
//!   exact average (reported; non-finite values or a changed shape fail),
//!   the bytes on the wire (reported, against an fp32 all-reduce), the
//!   state round trip (saved after [`COMPRESSOR_SAVE_AFTER`] steps, loaded
//!   into fresh instances that go on, against the uninterrupted instances
//!   bit for bit) and the refusal of a bad configuration;
//! - a batch or checkpoint policy on synthetic telemetry (and, for a
//!   checkpoint policy, a history that follows its decisions) for
//!   [`POLICY_STEPS`] steps: determinism, the state round trip and the
//!   configuration.
//!
//! Each check is a [`Check`] of the [`Report`]; [`table`] prints them.
//!
//! The compressor's checks are in `compressor.rs`, the policies' in
//! `policy.rs`; the configuration checks and the table here.

mod compressor;
mod policy;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Result;
use serde::Serialize;
use tch::Device;

use super::{Kind, Manifest, PluginSet};
use harness_format::fmt::counted;
use harness_format::suite::PluginSpec;

/// The compressor's buckets, elements each: odd sizes, one element, and
/// one of 256 KiB.
pub const BUCKET_SIZES: [i64; 4] = [1, 7, 1000, 65536];
/// What the buckets hold (contract 0.2's `setup`): per bucket, its
/// parameters' names and shapes, back to back, [`BUCKET_SIZES`] elements in
/// all: a bias, a norm's gain, one weight matrix, and two weight matrices
/// with a bias.
pub const BUCKET_PARAMS: [&[(&str, &[i64])]; 4] = [
    &[("head.bias", &[1])],
    &[("norm.weight", &[7])],
    &[("proj.weight", &[25, 40])],
    &[("mlp.fc.weight", &[128, 384]), ("mlp.proj.weight", &[120, 128]), ("mlp.proj.bias", &[1024])],
];

/// The buckets' layouts, from [`BUCKET_PARAMS`].
pub fn bucket_layouts() -> Vec<crate::strategy::BucketLayout> {
    BUCKET_PARAMS.iter().map(|ps| crate::strategy::BucketLayout::packed(ps.iter().map(|&(n, s)| (n, s)), tch::Kind::Float)).collect()
}

/// Steps a compressor runs, each over every bucket.
pub const COMPRESSOR_STEPS: u64 = 4;
/// The state round trip saves after this many steps of a compressor.
pub const COMPRESSOR_SAVE_AFTER: u64 = 2;
/// Steps a batch or checkpoint policy runs.
pub const POLICY_STEPS: u64 = 200;
/// The state round trip saves after this many steps of a policy.
pub const POLICY_SAVE_AFTER: u64 = 120;
/// The most ranks `--ranks` takes.
pub const MAX_RANKS: usize = 16;
/// The key the configuration check adds, which no plugin should take.
pub const UNKNOWN_KEY: &str = "harness_test_unknown_key";
/// The bad values tried for each known key, one at a time: a string and a
/// negative float, so that a key refuses at least one by its type or range.
pub const BAD_VALUES: [&str; 2] = ["\"harness-test-bad-value\"", "-1.5"];
/// The detail of the checks that need a run when the first run failed.
const NOT_RUN: &str = "not run: the plugin failed (determinism says how)";
/// How long a rank waits for the others in a collective.
const COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(60);
/// The seed of the synthetic gradients.
const SEED: u64 = 0x6861_726e_6573_7321;

/// A check's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Pass,
    Fail,
    /// Does not apply here (the detail says why).
    Skip,
}

/// One line of the table.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub status: Status,
    /// What was seen: the figure, the first difference, the plugin's message.
    pub detail: String,
}

impl Check {
    fn pass(name: &'static str, detail: impl Into<String>) -> Check {
        Check { name, status: Status::Pass, detail: detail.into() }
    }
    fn fail(name: &'static str, detail: impl Into<String>) -> Check {
        Check { name, status: Status::Fail, detail: detail.into() }
    }
    fn skip(name: &'static str, detail: impl Into<String>) -> Check {
        Check { name, status: Status::Skip, detail: detail.into() }
    }
}

/// A compressor's figures for one bucket size, on rank 0.
#[derive(Debug, Clone, Serialize)]
pub struct BucketFigures {
    pub elements: i64,
    /// Per step: `|reduced - average| / |average|` (L2 norms), the average
    /// being the exact mean of the ranks' buckets (in f64).
    pub rel_l2_error: Vec<f64>,
    /// Per step: the bytes rank 0 sent for the bucket, by the collective's
    /// ring accounting (what a run records as bytes on the wire).
    pub bytes_sent: Vec<u64>,
    /// What an fp32 all-reduce of the bucket sends per rank, by the same
    /// accounting: `2 (ranks - 1) / ranks` times its `4 n` bytes.
    pub fp32_allreduce_bytes: u64,
    /// The mean of `bytes_sent` over `fp32_allreduce_bytes` (none with one
    /// rank, which sends nothing).
    pub wire_ratio: Option<f64>,
}

/// What `harness plugin test` found.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub artifact: PathBuf,
    /// None when the artifact could not be loaded.
    pub manifest: Option<Manifest>,
    pub ranks: usize,
    /// The configuration the instances were given, as TOML.
    pub config: String,
    pub steps: u64,
    /// A compressor's bucket sizes (none for a policy).
    pub bucket_sizes: Vec<i64>,
    pub checks: Vec<Check>,
    /// A compressor's figures per bucket size.
    pub buckets: Vec<BucketFigures>,
    /// Every check passed or was skipped.
    pub passed: bool,
}

/// Runs the checks of the artifact at `path`, configured with `config`, on
/// `ranks` simulated ranks (1 ..= [`MAX_RANKS`]).
pub fn run(path: &Path, config: &toml::Table, ranks: usize) -> Report {
    let ranks = ranks.clamp(1, MAX_RANKS);
    let mut report = Report {
        artifact: path.to_owned(),
        manifest: None,
        ranks,
        config: toml::to_string(config).unwrap_or_default(),
        steps: 0,
        bucket_sizes: Vec::new(),
        checks: Vec::new(),
        buckets: Vec::new(),
        passed: false,
    };
    let name = super::artifact_name(path);
    let loaded = std::fs::canonicalize(path).map_err(|e| format!("{}: {e}", path.display())).and_then(|abs| {
        let set = PluginSet::new(&[spec(&abs, &name)], Path::new("/"));
        let m = set.check_all().remove(0)?;
        Ok((set, m))
    });
    let (set, manifest) = match loaded {
        Ok(l) => l,
        Err(e) => {
            report.checks.push(Check::fail("load", super::first_line(&e)));
            return report;
        }
    };
    report.manifest = Some(manifest.clone());
    (report.steps, report.bucket_sizes) = match manifest.kind {
        Kind::Compressor => (COMPRESSOR_STEPS, BUCKET_SIZES.to_vec()),
        Kind::BatchPolicy | Kind::CheckpointPolicy => (POLICY_STEPS, Vec::new()),
    };
    let who = format!("{} plugin `{name}` ({}, {})", manifest.kind.name(), transport(&manifest), manifest.path.display());
    let kit = Kit { set, name, who, kind: manifest.kind, config: config.clone(), ranks };
    if let Err(e) = kit.configure(config) {
        report.checks.push(Check::fail("configure", format!("the given config is refused: {}", said(&e, "configure").text())));
        return report;
    }
    match manifest.kind {
        Kind::Compressor => (report.checks, report.buckets) = kit.compressor_checks(),
        Kind::BatchPolicy | Kind::CheckpointPolicy => report.checks = kit.policy_checks(),
    }
    report.checks.extend(kit.config_checks());
    report.passed = report.checks.iter().all(|c| c.status != Status::Fail);
    report
}

/// The limits of a suite's `[[plugin]]` table by default: the plugin runs
/// under the caps a run would give it.
fn spec(path: &Path, name: &str) -> PluginSpec {
    let mut s: PluginSpec = toml::from_str("name = \"\"\npath = \"\"").expect("a plugin table of two keys parses");
    s.name = name.to_owned();
    s.path = path.to_owned();
    s
}

/// What a plugin's failed call said.
enum Said {
    /// It returned an error: its own message.
    Refused(String),
    /// It trapped, panicked or ran past a limit (or the host failed).
    Failed(String),
}

impl Said {
    fn text(&self) -> &str {
        match self {
            Said::Refused(m) | Said::Failed(m) => m,
        }
    }
}

/// Splits the host's message about a failed call `call` into what the
/// plugin said (the words after "returned an error from `call`: ", which
/// [`super::Plugin::call`] writes before the plugin's message) or why it
/// failed.
fn said(e: &anyhow::Error, call: &str) -> Said {
    let msg = super::first_line(&format!("{e:#}"));
    if let Some((_, m)) = msg.split_once(&format!(" returned an error from `{call}`: ")) {
        return Said::Refused(m.to_owned());
    }
    match msg.split_once(&format!(" failed in `{call}`: ")) {
        Some((_, m)) => Said::Failed(m.to_owned()),
        None => Said::Failed(msg),
    }
}

/// Where the artifact's instances come from, and how they are set up.
struct Kit {
    set: PluginSet,
    name: String,
    /// How the host's messages name the plugin.
    who: String,
    kind: Kind,
    config: toml::Table,
    ranks: usize,
}

/// The slot name a run gives an instance of `kind`.
fn slot(kind: Kind) -> &'static str {
    match kind {
        Kind::Compressor => "compressor",
        Kind::BatchPolicy => "batch_policy",
        Kind::CheckpointPolicy => "checkpoint",
    }
}

impl Kit {
    /// A fresh instance configured with `config`.
    fn configure(&self, config: &toml::Table) -> Result<super::Plugin> {
        self.set.instance(&self.name, slot(self.kind), self.kind, Some(config), Device::Cpu)
    }

    /// `e`'s message, the plugin named "it" (the table names it once, on
    /// top), first line only.
    fn message(&self, e: &str) -> String {
        super::first_line(e).replace(&self.who, "it")
    }

    /// The configuration checks: an unknown key, then bad values of the
    /// keys known (the given ones, and those the plugin's refusal of the
    /// unknown key lists, as the SDK's `check_keys` does).
    fn config_checks(&self) -> Vec<Check> {
        const UNKNOWN: &str = "config: unknown key";
        const BAD: &str = "config: bad value";
        let mut with_unknown = self.config.clone();
        with_unknown.insert(UNKNOWN_KEY.into(), toml::Value::Integer(1));
        let mut keys: Vec<String> = self.config.keys().cloned().collect();
        let mut takes_none = false;
        let unknown = match self.configure(&with_unknown).map(drop) {
            Ok(()) => Check::fail(
                UNKNOWN,
                format!("it accepted `{UNKNOWN_KEY} = 1`: a misspelt key would pass unnoticed (refuse keys it does not know, e.g. with config.check_keys)"),
            ),
            Err(e) => match said(&e, "configure") {
                Said::Refused(m) => {
                    takes_none = m.contains("this plugin takes no settings");
                    if let Some(known) = m.split_once("(known: ").and_then(|(_, k)| k.split_once(')')).map(|(k, _)| k) {
                        for k in known.split(',').map(str::trim).filter(|k| !k.is_empty()) {
                            if !keys.iter().any(|have| have == k) {
                                keys.push(k.to_owned());
                            }
                        }
                    }
                    Check::pass(UNKNOWN, format!("refused: {m}"))
                }
                Said::Failed(m) => Check::fail(UNKNOWN, format!("it failed instead of returning an error: {m}")),
            },
        };
        let bad = if keys.is_empty() {
            Check::skip(
                BAD,
                match takes_none {
                    true => "the plugin takes no settings".to_owned(),
                    false => "no config keys known: give some with --plugin-config KEY=VALUE".to_owned(),
                },
            )
        } else {
            self.bad_values(&keys, BAD)
        };
        vec![unknown, bad]
    }

    /// Each of `keys` given each of [`BAD_VALUES`] in turn (the other keys
    /// as given): each key must refuse one of them at least, and never
    /// fail otherwise than by returning an error.
    fn bad_values(&self, keys: &[String], name: &'static str) -> Check {
        let mut example = None;
        for key in keys {
            let mut refused = None;
            for v in BAD_VALUES {
                let mut c = self.config.clone();
                c.insert(key.clone(), format!("v = {v}").parse::<toml::Table>().expect("a bad value parses")["v"].clone());
                match self.configure(&c).map(drop) {
                    Ok(()) => {}
                    Err(e) => match said(&e, "configure") {
                        Said::Refused(m) => {
                            refused.get_or_insert(format!("{key} = {v}: {m}"));
                        }
                        Said::Failed(m) => {
                            return Check::fail(name, format!("`{key} = {v}`: it failed instead of returning an error: {m}"))
                        }
                    },
                }
            }
            match refused {
                Some(r) => {
                    example.get_or_insert(r);
                }
                None => {
                    return Check::fail(
                        name,
                        format!("`{key}` took both {} and {}: a bad value would pass unnoticed", BAD_VALUES[0], BAD_VALUES[1]),
                    )
                }
            }
        }
        Check::pass(
            name,
            format!(
                "{} refused a bad value, e.g. {}",
                keys.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", "),
                example.unwrap_or_default()
            ),
        )
    }
}

/// The text `harness plugin test` prints: what ran, the table of checks,
/// a compressor's figures per bucket size, then a line per failed check.
pub fn table(r: &Report) -> String {
    let mut out = String::new();
    if let Some(m) = &r.manifest {
        out += &format!("{} {} ({}, {}) from {}\n", m.name, m.version, m.kind.name(), transport(m), r.artifact.display());
        let config = if r.config.trim().is_empty() { "none".to_owned() } else { r.config.trim().replace('\n', ", ") };
        let what = match m.kind {
            Kind::Compressor => format!(
                "{}, buckets of {} elements, {} steps",
                counted(r.ranks, "rank", "ranks"),
                BUCKET_SIZES.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "),
                r.steps
            ),
            _ => format!("{} steps of synthetic telemetry", r.steps),
        };
        out += &format!("{what}; config: {config}\n");
    } else {
        out += &format!("{}\n", r.artifact.display());
    }
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::UTF8_FULL_CONDENSED);
    t.set_content_arrangement(comfy_table::ContentArrangement::Dynamic);
    t.set_width(120);
    t.set_header(["check", "result", "detail"]);
    for c in &r.checks {
        let status = match c.status {
            Status::Pass => "pass",
            Status::Fail => "FAIL",
            Status::Skip => "skip",
        };
        t.add_row([c.name, status, c.detail.as_str()]);
    }
    out += &format!("{t}\n");
    if !r.buckets.is_empty() {
        let mut t = comfy_table::Table::new();
        t.load_preset(comfy_table::presets::UTF8_FULL_CONDENSED);
        t.set_header(["elements", "rel. L2 error per step", "bytes sent per step", "fp32 all-reduce", "ratio"]);
        for b in &r.buckets {
            let sent = match b.bytes_sent.iter().all(|&s| Some(&s) == b.bytes_sent.first()) {
                true => b.bytes_sent.first().map_or("-".into(), ToString::to_string),
                false => b.bytes_sent.iter().map(ToString::to_string).collect::<Vec<_>>().join(" "),
            };
            t.add_row([
                b.elements.to_string(),
                b.rel_l2_error.iter().map(|&e| num(e)).collect::<Vec<_>>().join(" "),
                sent,
                b.fp32_allreduce_bytes.to_string(),
                b.wire_ratio.map_or("-".into(), |x| format!("{x:.4}")),
            ]);
        }
        out += &format!("{t}\n");
    }
    for c in r.checks.iter().filter(|c| c.status == Status::Fail) {
        out += &format!("FAILED {}: {}\n", c.name, c.detail);
    }
    out
}

fn transport(m: &Manifest) -> &'static str {
    match m.transport {
        super::Transport::Wasm => "wasm",
        super::Transport::Native => "native",
    }
}

/// A figure for the table: 0, 4 decimals, or 3 significant digits.
fn num(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if !x.is_finite() || x.abs() >= 1e-3 {
        format!("{x:.4}")
    } else {
        format!("{x:.2e}")
    }
}

#[cfg(test)]
mod tests;
