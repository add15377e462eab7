//! The checks of each `[[workload]]`: its run's size, optimizer and
//! schedule, faults, targets, data and model, and how they fit together.

use std::collections::BTreeSet;
use std::path::Path;

use super::{valid_name, Checker, Seg, NAME_HINT};
use crate::suite::family::{self, DataKind, FAMILIES};
use crate::suite::model::ModelConfig;
use crate::suite::spec::{DataSpec, FaultSpec, OptimizerSpec, Pipeline, Precision, Recompute, SuiteMeta, Workload};
use Seg::{Index, Key};

impl Checker<'_> {
    /// Every `[[workload]]`; returns their names (strategies refer to them).
    pub(super) fn workloads<'s>(&mut self, workloads: &'s [Workload], meta: &SuiteMeta) -> BTreeSet<&'s str> {
        if workloads.is_empty() {
            self.err(&[], "the suite has no [[workload]]", Some("add at least one [[workload]] table".into()));
        }
        let mut names = BTreeSet::new();
        for (i, w) in workloads.iter().enumerate() {
            let at = |k: &'static str| [Key("workload"), Index(i), Key(k)];
            if !names.insert(w.name.as_str()) {
                self.err(&at("name"), format!("workload name `{}` is used twice", w.name), Some("give each workload its own name".into()));
            }
            if !valid_name(&w.name) {
                self.err(&at("name"), format!("workload name `{}` is not a plain name", w.name), Some(NAME_HINT.into()));
            }
            self.workload(i, w, meta);
        }
        names
    }

    /// The `i`-th workload, after its name: sizes and length of the run, the
    /// optimizer, the schedule, clipping, faults, targets, then the model
    /// and the data, the precision, and last the bounds of every key and the
    /// estimates of memory (`limits`).
    fn workload(&mut self, i: usize, w: &Workload, meta: &SuiteMeta) {
        let at = |k: &'static str| [Key("workload"), Index(i), Key(k)];
        self.run_size(i, w);
        self.optimizer(i, &w.optimizer);
        self.schedule(i, w);
        if let Some(g) = w.grad_clip {
            if !(g.is_finite() && g > 0.0) {
                self.err(&at("grad_clip"), "`grad_clip` must be a positive norm", Some("leave it out to disable clipping".into()));
            }
        }
        if let Some(f) = &w.faults {
            self.faults(i, f);
        }
        self.targets(i, w);
        self.model_fits_data(i, w);
        self.data(i, &w.data);
        self.model(i, w);
        if w.precision == Precision::Fp16 && matches!(w.optimizer, OptimizerSpec::Sgd { .. }) {
            // Loss scaling is wired to the fused AdamW's skip-on-overflow.
            self.err(
                &at("precision"),
                "fp16 with loss scaling needs the AdamW optimizer",
                Some("use `precision = \"bf16\"` with SGD".into()),
            );
        }
        self.workload_bounds(i, w, meta);
    }

    /// Batch, sequence, accumulation, how long to train, eval batches.
    fn run_size(&mut self, i: usize, w: &Workload) {
        let at = |k: &'static str| [Key("workload"), Index(i), Key(k)];
        if w.batch == 0 {
            self.err(&at("batch"), "`batch` must be at least 1", None);
        }
        if w.seq_len == 0 {
            self.err(&at("seq_len"), "`seq_len` must be at least 1", None);
        }
        if w.grad_accum == 0 {
            self.err(&at("grad_accum"), "`grad_accum` must be at least 1", None);
        }
        match (w.steps, w.time_budget_s) {
            (None, None) => self.err(
                &[Key("workload"), Index(i)],
                format!("workload `{}` has neither `steps` nor `time_budget_s`", w.name),
                Some("say how long to train, e.g. `steps = 200`".into()),
            ),
            (Some(0), _) => self.err(&at("steps"), "`steps` must be at least 1", None),
            (_, Some(t)) if !(t.is_finite() && t > 0.0) => {
                self.err(&at("time_budget_s"), "`time_budget_s` must be a positive number of seconds", None)
            }
            _ => {}
        }
        if w.eval_batches == 0 {
            self.err(&at("eval_batches"), "`eval_batches` must be at least 1", None);
        }
        match w.eval_every_tokens {
            Some(0) => self.err(&at("eval_every_tokens"), "`eval_every_tokens` must be at least 1", None),
            Some(_) if w.eval_every > 0 => self.err(
                &at("eval_every_tokens"),
                "give `eval_every` (steps) or `eval_every_tokens`, not both",
                Some("`eval_every_tokens` evaluates entries with different batches at the same amounts of data".into()),
            ),
            _ => {}
        }
    }

    /// The workload's `optimizer` table.
    fn optimizer(&mut self, i: usize, optimizer: &OptimizerSpec) {
        let at = |k: &'static str| [Key("workload"), Index(i), Key(k)];
        match optimizer {
            OptimizerSpec::Adamw { lr, betas, eps, weight_decay } => {
                self.lr(&at("optimizer"), *lr);
                if !betas.iter().all(|b| (0.0..1.0).contains(b)) {
                    self.err(
                        &[Key("workload"), Index(i), Key("optimizer"), Key("betas")],
                        "AdamW `betas` must each lie in [0, 1)",
                        Some("the usual values are [0.9, 0.95] or [0.9, 0.999]".into()),
                    );
                }
                if !(eps.is_finite() && *eps > 0.0) {
                    self.err(&[Key("workload"), Index(i), Key("optimizer"), Key("eps")], "`eps` must be positive", None);
                }
                if !(weight_decay.is_finite() && *weight_decay >= 0.0) {
                    self.err(
                        &[Key("workload"), Index(i), Key("optimizer"), Key("weight_decay")],
                        "`weight_decay` must be zero or positive",
                        None,
                    );
                }
            }
            OptimizerSpec::Sgd { lr, momentum, weight_decay, nesterov } => {
                self.lr(&at("optimizer"), *lr);
                if !(0.0..1.0).contains(momentum) {
                    self.err(&[Key("workload"), Index(i), Key("optimizer"), Key("momentum")], "`momentum` must lie in [0, 1)", None);
                }
                if *nesterov && *momentum == 0.0 {
                    self.err(
                        &[Key("workload"), Index(i), Key("optimizer"), Key("nesterov")],
                        "Nesterov momentum needs `momentum` > 0",
                        None,
                    );
                }
                if !(weight_decay.is_finite() && *weight_decay >= 0.0) {
                    self.err(
                        &[Key("workload"), Index(i), Key("optimizer"), Key("weight_decay")],
                        "`weight_decay` must be zero or positive",
                        None,
                    );
                }
            }
        }
    }

    /// The learning rate of the optimizer table at `at`.
    fn lr(&mut self, at: &[Seg], lr: f64) {
        if !(lr.is_finite() && lr > 0.0) {
            let mut segs = at.to_vec();
            segs.push(Seg::Key("lr"));
            self.err(&segs, "`lr` must be a positive number", Some("typical values: 1e-3 for small models, 6e-4 for GPT-2 124M".into()));
        }
    }

    /// The workload's `schedule` table, against its `steps`.
    fn schedule(&mut self, i: usize, w: &Workload) {
        if !(0.0..=1.0).contains(&w.schedule.min_lr_ratio) {
            self.err(&[Key("workload"), Index(i), Key("schedule"), Key("min_lr_ratio")], "`min_lr_ratio` must lie in [0, 1]", None);
        }
        if let (Some(steps), true) = (w.steps, w.schedule.warmup_steps > 0) {
            if w.schedule.warmup_steps >= steps {
                self.err(
                    &[Key("workload"), Index(i), Key("schedule"), Key("warmup_steps")],
                    format!("warm-up ({} steps) is not shorter than the run ({steps} steps)", w.schedule.warmup_steps),
                    None,
                );
            }
        }
    }

    /// The workload's `faults` table.
    fn faults(&mut self, i: usize, f: &FaultSpec) {
        let at_f = |k: &'static str| [Key("workload"), Index(i), Key("faults"), Key(k)];
        if f.at_steps.contains(&0) {
            self.err(&at_f("at_steps"), "failures strike after a step: steps start at 1", None);
        }
        if let Some(m) = f.mtbf_s {
            if !(m.is_finite() && m > 0.0) {
                self.err(&at_f("mtbf_s"), "`mtbf_s` must be a positive number of seconds", None);
            }
        }
        if f.seed.is_some() && f.mtbf_s.is_none() {
            self.err(&at_f("seed"), "`seed` only seeds random failures", Some("add `mtbf_s`, or remove `seed`".into()));
        }
        if f.max_restarts == Some(0) {
            self.err(
                &at_f("max_restarts"),
                "`max_restarts` must be at least 1",
                Some("it bounds the restarts after injected failures".into()),
            );
        }
        if let Some(r) = f.max_time_lost_ratio {
            if !(r.is_finite() && r > 0.0) {
                self.err(
                    &at_f("max_time_lost_ratio"),
                    "`max_time_lost_ratio` must be a positive multiple of the entry's failure-free training time",
                    None,
                );
            }
        }
        let injects = !f.at_steps.is_empty() || f.mtbf_s.is_some();
        for (key, given) in [("max_restarts", f.max_restarts.is_some()), ("max_time_lost_ratio", f.max_time_lost_ratio.is_some())] {
            if given && !injects {
                self.err(
                    &at_f(key),
                    format!("`{key}` only bounds injected failures"),
                    Some("add `at_steps` or `mtbf_s`, or remove it".into()),
                );
            }
        }
        if let Some(p) = f.lose_memory {
            if !(0.0..=1.0).contains(&p) {
                self.err(&at_f("lose_memory"), "`lose_memory` is the share of failures that lose host memory: a number from 0 to 1", None);
            }
        }
        if f.oom_above_batch == Some(0) {
            self.err(&at_f("oom_above_batch"), "`oom_above_batch` must be at least 1", None);
        }
    }

    /// `target_loss` and `target_above_floor`.
    fn targets(&mut self, i: usize, w: &Workload) {
        let at = |k: &'static str| [Key("workload"), Index(i), Key(k)];
        if w.target_loss.is_some() && w.target_above_floor.is_some() {
            self.err(&at("target_above_floor"), "give `target_loss` or `target_above_floor`, not both", None);
        }
        if let Some(t) = w.target_above_floor {
            if !(t.is_finite() && t >= 0.0) {
                self.err(&at("target_above_floor"), "`target_above_floor` must be zero or positive", None);
            }
            if matches!(w.data, DataSpec::Bin { .. }) {
                self.err(
                    &at("target_above_floor"),
                    "token files have no known loss floor",
                    Some("use an absolute `target_loss` for `kind = \"bin\"` data".into()),
                );
            }
        }
        if let Some(t) = w.target_loss {
            if !t.is_finite() {
                self.err(&at("target_loss"), "`target_loss` must be a number", None);
            }
        }
        if let Some(a) = w.target_accuracy {
            if !(a > 0.0 && a <= 1.0) {
                self.err(&at("target_accuracy"), "`target_accuracy` is a top-1 accuracy: a number in (0, 1]", None);
            }
            if w.target_loss.is_some() || w.target_above_floor.is_some() {
                self.err(&at("target_accuracy"), "give a loss target or `target_accuracy`, not both", None);
            }
            if !family::of(w.model.kind).classifies() {
                self.err(
                    &at("target_accuracy"),
                    "only classification workloads report accuracy",
                    Some("`target_accuracy` needs `model.kind = \"vision\"`".into()),
                );
            }
        }
        if w.stop_at_target {
            if w.target_loss.is_none() && w.target_above_floor.is_none() && w.target_accuracy.is_none() {
                self.err(
                    &at("stop_at_target"),
                    "`stop_at_target` needs a target",
                    Some("set `target_loss`, `target_above_floor` or `target_accuracy`".into()),
                );
            }
            if w.eval_every == 0 && w.eval_every_tokens.is_none() {
                self.err(
                    &at("stop_at_target"),
                    "`stop_at_target` needs evaluations during training: only evaluations can reach the target",
                    Some("set `eval_every` or `eval_every_tokens`".into()),
                );
            }
        }
    }

    /// The model trains on the kind of data given: the encoder on
    /// regression data, the token models on tokens ([`family::DataFit`]).
    /// The error is the model's family's, else the data's family's.
    fn model_fits_data(&mut self, i: usize, w: &Workload) {
        let data_at = [Key("workload"), Index(i), Key("data")];
        let (fit, data) = (family::of(w.model.kind).data(), DataKind::from(&w.data));
        if fit.kinds.contains(&data) {
            return;
        }
        if let Some(message) = fit.other {
            self.err(&data_at, message, None);
        } else if let Some((message, hint)) = FAMILIES.iter().find(|f| f.data().kinds.contains(&data)).and_then(|f| f.data().claimed) {
            self.err(&data_at, message, hint.map(String::from));
        }
    }

    /// The workload's `data` table; token files must exist (relative to the
    /// suite file).
    fn data(&mut self, i: usize, data: &DataSpec) {
        match data {
            DataSpec::Synthetic { vocab, branching, .. } => {
                if *vocab < 2 {
                    self.err(&[Key("workload"), Index(i), Key("data"), Key("vocab")], "`vocab` must be at least 2", None);
                } else if *branching == 0 || branching > vocab {
                    self.err(
                        &[Key("workload"), Index(i), Key("data"), Key("branching")],
                        format!("`branching` must lie in 1..={vocab} (the vocabulary)"),
                        None,
                    );
                }
            }
            DataSpec::Bin { train, val, val_fraction, vocab } => {
                let base = self.path.parent().unwrap_or(Path::new("."));
                for (k, p) in [("train", Some(train)), ("val", val.as_ref())] {
                    if let Some(p) = p {
                        let full = if p.is_absolute() { p.clone() } else { base.join(p) };
                        if !full.is_file() {
                            self.err(
                                &[Key("workload"), Index(i), Key("data"), Key(k)],
                                format!("token file {} does not exist", full.display()),
                                Some("paths are relative to the suite file".into()),
                            );
                        }
                    }
                }
                if val.is_none() && !(*val_fraction > 0.0 && *val_fraction < 0.5) {
                    self.err(&[Key("workload"), Index(i), Key("data"), Key("val_fraction")], "`val_fraction` must lie in (0, 0.5)", None);
                }
                if let Some(v) = vocab {
                    if *v < 2 || *v > 65536 {
                        self.err(
                            &[Key("workload"), Index(i), Key("data"), Key("vocab")],
                            "`vocab` must lie in 2..=65536 (tokens are u16)",
                            None,
                        );
                    }
                }
            }
            DataSpec::Regression { noise, .. } => {
                if !(noise.is_finite() && *noise >= 0.0) {
                    self.err(&[Key("workload"), Index(i), Key("data"), Key("noise")], "`noise` must be zero or positive", None);
                }
            }
            DataSpec::Images { classes, image_size, channels, noise, label_noise, padding, threads, pipeline, .. } => {
                let at = |k: &'static str| [Key("workload"), Index(i), Key("data"), Key(k)];
                if *classes < 2 {
                    self.err(&at("classes"), "`classes` must be at least 2", None);
                }
                if *image_size < 4 {
                    self.err(&at("image_size"), "`image_size` must be at least 4 pixels", None);
                }
                if *channels < 1 {
                    self.err(&at("channels"), "`channels` must be at least 1", None);
                }
                if !(noise.is_finite() && *noise >= 0.0) {
                    self.err(&at("noise"), "`noise` must be zero or positive", None);
                }
                // Beyond (K-1)/K the true class is no longer the likeliest label.
                let most = (*classes as f64 - 1.0) / (*classes as f64).max(1.0);
                if !(*label_noise >= 0.0 && *label_noise < most) {
                    self.err(
                        &at("label_noise"),
                        format!("`label_noise` must lie in [0, {most:.4}): (classes - 1) / classes"),
                        Some("the probability that a label is flipped to another class".into()),
                    );
                }
                if *padding >= *image_size {
                    self.err(&at("padding"), "`padding` must be smaller than `image_size`", None);
                }
                if *threads == Some(0) {
                    self.err(&at("threads"), "`threads` must be at least 1", None);
                }
                if threads.is_some() && *pipeline == Some(Pipeline::Device) {
                    self.err(
                        &at("threads"),
                        "`threads` makes images on the host, but `pipeline = \"device\"` makes them on the device",
                        Some("drop `threads`, or set `pipeline = \"host\"`".into()),
                    );
                }
            }
            DataSpec::Pairs { vocab, noise, .. } => {
                if !(4..=65536).contains(vocab) {
                    self.err(
                        &[Key("workload"), Index(i), Key("data"), Key("vocab")],
                        "`vocab` must lie in 4..=65536 (tokens 0 and 1 start the target and end the source; two words at least)",
                        None,
                    );
                }
                if !(0.0..=1.0).contains(noise) {
                    self.err(
                        &[Key("workload"), Index(i), Key("data"), Key("noise")],
                        "`noise` is a probability: it must lie in [0, 1]",
                        Some("1 makes every target token random".into()),
                    );
                }
            }
        }
    }

    /// The workload's `model` table: its sizes resolve (preset, explicit
    /// sizes), and its dropout; then its family's own checks, and whether
    /// the family recomputes activations if asked to.
    fn model(&mut self, i: usize, w: &Workload) {
        let model_at = [Key("workload"), Index(i), Key("model")];
        let resolved = match ModelConfig::resolve(&w.model, 2, w.seq_len) {
            Ok(cfg) => Some(cfg),
            Err((msg, hint)) => {
                self.err(&model_at, msg, hint);
                None
            }
        };
        if let Some(d) = w.model.dropout {
            if !(0.0..1.0).contains(&d) {
                self.err(&[Key("workload"), Index(i), Key("model"), Key("dropout")], "`dropout` must lie in [0, 1)", None);
            }
        }
        let family = family::of(w.model.kind);
        for unfit in family.check_workload(w, resolved.as_ref()) {
            let mut at = vec![Key("workload"), Index(i)];
            at.extend(unfit.at.iter().map(|k| Key(k)));
            self.err(&at, unfit.message, unfit.hint);
        }
        if let Some(Err(msg)) = w.recompute.as_ref().map(|r| r.resolve()) {
            self.err(
                &[Key("workload"), Index(i), Key("recompute")],
                msg,
                Some("recompute = \"all\" drops every layer's activations".into()),
            );
        } else if w.recompute().is_ok_and(|r| r != Recompute::None) && !family.recomputes() {
            // The families whose layers are not wrapped for recomputation.
            self.err(
                &[Key("workload"), Index(i), Key("recompute")],
                format!("the {} model does not recompute activations", family.name()),
                Some("leave `recompute` out, or set it to \"none\"".into()),
            );
        }
    }
}
