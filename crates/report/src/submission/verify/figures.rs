//! Rule 9: every figure the summary table and the leaderboard use is
//! worked out again from the raw records an entry carries and compared
//! with the figure it states:
//!
//! - latency summaries (step, phases, host phases, collectives, plugin
//!   calls) from their HDR histograms, which they are computed from;
//! - the data's loss floor and best accuracy from the suite's data table
//!   (the same arithmetic that recorded them, `suite::floor`), to the
//!   last digits, and the target loss from that floor;
//! - tokens and samples from the batches in force (the suite's batch, or
//!   the batch policy's recorded changes) x `seq_len` x ranks x steps;
//!   throughput from them and the step histogram's time, train time from
//!   both; FLOPs per token from the suite's model, MFU from them;
//! - the eval and accuracy curves: monotone in steps and time, each
//!   evaluation at the point the suite's `eval_every_tokens` puts it and
//!   between the training of the steps around it (the loss curve), the
//!   final figures their last points, and the time and steps to target
//!   their first point at the suite's target;
//! - bytes on the wire from the per-collective records.
//!
//! Where a figure is a function of recorded values (a summary of its
//! histogram, a curve's last point), it must match within the rounding of
//! its JSON text; where it is a measurement bounded by others (the step
//! histogram's time within the training time), within the slack the
//! measurement has: a step's time (its longest) and the histogram's
//! precision (3 significant digits). These checks prove the records
//! consistent, not measured: a forger who rewrites every record in step
//! passes, and only reproducing the run catches that.

use std::collections::BTreeMap;

use super::verdict::close;
use super::{Suite, Verdict};
#[cfg(test)]
use crate::metric::Metric;
use harness_format::histogram::LatencySummary;
use harness_format::link::Op;
use harness_format::results::{EntryResult, EntryStatus, Metrics, RunResult};
use harness_format::suite::{DataSpec, ModelConfig, PlanEntry, Workload};

/// The records rule 9 works each metric of the boards out again from. An
/// exhaustive match: with a new [`Metric`] the tests (which `./x test`
/// builds) do not compile until it says here where its figure comes from,
/// and the test
/// `every_metric_forged_alone_is_refused_by_rule_9` forges each one alone,
/// so that a metric whose check was forgotten fails it (one that no record
/// bounds would have to say so here, and the test with it).
#[cfg(test)]
pub(super) fn worked_out_from(m: Metric) -> &'static str {
    match m {
        Metric::TimeToTarget => "the first evaluation at the target on the eval curve",
        Metric::TokensPerS => "the batches in force x seq_len x ranks over the step histogram's time",
        Metric::StepP50 | Metric::StepP99 | Metric::StepP999 => "the step histogram",
        Metric::Mfu => "the suite's model's FLOPs per token and the throughput",
        Metric::BytesPerStep => "the per-collective records",
        Metric::Goodput => "the steps and the train time",
        Metric::EvalAccuracy => "the accuracy curve's last point",
        Metric::PeakMemory => "rank 0's memory record, which the entry's peak is taken from",
    }
}

const TODO: &str = "submit the result of the run as it was written: verify works these figures out again from the records they come from";

/// Figures that are functions of recorded ones: equal but for the
/// rounding of their JSON text.
const EXACT: f64 = 1e-9;
/// The data's floor, worked out again on another machine: its logarithms
/// (libm's) may round the last bit otherwise, and the synthetic data's
/// floor sums hundreds of thousands of them (results/ holds GPT-2's
/// 50304-token floor as 1.0850250618108261 and as 1.085025061810826 from
/// two hosts). Twelve significant digits: room for the last bits, none
/// for a floor moved by any amount that shifts a target.
const FLOOR: f64 = 1e-12;
/// The HDR histograms' precision (3 significant digits), for sums of
/// their values.
const HDR: f64 = 2e-3;

/// What one entry's figures break, each naming the figure, the recorded
/// value and the one worked out.
struct Findings<'a> {
    id: &'a str,
    out: Vec<String>,
}

impl Findings<'_> {
    fn say(&mut self, what: impl std::fmt::Display) {
        self.out.push(format!("{}: {what}", self.id));
    }

    fn differs(&mut self, figure: &str, recorded: impl std::fmt::Display, source: &str, derived: impl std::fmt::Display) {
        self.say(format!("{figure} is {recorded}; worked out from {source} it is {derived}"));
    }
}

/// Checks every finished entry's figures against its records, and the
/// figures a workload's entries share.
pub(super) fn check(suite: &Suite, r: &RunResult, v: &mut Verdict) {
    let mut out = Vec::new();
    // A workload's floor, worked out once (the synthetic data's is a
    // Markov chain's entropy rate).
    let mut floors: BTreeMap<&str, Option<f64>> = BTreeMap::new();
    for e in &r.entries {
        let (EntryStatus::Ok, Some(m)) = (&e.status, &e.metrics) else { continue };
        let Some(w) = suite.spec.workloads.iter().find(|w| w.name == e.workload) else { continue };
        let floor = *floors.entry(&w.name).or_insert_with(|| w.data.loss_floor());
        let plan = r.plan.iter().find(|p| p.id == e.id);
        let mut f = Findings { id: &e.id, out: Vec::new() };
        summaries(e, m, &mut f);
        let batches = batches(suite, w, m, plan, &mut f);
        let step = decode(e, "step");
        if let Some(h) = &step {
            throughput(w, m, batches.as_deref(), h, &mut f);
            host_time(e, m, h, &mut f);
        }
        model(suite, w, m, &mut f);
        data(w, m, floor, &mut f);
        curves(m, &mut f);
        if let Some(h) = &step {
            loss_span(m, h, &mut f);
        }
        targets(w, m, floor, &mut f);
        if let Some(b) = &batches {
            eval_points(w, m, b, &mut f);
        }
        wire(m, &mut f);
        ranks(m, &mut f);
        out.extend(f.out);
    }
    shared(r, &mut out);
    for what in out {
        v.add("figures", what, TODO);
    }
}

/// Whether steps were redone (failures, out-of-memory retries) or the
/// entry was resumed: then tokens count executed steps, and the timings
/// hold restores and retries, and only bounds are checked.
fn redone(m: &Metrics) -> bool {
    m.resilience.as_ref().is_some_and(|x| !x.failures.is_empty() || !x.out_of_memory.is_empty() || x.resumed_from.is_some())
}

fn decode(e: &EntryResult, key: &str) -> Option<hdrhistogram::Histogram<u64>> {
    e.histograms.get(key).and_then(|h| harness_format::histogram::decode(h).ok())
}

/// Seconds of all the values of a nanosecond histogram.
fn total_s(h: &hdrhistogram::Histogram<u64>) -> f64 {
    h.mean() * h.len() as f64 / 1e9
}

/// Every latency summary against the histogram it was computed from.
fn summaries(e: &EntryResult, m: &Metrics, f: &mut Findings) {
    let mut pairs: Vec<(String, &LatencySummary, String)> = Vec::new();
    if let Some(s) = &m.step {
        pairs.push(("the step latency summary".into(), s, "step".into()));
    }
    for (p, s) in &m.phases {
        pairs.push((format!("the `{p}` phase summary"), s, p.clone()));
    }
    for (p, s) in &m.host_phases {
        pairs.push((format!("the `{p}` host-time summary"), s, format!("host.{p}")));
    }
    if let Some(s) = &m.collective {
        pairs.push(("the collective latency summary".into(), s, "collective".into()));
    }
    if let Some(s) = &m.collective_emulated {
        pairs.push(("the emulated collective latency summary".into(), s, "collective.emulated".into()));
    }
    for rec in &m.plugins {
        if let Some(s) = &rec.call {
            pairs.push((format!("the {} plugin's call summary", rec.slot), s, format!("plugin.{}", rec.slot)));
        }
    }
    for (what, s, key) in pairs {
        let Some(h) = decode(e, &key) else {
            // The step histogram's absence is rule 8's.
            if key != "step" {
                f.say(format!("{what} has no `{key}` histogram that decodes, to be worked out from"));
            }
            continue;
        };
        let d = LatencySummary::of(&h);
        let fields = [
            ("mean_ms", s.mean_ms, d.mean_ms),
            ("p50_ms", s.p50_ms, d.p50_ms),
            ("p90_ms", s.p90_ms, d.p90_ms),
            ("p99_ms", s.p99_ms, d.p99_ms),
            ("p999_ms", s.p999_ms, d.p999_ms),
            ("max_ms", s.max_ms, d.max_ms),
        ];
        let mut differ: Vec<String> = fields
            .iter()
            .filter(|x| !close(x.1, x.2, EXACT))
            .map(|(name, got, want)| format!("{name} {got} (histogram: {want})"))
            .collect();
        if s.count != d.count {
            differ.insert(0, format!("count {} (histogram: {})", s.count, d.count));
        }
        if !differ.is_empty() {
            f.say(format!("{what} is not the `{key}` histogram's it is computed from: {}", differ.join(", ")));
        }
    }
}

/// The batch in force at each step change (step, micro-batch,
/// accumulation), checked: from step 0, in order, and the suite's batch
/// for the built-in fixed policy. None when they cannot be used.
fn batches(suite: &Suite, w: &Workload, m: &Metrics, plan: Option<&PlanEntry>, f: &mut Findings) -> Option<Vec<(u64, u32, u32)>> {
    let b = &m.batch_changes;
    let ordered = b.first().is_some_and(|x| x.0 == 0) && b.windows(2).all(|p| p[0].0 <= p[1].0) && b.iter().all(|x| x.1 >= 1 && x.2 >= 1);
    if !ordered {
        f.say(format!("its batch changes {b:?} do not start at step 0 in order with batches of at least 1"));
        return None;
    }
    let fixed =
        plan.is_some_and(|p| p.strategy.batch_policy == "fixed" && !suite.spec.plugins.iter().any(|pl| pl.name == p.strategy.batch_policy));
    let ooms = m.resilience.as_ref().is_some_and(|x| !x.out_of_memory.is_empty());
    if fixed && !ooms && b.as_slice() != [(0, w.batch, w.grad_accum)] {
        f.differs(
            "its batch (step, micro-batch, accumulation)",
            format!("{b:?}"),
            "the suite's workload under the built-in `fixed` policy",
            format!("[(0, {}, {})]", w.batch, w.grad_accum),
        );
    }
    Some(b.clone())
}

/// Samples (all ranks) of the step `s` under `batches`.
fn samples_at(batches: &[(u64, u32, u32)], s: u64, world: u32) -> u64 {
    let (_, micro, accum) = batches.iter().rev().find(|b| b.0 <= s).copied().unwrap_or((0, 0, 0));
    u64::from(micro) * u64::from(accum) * u64::from(world)
}

/// Tokens, samples and throughput against the batches, the steps and the
/// step histogram; train time and goodput against them.
fn throughput(w: &Workload, m: &Metrics, batches: Option<&[(u64, u32, u32)]>, step: &hdrhistogram::Histogram<u64>, f: &mut Findings) {
    let seq = u64::from(w.seq_len);
    let world = m.world_size.max(1);
    let t = m.train_time_s;
    if !(t.is_finite() && t > 0.0 && m.tokens_per_s.is_finite() && m.tokens_per_s >= 0.0) {
        f.say(format!("its train time ({t} s) and tokens/s ({}) are not positive finite figures", m.tokens_per_s));
        return;
    }
    // Tokens and samples up to a step (sums over steps, as trained).
    let upto = |b: &[(u64, u32, u32)], n: u64| (0..n).map(|s| samples_at(b, s, world)).sum::<u64>();
    let constant = batches.filter(|b| b.len() == 1);
    let executed = m.resilience.as_ref().map_or(m.steps, |x| x.steps_executed);
    let samples = match (redone(m), batches, constant) {
        (false, Some(b), _) => Some((upto(b, m.steps), format!("{} steps of the batches in force", m.steps))),
        (true, _, Some(b)) if m.resilience.as_ref().is_some_and(|x| x.out_of_memory.is_empty() && x.resumed_from.is_none()) => {
            Some((upto(b, executed), format!("{executed} executed steps of the batch in force")))
        }
        _ => None,
    };
    if let Some((samples, how)) = &samples {
        let source = format!("{how}, x {world} ranks (x seq_len {seq} for tokens)");
        if m.samples != *samples {
            f.differs("samples", m.samples, &source, samples);
        }
        if m.tokens != samples * seq {
            f.differs("tokens", m.tokens, &source, samples * seq);
        }
    }
    // The window throughput is measured over: after warm-up, to the end.
    let warm = m.warmup_steps.min(m.steps);
    let (tok0, s0) = match batches {
        Some(b) if m.steps > warm => (upto(b, warm) * seq, upto(b, warm)),
        Some(_) => (0, 0),
        None => return,
    };
    let tokens = m.tokens.saturating_sub(tok0);
    if tokens == 0 || m.tokens_per_s <= 0.0 {
        return;
    }
    let window = tokens as f64 / m.tokens_per_s;
    let (sum, longest) = (total_s(step), step.max() as f64 / 1e9);
    let tps = m.tokens_per_s;
    if window > t * (1.0 + EXACT) {
        f.say(format!(
            "tokens/s is {tps:.1}: {tokens} tokens after warm-up in {window:.4} s, longer than its whole train time of {t:.4} s"
        ));
    }
    if sum > window + longest + HDR * sum {
        f.say(format!(
            "its step histogram holds {sum:.4} s of timed steps, but tokens/s ({tps:.1}) puts only {window:.4} s of training after warm-up ({tokens} tokens)"
        ));
    }
    if !redone(m) && window > sum + longest + HDR * sum {
        f.say(format!(
            "tokens/s ({tps:.1}) puts {window:.4} s of training after warm-up ({tokens} tokens); its step histogram holds only {sum:.4} s"
        ));
    }
    let samples_after = m.samples.saturating_sub(s0) as f64;
    if !close(m.samples_per_s * tokens as f64, tps * samples_after, 1e-6) {
        f.differs(
            "samples/s",
            m.samples_per_s,
            &format!("tokens/s and the {samples_after} samples after warm-up"),
            tps * samples_after / tokens as f64,
        );
    }
    match (&m.resilience, m.goodput_steps_per_s) {
        (Some(_), Some(g)) if !close(g, m.steps as f64 / t.max(1e-9), EXACT) => {
            f.differs("goodput (steps/s)", g, "its steps and train time", m.steps as f64 / t.max(1e-9))
        }
        (Some(_), None) => f.say("it records failures, checkpoints or retries but no goodput"),
        (None, Some(g)) => f.say(format!("goodput is {g} without a resilience record to come from")),
        _ => {}
    }
}

/// The host-timed phases happen inside the steps: their time is at most
/// the step histogram's (a failed or retried attempt's phases aside).
fn host_time(e: &EntryResult, m: &Metrics, step: &hdrhistogram::Histogram<u64>, f: &mut Findings) {
    let cuda = e.histograms.keys().any(|k| k.starts_with("host."));
    let host: f64 = e
        .histograms
        .keys()
        .filter(|k| if cuda { k.starts_with("host.") || *k == "data" || *k == "strategy" } else { m.phases.contains_key(*k) })
        .filter_map(|k| decode(e, k))
        .map(|h| total_s(&h))
        .sum();
    let (sum, longest) = (total_s(step), step.max() as f64 / 1e9);
    let retried = m.resilience.as_ref().map_or(0, |x| x.failures.len() + x.out_of_memory.len()) as f64;
    if host > sum * (1.0 + 5.0 * HDR) + retried * longest {
        f.say(format!("its host-timed phases add up to {host:.4} s, more than the {sum:.4} s of the timed steps they happen in"));
    }
}

/// The model as the suite defines it, its FLOPs per token, and the MFU
/// from them.
fn model(suite: &Suite, w: &Workload, m: &Metrics, f: &mut Findings) {
    let Ok(mut cfg) = ModelConfig::resolve(&w.model, w.data.vocab().unwrap_or(2), w.seq_len) else { return };
    if let DataSpec::Images { channels, image_size, .. } = &w.data {
        cfg.image = Some([i64::from(*channels), i64::from(*image_size)]);
    }
    if let (Ok(serde_json::Value::Object(want)), Some(got)) = (serde_json::to_value(&cfg), m.model.as_object()) {
        for (k, x) in &want {
            if got.get(k) != Some(x) {
                f.differs(&format!("its model's `{k}`"), got.get(k).map_or("absent".into(), |g| g.to_string()), "the suite's workload", x);
            }
        }
    }
    let flops = cfg.flops_per_token(m.parameters);
    if !close(m.flops_per_token, flops, EXACT) {
        f.differs("FLOPs per token", m.flops_per_token, &format!("the model and its {} parameters", m.parameters), flops);
    }
    let achieved = m.flops_per_token * m.tokens_per_s / 1e12;
    if !close(m.achieved_tflops, achieved, EXACT) {
        f.differs("achieved TFLOP/s", m.achieved_tflops, "FLOPs per token x tokens/s", achieved);
    }
    if let Some(p) = suite.spec.suite.peak_tflops.filter(|p| m.peak_tflops != Some(*p)) {
        f.differs("the peak TFLOP/s", format!("{:?}", m.peak_tflops), "the suite", p);
    }
    // The peak is one GPU's; throughput is all the ranks'.
    let world = f64::from(m.world_size.max(1));
    match (m.peak_tflops, m.mfu) {
        (Some(p), Some(x)) if !close(x, achieved / (p * world), EXACT) => {
            f.differs("MFU", x, &format!("achieved TFLOP/s / the peak of {world} GPUs"), achieved / (p * world))
        }
        (Some(_), None) | (None, Some(_)) => f.say(format!("MFU ({:?}) and the peak ({:?}) do not come together", m.mfu, m.peak_tflops)),
        _ => {}
    }
}

/// The data's floor and best accuracy, as the suite's data table gives
/// them (`floor`, [`DataSpec::loss_floor`]): the run recorded them with
/// the same arithmetic and JSON carries an f64 exactly, so they agree to
/// the last digits, within [`FLOOR`].
fn data(w: &Workload, m: &Metrics, floor: Option<f64>, f: &mut Findings) {
    let kind = match &w.data {
        DataSpec::Synthetic { .. } => "synthetic",
        DataSpec::Bin { .. } => "bin",
        DataSpec::Regression { .. } => "regression",
        DataSpec::Images { .. } => "images",
        DataSpec::Pairs { .. } => "pairs",
    };
    let source = format!("the suite's `{kind}` data table");
    let same = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => close(a, b, FLOOR),
        (a, b) => a.is_none() && b.is_none(),
    };
    if !same(m.loss_floor, floor) {
        f.differs("the data's loss floor", show(m.loss_floor), &source, show(floor));
    }
    // Only classifiers record the best accuracy.
    let classifies = ModelConfig::resolve(&w.model, w.data.vocab().unwrap_or(2), w.seq_len).is_ok_and(|c| c.family().classifies());
    let best = w.data.best_accuracy().filter(|_| classifies);
    if !same(m.best_accuracy, best) {
        f.differs("the data's best accuracy", show(m.best_accuracy), &source, show(best));
    }
}

/// An optional figure as messages write it: the shortest text that reads
/// back as the same f64, or "none".
fn show(x: Option<f64>) -> String {
    x.map_or_else(|| "none".into(), |x| x.to_string())
}

/// The curves: steps in order, times monotone within the train time,
/// accuracy at the evaluations, the final figures their last points, and
/// each evaluation between the training of the steps before and after it.
fn curves(m: &Metrics, f: &mut Findings) {
    let t = m.train_time_s;
    for (name, c) in [("loss curve", &m.loss_curve), ("eval curve", &m.eval_curve), ("accuracy curve", &m.accuracy_curve)] {
        if let Some(p) = c.windows(2).find(|p| p[1].0 <= p[0].0 || p[1].1.partial_cmp(&p[0].1).is_none_or(|o| o.is_lt())) {
            f.say(format!("its {name} goes back: step {} at {} s follows step {} at {} s", p[1].0, p[1].1, p[0].0, p[0].1));
        }
        if let Some(p) = c.iter().find(|p| !(p.1 >= 0.0 && p.1 <= t * (1.0 + EXACT))) {
            f.say(format!("its {name} has step {} at {} s, outside its train time of {t} s", p.0, p.1));
        }
    }
    if !m.accuracy_curve.is_empty() {
        let at = |c: &[(u64, f64, f64)], i: usize| c.get(i).map(|p| format!("step {} at {} s", p.0, p.1)).unwrap_or("nothing".into());
        let n = m.accuracy_curve.len().max(m.eval_curve.len());
        let same = |i: usize| m.accuracy_curve.get(i).map(|p| (p.0, p.1)) == m.eval_curve.get(i).map(|p| (p.0, p.1));
        if let Some(i) = (0..n).find(|&i| !same(i)) {
            f.differs(
                &format!("its accuracy curve's point {}", i + 1),
                at(&m.accuracy_curve, i),
                "the eval curve (both are taken at each evaluation)",
                at(&m.eval_curve, i),
            );
        }
    }
    match m.eval_curve.last() {
        None => f.say("it has no evaluation (every entry is evaluated after its last step)"),
        Some(last) if last.0 != m.steps => f.differs("the last evaluation's step", last.0, "its steps", m.steps),
        Some(_) => {}
    }
    let last = |c: &[(u64, f64, f64)]| c.last().map(|p| p.2);
    for (name, got, want, source) in [
        ("the final eval loss", m.final_eval_loss, last(&m.eval_curve), "the eval curve's last point"),
        ("the final eval accuracy", m.final_eval_accuracy, last(&m.accuracy_curve), "the accuracy curve's last point"),
        ("the final train loss", m.final_train_loss, last(&m.loss_curve), "the loss curve's last point"),
    ] {
        let same = match (got, want) {
            (Some(a), Some(b)) => close(a, b, EXACT) || (a.is_nan() && b.is_nan()),
            (a, b) => a.is_none() && b.is_none(),
        };
        if !same {
            f.differs(name, format!("{got:?}"), source, format!("{want:?}"));
        }
    }
    // The loss curve's time of a step is when it finished training; an
    // evaluation after step s comes after step s - 1 (0-based) and before
    // step s.
    let trained: BTreeMap<u64, f64> = m.loss_curve.iter().map(|p| (p.0, p.1)).collect();
    let mut early = Vec::new();
    let mut late = Vec::new();
    for &(s, te, _) in &m.eval_curve {
        if let Some(&tb) = s.checked_sub(1).and_then(|i| trained.get(&i)).filter(|&&tb| te < tb) {
            early.push(format!("after step {s} at {te} s, step {s} finished training at {tb} s"));
        }
        if let Some(&ta) = trained.get(&s).filter(|&&ta| te > ta) {
            late.push(format!("after step {s} at {te} s, step {} finished training at {ta} s", s + 1));
        }
    }
    for (xs, when) in [(early, "before the step they follow finished training"), (late, "after the next step finished training")] {
        if let Some(first) = xs.first() {
            f.say(format!(
                "{} of its {} evaluations are timed {when} (the loss curve's times); the first: {first}",
                xs.len(),
                m.eval_curve.len()
            ));
        }
    }
}

/// The loss curve's span over the timed steps is the step histogram's
/// time (without restores or retries in between).
fn loss_span(m: &Metrics, step: &hdrhistogram::Histogram<u64>, f: &mut Findings) {
    if redone(m) || m.steps == 0 {
        return;
    }
    let warm = m.warmup_steps.min(m.steps);
    let time_of = |s: u64| m.loss_curve.iter().find(|p| p.0 == s).map(|p| p.1);
    let start = if warm == 0 { Some(0.0) } else { time_of(warm - 1) };
    let (Some(start), Some(end)) = (start, time_of(m.steps - 1)) else { return };
    let (span, sum, longest) = (end - start, total_s(step), step.max() as f64 / 1e9);
    if (span - sum).abs() > longest + HDR * sum {
        f.say(format!(
            "its loss curve puts {span:.4} s between the end of warm-up and its last step; its step histogram holds {sum:.4} s of those steps"
        ));
    }
}

/// The targets as the suite sets them (above the data's `floor`, as the
/// suite's data table gives it), and the time and steps to target as the
/// first evaluation that reaches them.
fn targets(w: &Workload, m: &Metrics, floor: Option<f64>, f: &mut Findings) {
    let target_loss = match (w.target_loss, w.target_above_floor, floor) {
        (Some(t), _, _) => Some(t),
        (None, Some(above), Some(floor)) => Some(floor + above),
        _ => None,
    };
    let same = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => close(a, b, EXACT),
        (a, b) => a.is_none() && b.is_none(),
    };
    if !same(m.target_loss, target_loss) {
        f.differs("the target loss", format!("{:?}", m.target_loss), "the suite's target and the data's floor", format!("{target_loss:?}"));
    }
    if !same(m.target_accuracy, w.target_accuracy) {
        f.differs("the target accuracy", format!("{:?}", m.target_accuracy), "the suite", format!("{:?}", w.target_accuracy));
    }
    let (tl, ta) = (target_loss, w.target_accuracy);
    let first = if tl.is_none() && ta.is_none() {
        None
    } else {
        m.eval_curve.iter().enumerate().find_map(|(i, &(s, t, loss))| {
            let acc = m.accuracy_curve.get(i).map(|a| a.2);
            let ok = tl.is_none_or(|x| loss <= x) && ta.is_none_or(|x| acc.is_some_and(|a| a >= x));
            ok.then_some((s, t))
        })
    };
    let recorded = match (m.steps_to_target, m.time_to_target_s) {
        (Some(s), Some(t)) => Some((s, t)),
        (None, None) => None,
        (s, t) => {
            f.say(format!("steps to target ({s:?}) and time to target ({t:?}) do not come together"));
            return;
        }
    };
    // A failure after the target was reached rewinds the eval curve past
    // the evaluation that reached it; the target stays reached.
    let rewound = |s: u64| m.resilience.as_ref().is_some_and(|x| x.failures.iter().any(|fl| fl.restored_to < s && s <= fl.step));
    match (recorded, first) {
        (Some((s, t)), Some((fs, ft))) if s == fs && close(t, ft, EXACT) => {}
        (Some((s, t)), found) if rewound(s) && found.is_none_or(|(fs, ft)| s <= fs && t <= ft) && t <= m.train_time_s => {}
        (Some((s, t)), Some((fs, ft))) => f.differs(
            "time to target",
            format!("{t} s (step {s})"),
            "the first evaluation at the target on its eval curve",
            format!("{ft} s (step {fs})"),
        ),
        (Some((s, t)), None) => f.say(format!("time to target is {t} s at step {s}, but no evaluation on its curves reaches the target")),
        (None, Some((fs, ft))) => {
            f.say(format!("it records no time to target, but its evaluation after step {fs} ({ft} s) reaches the target"))
        }
        (None, None) => {}
    }
}

/// Each evaluation where the suite's schedule puts it (every
/// `eval_every_tokens` tokens trained, or every `eval_every` steps, and
/// after the last step), for entries that trained every step once.
fn eval_points(w: &Workload, m: &Metrics, batches: &[(u64, u32, u32)], f: &mut Findings) {
    if redone(m) {
        return;
    }
    let world = m.world_size.max(1);
    let per_rank = |s: u64| samples_at(batches, s, world) / u64::from(world);
    let tokens = |samples: u64| samples * u64::from(w.seq_len) * u64::from(world);
    let mut want = Vec::new();
    let mut position = 0u64;
    for s in 0..m.steps {
        let before = position;
        position += per_rank(s);
        let done = s + 1;
        let due = match w.eval_every_tokens {
            Some(every) if every > 0 => tokens(position) / every > tokens(before) / every,
            Some(_) => false,
            None => w.eval_every > 0 && done % w.eval_every == 0,
        };
        if due && w.steps != Some(done) {
            want.push(done);
        }
    }
    if want.last() != Some(&m.steps) {
        want.push(m.steps);
    }
    let got: Vec<u64> = m.eval_curve.iter().map(|p| p.0).collect();
    if got != want {
        let first = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(got.len().min(want.len()));
        f.differs(
            "the steps of its evaluations",
            format!("{:?}", &got[first.min(got.len())..got.len().min(first + 5)]),
            &format!("the suite's evaluation schedule from evaluation {}", first + 1),
            format!("{:?}", &want[first.min(want.len())..want.len().min(first + 5)]),
        );
    }
}

/// Bytes on the wire and collectives against the per-kind records, and
/// each kind's bytes sent against its buffer sizes (ring accounting).
fn wire(m: &Metrics, f: &mut Findings) {
    if m.collective_ops.is_empty() {
        return;
    }
    let collectives: u64 = m.collective_ops.values().map(|o| o.collectives).fold(0, u64::saturating_add);
    let sent: u64 = m.collective_ops.values().map(|o| o.bytes_on_wire).fold(0, u64::saturating_add);
    if collectives != m.collectives {
        f.differs("collectives", m.collectives, "the per-kind collective records", collectives);
    }
    if sent != m.bytes_on_wire {
        f.differs("bytes on the wire", m.bytes_on_wire, "the per-kind collective records", sent);
    }
    let n = u128::from(m.world_size.max(1));
    for (name, o) in &m.collective_ops {
        let Some(op) = Op::ALL.into_iter().find(|op| op.name() == name) else {
            f.say(format!("it records collectives of an unknown kind `{name}`"));
            continue;
        };
        let factor = match op {
            Op::AllReduce => 2 * (n - 1),
            Op::AllGather | Op::ReduceScatter => n - 1,
        };
        // Each collective's bytes sent are rounded down: the sum lies
        // within one byte per collective below the whole's.
        let most = factor * u128::from(o.bytes) / n;
        let got = u128::from(o.bytes_on_wire);
        if got > most || got + u128::from(o.collectives) < most {
            f.differs(&format!("{name}'s bytes on the wire"), o.bytes_on_wire, &format!("{} bytes reduced over {n} ranks", o.bytes), most);
        }
    }
}

/// Rank 0's memory figures are the entry's.
fn ranks(m: &Metrics, f: &mut Findings) {
    let Some(r0) = m.ranks.first() else { return };
    if r0.memory != m.memory {
        f.differs("its peak memory", format!("{:?}", m.memory), "rank 0's record, which it is taken from", format!("{:?}", r0.memory));
    }
    if r0.optimizer_state_bytes != m.optimizer_state_bytes {
        f.differs("its optimizer state bytes", m.optimizer_state_bytes, "rank 0's record", r0.optimizer_state_bytes);
    }
    if r0.gradient_bytes != m.gradient_bytes {
        f.differs("its gradient bytes", m.gradient_bytes, "rank 0's record", r0.gradient_bytes);
    }
}

/// What the entries of one workload share: the model's parameters and
/// FLOPs, the data's floor and best accuracy, the target.
fn shared(r: &RunResult, out: &mut Vec<String>) {
    let mut first: BTreeMap<&str, (&str, &Metrics)> = BTreeMap::new();
    for e in &r.entries {
        let (EntryStatus::Ok, Some(m)) = (&e.status, &e.metrics) else { continue };
        let Some(&(id0, m0)) = first.get(e.workload.as_str()) else {
            first.insert(&e.workload, (&e.id, m));
            continue;
        };
        let figures = [
            ("parameters", m.parameters as f64, m0.parameters as f64),
            ("FLOPs per token", m.flops_per_token, m0.flops_per_token),
            ("the loss floor", m.loss_floor.unwrap_or(f64::NAN), m0.loss_floor.unwrap_or(f64::NAN)),
            ("the best accuracy", m.best_accuracy.unwrap_or(f64::NAN), m0.best_accuracy.unwrap_or(f64::NAN)),
            ("the target loss", m.target_loss.unwrap_or(f64::NAN), m0.target_loss.unwrap_or(f64::NAN)),
        ];
        for (name, a, b) in figures {
            if !(close(a, b, EXACT) || (a.is_nan() && b.is_nan())) {
                out.push(format!(
                    "{}: {name} is {a}; {id0}, an entry of the same workload, has {b} (a workload's model and data are every entry's)",
                    e.id
                ));
            }
        }
    }
}
