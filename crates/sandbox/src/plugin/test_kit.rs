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

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use serde::Serialize;
use tch::{Device, Tensor};

use super::{Kind, Manifest, PluginBatch, PluginCheckpoint, PluginCompressor, PluginSet};
use crate::strategy::{BatchDecision, BatchPolicy, BucketCtx, CheckpointHistory, CheckpointPolicy, Compressor, StepTelemetry};
use harness_format::fmt::counted;
use harness_format::suite::PluginSpec;
use harness_runtime::comm::{Collective, InProcessComm, InProcessGroup, Op, ABORTED_BY_PEER};

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

    /// The compressor's checks and its figures per bucket size.
    fn compressor_checks(&self) -> (Vec<Check>, Vec<BucketFigures>) {
        let inputs = Inputs::new(self.ranks, COMPRESSOR_STEPS);
        let all = 0..COMPRESSOR_STEPS;
        let a = self.compress_session(&inputs, all.clone(), None, false);
        let b = self.compress_session(&inputs, all, None, false);
        let mut checks = vec![determinism(&a, &b)];
        let Ok(runs) = &a else {
            // Its error is determinism's detail; the other checks need a run.
            for name in ["ranks agree", "round-trip error", "bytes on the wire", "state save/load"] {
                checks.push(Check::fail(name, NOT_RUN));
            }
            return (checks, Vec::new());
        };
        checks.push(match self.ranks {
            1 => Check::skip("ranks agree", "one rank: nothing to compare (--ranks 2 or more)"),
            _ => agreement(runs),
        });
        let (round_trip, figures) = round_trip(runs, &inputs);
        checks.push(round_trip);
        checks.push(wire(&figures, self.ranks));
        checks.push(self.compressor_state(&inputs, &a));
        (checks, figures)
    }

    /// `e`'s message, the plugin named "it" (the table names it once, on
    /// top), first line only.
    fn message(&self, e: &str) -> String {
        super::first_line(e).replace(&self.who, "it")
    }

    /// Saves each rank's state after [`COMPRESSOR_SAVE_AFTER`] steps, loads
    /// it into fresh instances, goes on, and compares with `uninterrupted`.
    fn compressor_state(&self, inputs: &Inputs, uninterrupted: &Result<Vec<RankRun>, String>) -> Check {
        const NAME: &str = "state save/load";
        let k = COMPRESSOR_SAVE_AFTER;
        let saved = match self.compress_session(inputs, 0..k, None, true) {
            Ok(s) => s,
            Err(e) => return Check::fail(NAME, e),
        };
        let states: Vec<Vec<u8>> = saved.into_iter().map(|r| r.state).collect();
        let bytes = states.iter().map(Vec::len).max().unwrap_or(0);
        let resumed = self.compress_session(inputs, k..COMPRESSOR_STEPS, Some(&states), false);
        let what = match bytes {
            0 => "no state, 0 bytes".to_owned(),
            b => format!("{b} bytes a rank at most"),
        };
        match compare_runs(uninterrupted, &resumed, k, ["uninterrupted", "resumed"]) {
            Ok(()) => Check::pass(
                NAME,
                format!(
                    "saved after step {} ({what}), loaded into fresh instances: steps {k}..{} bit-identical to the uninterrupted run",
                    k - 1,
                    COMPRESSOR_STEPS - 1
                ),
            ),
            Err(e) => Check::fail(
                NAME,
                format!(
                    "saved after step {} ({what}) and loaded into fresh instances: {e}{}",
                    k - 1,
                    if bytes == 0 { " (what it keeps across calls must be in state-save)" } else { "" }
                ),
            ),
        }
    }

    /// One set of fresh instances, one per rank on a thread of its own,
    /// over `steps` of `inputs`; loads `load[rank]` first when given, and
    /// saves each rank's state at the end when `save`. The error is the
    /// first rank's that is not an echo of another's.
    fn compress_session(&self, inputs: &Inputs, steps: Range<u64>, load: Option<&[Vec<u8>]>, save: bool) -> Result<Vec<RankRun>, String> {
        let group = InProcessGroup::new(self.ranks, COLLECTIVE_TIMEOUT);
        let results: Vec<Result<RankRun, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..self.ranks)
                .map(|r| {
                    let mut comm = group.rank(r, None);
                    let steps = steps.clone();
                    s.spawn(move || {
                        let state = load.map(|l| l[r].as_slice());
                        // A panic of the host's own (a native plugin's is
                        // caught at its C boundary) fails this rank, and
                        // the abort below releases the others.
                        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            self.compress_rank(&mut comm, inputs, steps, state, save)
                        }))
                        .unwrap_or_else(|_| Err(anyhow!("harness panicked running it")));
                        if let Err(e) = &out {
                            comm.abort(&format!("{e:#}"));
                        }
                        out.map_err(|e| format!("rank {r}: {e:#}"))
                    })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(r, h)| h.join().unwrap_or_else(|_| Err(format!("rank {r}: harness panicked running it"))))
                .collect()
        });
        let errors: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
        if let Some(e) = errors.iter().find(|e| !e.contains(ABORTED_BY_PEER)).or(errors.first()) {
            return Err(self.message(e));
        }
        Ok(results.into_iter().flatten().collect())
    }

    /// One rank of [`Kit::compress_session`].
    fn compress_rank(
        &self,
        comm: &mut InProcessComm,
        inputs: &Inputs,
        steps: Range<u64>,
        load: Option<&[u8]>,
        save: bool,
    ) -> Result<RankRun> {
        let rank = comm.rank();
        let mut p = PluginCompressor::new(self.configure(&self.config)?, false);
        p.setup(&bucket_layouts())?;
        if let Some(state) = load {
            p.plugin.state_load(state)?;
        }
        let mut run = RankRun::default();
        for step in steps {
            let (mut outs, mut sent) = (Vec::new(), Vec::new());
            for index in 0..BUCKET_SIZES.len() {
                let at = || format!("step {step}, {}", describe_bucket(index));
                let mut bucket = Tensor::from_slice(&inputs.data[step as usize][index][rank]);
                let before = comm.stats().bytes_sent;
                p.reduce(&mut bucket, comm, &BucketCtx { step, index, count: BUCKET_SIZES.len() }).with_context(at)?;
                sent.push(comm.stats().bytes_sent - before);
                outs.push(Vec::<f32>::try_from(&bucket.reshape([-1])).with_context(at)?);
                // Every rank is done with this bucket's collectives: one that
                // made more or fewer than the others meets this barrier with
                // another collective, and both fail here, saying so.
                let mut done = Tensor::zeros([1], (tch::Kind::Float, Device::Cpu));
                comm.all_reduce_sum_control(&mut done)
                    .map_err(|e| anyhow!("{}: the ranks did not make the same collectives: {e}", at()))?;
            }
            run.out.push(outs);
            run.sent.push(sent);
        }
        if save {
            run.state = p.plugin.state_save()?;
        }
        Ok(run)
    }

    /// A policy's checks: determinism and the state round trip.
    fn policy_checks(&self) -> Vec<Check> {
        let all = 0..POLICY_STEPS;
        let a = self.policy_session(all.clone(), None, false).map_err(|e| self.message(&format!("{e:#}")));
        let b = self.policy_session(all, None, false).map_err(|e| self.message(&format!("{e:#}")));
        let determinism = match (&a, &b) {
            (Err(e), _) | (_, Err(e)) => Check::fail("determinism", e.clone()),
            (Ok(a), Ok(b)) if a.initial != b.initial => Check::fail(
                "determinism",
                format!(
                    "two fresh instances chose different initial batches: {} then {}",
                    a.initial.as_deref().unwrap_or("-"),
                    b.initial.as_deref().unwrap_or("-")
                ),
            ),
            (Ok(a), Ok(b)) => match first_decision_difference(&a.decisions, &b.decisions, ["first instance", "second instance"]) {
                None => Check::pass(
                    "determinism",
                    format!("two fresh instances decided alike at each of {POLICY_STEPS} steps ({})", a.summary()),
                ),
                Some(d) => Check::fail("determinism", format!("two fresh instances decided differently: {d}")),
            },
        };
        let k = POLICY_SAVE_AFTER;
        let state = (|| -> Result<Check, String> {
            let Ok(a) = a.as_ref() else {
                return Ok(Check::fail("state save/load", NOT_RUN));
            };
            let saved = self.policy_session(0..k, None, true).map_err(|e| self.message(&format!("{e:#}")))?;
            let host = saved.hosts.last().cloned().expect("steps before the save");
            let resumed =
                self.policy_session(k..POLICY_STEPS, Some((&saved.state, host)), false).map_err(|e| self.message(&format!("{e:#}")))?;
            let what = match saved.state.len() {
                0 => "no state, 0 bytes".to_owned(),
                b => format!("{b} bytes"),
            };
            Ok(match first_decision_difference(&a.decisions[k as usize..], &resumed.decisions, ["uninterrupted", "resumed"]) {
                None => Check::pass(
                    "state save/load",
                    format!(
                        "saved after step {k} ({what}), loaded into a fresh instance: steps {}..{POLICY_STEPS} decided as uninterrupted",
                        k + 1
                    ),
                ),
                Some(d) => Check::fail(
                    "state save/load",
                    format!(
                        "saved after step {k} ({what}) and loaded into a fresh instance, it decided otherwise: {d}{}",
                        if saved.state.is_empty() { " (what it keeps across calls must be in state-save)" } else { "" }
                    ),
                ),
            })
        })()
        .unwrap_or_else(|e| Check::fail("state save/load", e));
        vec![determinism, state]
    }

    /// A fresh policy instance over `steps` of synthetic telemetry,
    /// starting from a saved state and the host's side at that point when
    /// given, as a resumed run does (a batch policy is asked for its
    /// initial batch first, as at every start).
    fn policy_session(&self, steps: Range<u64>, resume: Option<(&[u8], Host)>, save: bool) -> Result<PolicyRun> {
        let plugin = self.configure(&self.config)?;
        let mut run = PolicyRun::default();
        let world = self.ranks as u32;
        match self.kind {
            Kind::BatchPolicy => {
                let mut p = PluginBatch { plugin };
                let stats = p.wants_gradient_stats()?;
                let mut last = p.initial(CONFIGURED_BATCH)?;
                run.initial = Some(format!("{last:?}"));
                if let Some((state, host)) = resume {
                    p.plugin.state_load(state)?;
                    if let Host::Batch(b) = host {
                        last = b;
                    }
                }
                for step in steps {
                    let t = batch_telemetry(step, last, world, stats);
                    last = p.next(&t).with_context(|| format!("step {}", t.step))?;
                    run.decisions.push((format!("step {}", t.step), format!("{last:?}")));
                    run.hosts.push(Host::Batch(last));
                }
                if save {
                    run.state = p.plugin.state_save()?;
                }
            }
            Kind::CheckpointPolicy => {
                let mut p = PluginCheckpoint { plugin };
                let (mut h, mut last_save) = (CheckpointHistory::default(), 0);
                if let Some((state, host)) = resume {
                    p.plugin.state_load(state)?;
                    if let Host::Checkpoint(history, at) = host {
                        (h, last_save) = (history, at);
                    }
                }
                for step in steps {
                    let s = step + 1;
                    let t = checkpoint_telemetry(s, world);
                    h.since_last_s = (s - last_save) as f64 * STEP_S;
                    if s == FAILURE_AT {
                        h.failures.push(s);
                    }
                    let d = p.decide(&t, &h).with_context(|| format!("step {s}"))?;
                    if d.save {
                        run.snapshots += 1;
                        run.persisted += usize::from(d.persist);
                        (h.in_memory, last_save) = (vec![s], s);
                        (h.last_cost_s, h.last_stall_s) = (Some(0.05), Some(0.02));
                        if d.persist {
                            h.saved.push(s);
                            (h.last_persist_s, h.last_slowdown_s) = (Some(0.04), Some(0.01));
                        }
                    }
                    h.saved.retain(|x| !d.delete.contains(x));
                    run.decisions.push((format!("step {s}"), format!("{d:?}")));
                    run.hosts.push(Host::Checkpoint(h.clone(), last_save));
                }
                if save {
                    run.state = p.plugin.state_save()?;
                }
            }
            Kind::Compressor => unreachable!("compressors run in compress_session"),
        }
        Ok(run)
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

/// What one rank of a compressor session gave.
#[derive(Debug, Default, Clone)]
struct RankRun {
    /// The reduced buckets, per step run and bucket.
    out: Vec<Vec<Vec<f32>>>,
    /// Bytes sent per step run and bucket.
    sent: Vec<Vec<u64>>,
    /// The state saved at the end (when asked).
    state: Vec<u8>,
}

/// The synthetic gradients: per step, bucket and rank, a part common to
/// the ranks plus half as much of the rank's own, each element normal.
struct Inputs {
    ranks: usize,
    /// `[step][bucket][rank]`.
    data: Vec<Vec<Vec<Vec<f32>>>>,
}

impl Inputs {
    fn new(ranks: usize, steps: u64) -> Inputs {
        let data = (0..steps)
            .map(|step| {
                BUCKET_SIZES
                    .iter()
                    .enumerate()
                    .map(|(b, &n)| {
                        let common = normals(mix(&[SEED, step, b as u64, u64::MAX]), n as usize);
                        (0..ranks)
                            .map(|r| {
                                let own = normals(mix(&[SEED, step, b as u64, r as u64]), n as usize);
                                common.iter().zip(&own).map(|(c, o)| (c + 0.5 * o) as f32).collect()
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect();
        Inputs { ranks, data }
    }

    /// The exact average of the ranks' bucket `b` at `step`.
    fn average(&self, step: usize, b: usize) -> Vec<f64> {
        let n = BUCKET_SIZES[b] as usize;
        let mut avg = vec![0f64; n];
        for r in &self.data[step][b] {
            for (a, x) in avg.iter_mut().zip(r) {
                *a += f64::from(*x);
            }
        }
        avg.iter_mut().for_each(|a| *a /= self.ranks as f64);
        avg
    }
}

/// splitmix64 of the words in turn.
fn mix(words: &[u64]) -> u64 {
    words.iter().fold(0x9e37_79b9_7f4a_7c15u64, |h, &w| splitmix(&mut (h ^ w)))
}

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `n` standard normal numbers from `seed` (Box-Muller).
fn normals(seed: u64, n: usize) -> Vec<f64> {
    let mut s = seed;
    let mut unit = || ((splitmix(&mut s) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    (0..n).map(|_| (-2.0 * unit().ln()).sqrt() * (std::f64::consts::TAU * unit()).cos()).collect()
}

/// An element as the messages show it: its value and its bits.
fn value(x: f32) -> String {
    format!("{x:?} (0x{:08x})", x.to_bits())
}

/// The first element where `a` and `b` differ bit for bit (or the length,
/// when one is shorter).
fn first_difference(a: &[f32], b: &[f32]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x.to_bits() != y.to_bits()).or((a.len() != b.len()).then(|| a.len().min(b.len())))
}

fn describe_bucket(b: usize) -> String {
    format!("bucket {b} ({})", counted(BUCKET_SIZES[b] as usize, "element", "elements"))
}

/// Two sessions' reduced buckets compared rank by rank, bit for bit;
/// `second` starts at step `from` of `first`. The error is the first
/// difference (`labels` name the two sessions) or a session's error.
fn compare_runs(
    first: &Result<Vec<RankRun>, String>,
    second: &Result<Vec<RankRun>, String>,
    from: u64,
    labels: [&str; 2],
) -> Result<(), String> {
    let (a, b) = match (first, second) {
        (Err(e), _) | (_, Err(e)) => return Err(e.clone()),
        (Ok(a), Ok(b)) => (a, b),
    };
    for (r, (ra, rb)) in a.iter().zip(b).enumerate() {
        for (i, outs) in rb.out.iter().enumerate() {
            let step = from as usize + i;
            for (bi, (x, y)) in ra.out[step].iter().zip(outs).enumerate() {
                if let Some(e) = first_difference(x, y) {
                    let show = |v: &[f32]| v.get(e).map_or("nothing".into(), |&v| value(v));
                    let [l0, l1] = labels;
                    return Err(format!("rank {r}, step {step}, {}, element {e}: {l0} {}, {l1} {}", describe_bucket(bi), show(x), show(y)));
                }
            }
        }
    }
    Ok(())
}

/// Two fresh sets of instances on the same buckets, bit for bit.
fn determinism(first: &Result<Vec<RankRun>, String>, second: &Result<Vec<RankRun>, String>) -> Check {
    const NAME: &str = "determinism";
    match compare_runs(first, second, 0, ["first run", "second run"]) {
        Ok(()) => {
            Check::pass(NAME, format!("two fresh sets of instances: bit-identical buckets on every rank over {COMPRESSOR_STEPS} steps"))
        }
        Err(e) => Check::fail(NAME, e),
    }
}

/// Every rank's reduced buckets against rank 0's, bit for bit.
fn agreement(runs: &[RankRun]) -> Check {
    const NAME: &str = "ranks agree";
    for (step, outs) in runs[0].out.iter().enumerate() {
        for (b, x) in outs.iter().enumerate() {
            for (r, other) in runs.iter().enumerate().skip(1) {
                let y = &other.out[step][b];
                if let Some(e) = first_difference(x, y) {
                    let count = x.iter().zip(y).filter(|(p, q)| p.to_bits() != q.to_bits()).count();
                    return Check::fail(
                        NAME,
                        format!(
                            "step {step}, {}: rank 0 and rank {r} hold different buckets ({} differ); element {e}: rank 0 {}, rank {r} {}",
                            describe_bucket(b),
                            counted(count, "element", "elements"),
                            value(x[e]),
                            value(y[e])
                        ),
                    );
                }
            }
        }
    }
    Check::pass(NAME, format!("all {} ranks hold bit-identical buckets after every reduce", runs.len()))
}

/// The relative L2 error of rank 0's reduced buckets against the exact
/// averages; fails on a non-finite element (on any rank). A changed shape
/// or dtype fails the call, hence the run.
fn round_trip(runs: &[RankRun], inputs: &Inputs) -> (Check, Vec<BucketFigures>) {
    const NAME: &str = "round-trip error";
    let world = inputs.ranks;
    let mut figures: Vec<BucketFigures> = BUCKET_SIZES
        .iter()
        .map(|&n| {
            let fp32 = Op::AllReduce.bytes_sent(4 * n as u64, world);
            BucketFigures { elements: n, rel_l2_error: Vec::new(), bytes_sent: Vec::new(), fp32_allreduce_bytes: fp32, wire_ratio: None }
        })
        .collect();
    let mut bad = None;
    for (step, outs) in runs[0].out.iter().enumerate() {
        for (b, out) in outs.iter().enumerate() {
            let avg = inputs.average(step, b);
            let (mut diff, mut norm) = (0f64, 0f64);
            for (o, a) in out.iter().zip(&avg) {
                diff += (f64::from(*o) - a).powi(2);
                norm += a * a;
            }
            let err = if norm > 0.0 { (diff / norm).sqrt() } else { diff.sqrt() };
            figures[b].rel_l2_error.push(err);
            figures[b].bytes_sent.push(runs[0].sent[step][b]);
            for (r, run) in runs.iter().enumerate() {
                if let (None, Some(e)) = (&bad, run.out[step][b].iter().position(|x| !x.is_finite())) {
                    bad = Some(format!("rank {r}, step {step}, {}: element {e} is {}", describe_bucket(b), run.out[step][b][e]));
                }
            }
        }
    }
    for f in &mut figures {
        let mean = f.bytes_sent.iter().sum::<u64>() as f64 / f.bytes_sent.len().max(1) as f64;
        f.wire_ratio = (f.fp32_allreduce_bytes > 0).then(|| mean / f.fp32_allreduce_bytes as f64);
    }
    if let Some(b) = bad {
        return (Check::fail(NAME, format!("non-finite values in the reduced bucket: {b}")), figures);
    }
    let errs = figures.iter().flat_map(|f| f.rel_l2_error.iter().copied());
    let (lo, hi) = errs.fold((f64::INFINITY, 0f64), |(lo, hi), e| (lo.min(e), hi.max(e)));
    (Check::pass(NAME, format!("relative L2 error against the exact average: {} to {} (per bucket below)", num(lo), num(hi))), figures)
}

/// The bytes rank 0 sent against an fp32 all-reduce of the same buckets.
fn wire(figures: &[BucketFigures], world: usize) -> Check {
    const NAME: &str = "bytes on the wire";
    if world == 1 {
        return Check::skip(NAME, "one rank sends nothing (--ranks 2 or more)");
    }
    let sent: u64 = figures.iter().flat_map(|f| &f.bytes_sent).sum();
    let fp32: u64 = figures.iter().map(|f| f.fp32_allreduce_bytes * f.bytes_sent.len() as u64).sum();
    Check::pass(
        NAME,
        format!("rank 0 sent {sent} bytes, {:.4}x an fp32 all-reduce's {fp32} (per bucket below)", sent as f64 / fp32.max(1) as f64),
    )
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

/// The batch a policy is told the workload configures.
const CONFIGURED_BATCH: BatchDecision = BatchDecision { micro_batch: 8, accum_steps: 1, lr_scale: 1.0 };
/// Seconds of a synthetic step (per sample of the micro-batch, for a batch policy).
const STEP_S: f64 = 0.1;
/// The step at which the checkpoint policy's history records a failure.
const FAILURE_AT: u64 = 60;
const GIB: u64 = 1 << 30;

/// The host's side of a policy session after a step: what a resumed run
/// restores next to the plugin's state.
#[derive(Debug, Clone)]
enum Host {
    /// The batch in force.
    Batch(BatchDecision),
    /// The history and the step of the last snapshot.
    Checkpoint(CheckpointHistory, u64),
}

/// What a policy session decided.
#[derive(Debug, Default)]
struct PolicyRun {
    /// A batch policy's initial batch.
    initial: Option<String>,
    /// (when, the decision) at each step, in order.
    decisions: Vec<(String, String)>,
    /// The host's side after each step.
    hosts: Vec<Host>,
    /// A checkpoint policy's snapshots, and those also persisted.
    snapshots: usize,
    persisted: usize,
    state: Vec<u8>,
}

impl PolicyRun {
    /// What the decisions amount to: how often the batch changed, or how
    /// many snapshots were taken.
    fn summary(&self) -> String {
        let changes = self.decisions.windows(2).filter(|w| w[0].1 != w[1].1).count();
        match self.initial {
            Some(_) => format!("the batch changed {}", counted(changes, "time", "times")),
            None => format!("{} snapshots, {} of them persisted", self.snapshots, self.persisted),
        }
    }
}

/// The first decision where `a` and `b` differ.
fn first_decision_difference(a: &[(String, String)], b: &[(String, String)], labels: [&str; 2]) -> Option<String> {
    if let Some(((when, x), (_, y))) = a.iter().zip(b).find(|(x, y)| x != y) {
        let [l0, l1] = labels;
        return Some(format!("at {when}: {l0} {x}, {l1} {y}"));
    }
    (a.len() != b.len()).then(|| format!("{} {} decisions, {} {}", labels[0], a.len(), labels[1], b.len()))
}

/// The telemetry of step `step` (0-based) under the batch `b`: a loss
/// falling towards 1, a step time and memory growing with the batch, and
/// (when asked for) gradient norms that wander.
fn batch_telemetry(step: u64, b: BatchDecision, world: u32, stats: bool) -> StepTelemetry {
    let s = step + 1;
    let samples = f64::from(b.micro_batch) * f64::from(b.accum_steps);
    let step_time_s = 0.01 + STEP_S * samples / 8.0;
    let x = s as f64;
    StepTelemetry {
        step: s,
        loss: 1.0 + 3.0 * (-x / 50.0).exp(),
        step_time_s,
        elapsed_s: x * STEP_S,
        memory_used_bytes: (2 * GIB + u64::from(b.micro_batch) * (GIB / 4)).min(16 * GIB),
        memory_total_bytes: 16 * GIB,
        tokens_per_s: samples * 1024.0 / step_time_s,
        micro_batch: b.micro_batch,
        accum_steps: b.accum_steps,
        world_size: world,
        grad_sq_norm: stats.then(|| 1.0 + 0.25 * (x * 0.7).sin()),
        local_grad_sq_norm: stats.then(|| 3.0 + 0.5 * (x * 0.3).cos()),
        out_of_memory: false,
    }
}

/// The telemetry after `s` steps of a fixed batch.
fn checkpoint_telemetry(s: u64, world: u32) -> StepTelemetry {
    let x = s as f64;
    StepTelemetry {
        step: s,
        loss: 1.0 + 3.0 * (-x / 50.0).exp(),
        step_time_s: STEP_S,
        elapsed_s: x * STEP_S,
        memory_used_bytes: 4 * GIB,
        memory_total_bytes: 16 * GIB,
        tokens_per_s: 8.0 * 1024.0 / STEP_S,
        micro_batch: 8,
        accum_steps: 1,
        world_size: world,
        ..Default::default()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn said_tells_a_refusal_from_a_failure() {
        let refused =
            anyhow!("compressor plugin `t.wasm` (wasm, /t.wasm) returned an error from `configure`: unknown config key `x` (known: a)");
        assert!(matches!(said(&refused, "configure"), Said::Refused(m) if m == "unknown config key `x` (known: a)"));
        let trapped = anyhow!("compressor plugin `t.wasm` (wasm, /t.wasm) failed in `configure`: wasm trap: unreachable\nstderr: ...");
        assert!(matches!(said(&trapped, "configure"), Said::Failed(m) if m == "wasm trap: unreachable"));
    }

    #[test]
    fn inputs_are_the_same_every_time_and_differ_between_ranks() {
        let (a, b) = (Inputs::new(2, 2), Inputs::new(2, 2));
        assert_eq!(a.data, b.data);
        assert_ne!(a.data[1][2][0], a.data[1][2][1]);
        assert_ne!(a.data[0][3][0], a.data[1][3][0]);
        let x = &a.data[0][3][0];
        let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / x.len() as f64;
        let var = x.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / x.len() as f64;
        assert!(mean.abs() < 0.02 && (var - 1.25).abs() < 0.05, "mean {mean}, variance {var}");
    }

    #[test]
    fn the_layouts_fill_the_buckets() {
        let layouts = bucket_layouts();
        for (l, &n) in layouts.iter().zip(&BUCKET_SIZES) {
            assert_eq!(l.numel, n as u64);
            assert_eq!(l.params.iter().map(|p| p.numel).sum::<u64>(), n as u64);
        }
        let last = &layouts[3].params;
        assert_eq!((last[1].offset, last[1].shape.as_slice(), last[1].weight), (49152, &[120u64, 128][..], true));
        assert!(!last[2].weight && layouts[2].params[0].weight);
    }

    #[test]
    fn first_difference_compares_bits() {
        assert_eq!(first_difference(&[0.0, 1.0], &[0.0, 1.0]), None);
        assert_eq!(first_difference(&[0.0, 1.0], &[-0.0, 1.0]), Some(0));
        assert_eq!(first_difference(&[f32::NAN], &[f32::NAN]), None);
        assert_eq!(first_difference(&[1.0], &[1.0, 2.0]), Some(1));
    }
}
