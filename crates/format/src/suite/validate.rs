//! Checking a suite: [`Suite::load`] and [`Suite::parse`] read it, and
//! [`Suite::validate`] checks values against each other. Every problem is a
//! [`SuiteError`] that points into the file.

use std::collections::BTreeSet;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

mod limits;

use sha2::{Digest, Sha256};

use super::limits::MAX_NAME_LEN;
use super::model::ModelConfig;
use super::spec::{
    DataSpec, FaultSpec, ModelKind, OptimizerSpec, Pipeline, PluginSpec, Precision, ProjectionSpec, Recompute, Strategy, SuiteMeta,
    SuiteSpec, Workload, BATCH_POLICIES, CHECKPOINT_POLICIES, COMPRESSORS, NCCL_RESERVED, TRACK_KINDS,
};
use crate::fmt::{printable, withheld_in_lines};

/// A loaded, validated suite with its source.
#[derive(Debug, Clone)]
pub struct Suite {
    pub path: PathBuf,
    pub source: String,
    /// sha256 of the file's bytes, hex.
    pub sha256: String,
    pub spec: SuiteSpec,
}

/// A problem in a suite file, with where it is.
#[derive(Debug, Clone, thiserror::Error)]
pub struct SuiteError {
    pub path: PathBuf,
    pub source_text: String,
    pub span: Option<Range<usize>>,
    pub message: String,
    pub hint: Option<String>,
}

/// Several problems found by validation, reported together.
#[derive(Debug, Clone, thiserror::Error)]
pub struct SuiteErrors(pub Vec<SuiteError>);

impl fmt::Display for SuiteErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl SuiteError {
    /// Line and column (1-based) of the start of the span.
    pub fn line_col(&self) -> Option<(usize, usize)> {
        let start = self.span.as_ref()?.start.min(self.source_text.len());
        let before = &self.source_text[..start];
        let line = before.matches('\n').count() + 1;
        let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        Some((line, col))
    }
}

impl fmt::Display for SuiteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use codespan_reporting::diagnostic::{Diagnostic, Label};
        use codespan_reporting::files::SimpleFile;
        use codespan_reporting::term;
        let name = self.path.display().to_string();
        let loc = match self.line_col() {
            Some((l, c)) => format!("{name}:{l}:{c}"),
            None => name.clone(),
        };
        // The file chose the message's quotes and the excerpt: what a
        // terminal would act on (escape sequences) is shown, not sent.
        let (loc, message) = (printable(&loc), printable(&self.message));
        let mut diag = Diagnostic::error().with_message(format!("{loc}: {message}"));
        let (source, at) = excerpt(&self.source_text);
        if let Some(span) = &self.span {
            let end = span.end.max(span.start + 1).min(self.source_text.len());
            let start = span.start.min(end);
            diag = diag.with_labels(vec![Label::primary((), at(start)..at(end))]);
        }
        if let Some(h) = &self.hint {
            diag = diag.with_notes(vec![format!("hint: {}", printable(h))]);
        }
        let file = SimpleFile::new(printable(&name), source.as_str());
        let mut out = Vec::new();
        let config = term::Config::default();
        if term::emit(&mut out, &config, &file, &diag).is_err() {
            return write!(f, "error: {loc}: {message}");
        }
        f.write_str(String::from_utf8_lossy(&out).trim_end())
    }
}

/// `source` for an excerpt on a terminal: each character withheld from
/// its lines ([`withheld_in_lines`]) replaced by U+FFFD, with the map from
/// a byte offset in `source` to the same place in the copy.
fn excerpt(source: &str) -> (String, impl Fn(usize) -> usize + '_) {
    let shown = |i: usize, c: char| if withheld_in_lines(source, i, c) { '\u{fffd}' } else { c };
    let copy: String = source.char_indices().map(|(i, c)| shown(i, c)).collect();
    let at = move |offset: usize| {
        let mut o = offset.min(source.len());
        while !source.is_char_boundary(o) {
            o -= 1;
        }
        source[..o].char_indices().map(|(i, c)| shown(i, c).len_utf8()).sum()
    };
    (copy, at)
}

/// A path into the TOML document: keys and array indices.
#[derive(Debug, Clone)]
enum Seg {
    Key(&'static str),
    Index(usize),
}

use Seg::{Index, Key};

struct Checker<'a> {
    path: &'a Path,
    source: &'a str,
    doc: Option<toml_edit::Document<String>>,
    errors: Vec<SuiteError>,
}

impl<'a> Checker<'a> {
    fn span_of(&self, segs: &[Seg]) -> Option<Range<usize>> {
        let doc = self.doc.as_ref()?;
        let mut item: &toml_edit::Item = doc.as_item();
        let mut best = item.span();
        for seg in segs {
            let next = match seg {
                Seg::Key(k) => item.get(*k),
                Seg::Index(i) => item.get(*i),
            };
            match next {
                Some(n) => {
                    item = n;
                    if let Some(s) = n.span() {
                        best = Some(s);
                    }
                }
                None => break,
            }
        }
        best
    }

    fn err(&mut self, segs: &[Seg], message: impl Into<String>, hint: Option<String>) {
        let span = self.span_of(segs);
        self.errors.push(SuiteError {
            path: self.path.to_path_buf(),
            source_text: self.source.to_owned(),
            span,
            message: message.into(),
            hint,
        });
    }
}

impl Suite {
    /// An error about key `key` of the `index`-th `[[strategy]]` (or the
    /// strategy itself when the key is absent), at its line and column.
    pub fn strategy_error(&self, index: usize, key: &'static str, message: impl Into<String>, hint: Option<String>) -> SuiteError {
        let mut c = Checker {
            path: &self.path,
            source: &self.source,
            doc: self.source.parse::<toml_edit::Document<String>>().ok(),
            errors: Vec::new(),
        };
        c.err(&[Key("strategy"), Index(index), Key(key)], message, hint);
        c.errors.remove(0)
    }

    /// Reads and checks a suite file.
    pub fn load(path: &Path) -> Result<Suite, SuiteErrors> {
        let unreadable = |message: String| {
            SuiteErrors(vec![SuiteError {
                path: path.to_path_buf(),
                source_text: String::new(),
                span: None,
                message,
                hint: Some("give the path of a suite file, e.g. suites/cpu.toml".into()),
            }])
        };
        // Bounded: `harness validate /dev/zero` must not fill the memory.
        let bytes = crate::files::read_capped(path, crate::files::SUITE_MAX_BYTES).map_err(|e| match e {
            crate::files::FileError::Io { error, .. } => unreadable(format!("cannot read the suite: {error}")),
            e => unreadable(format!("cannot read the suite: {e}")),
        })?;
        let source = String::from_utf8(bytes).map_err(|e| unreadable(format!("cannot read the suite: it is not UTF-8 ({e})")))?;
        Suite::parse(path, source)
    }

    /// Parses and checks suite text (`path` only names it in messages).
    pub fn parse(path: &Path, source: String) -> Result<Suite, SuiteErrors> {
        let spec: SuiteSpec = match toml::from_str(&source) {
            Ok(s) => s,
            Err(e) => {
                let message = e.message().trim().to_owned();
                let hint = parse_hint(&message);
                return Err(SuiteErrors(vec![SuiteError {
                    path: path.to_path_buf(),
                    source_text: source.clone(),
                    span: e.span(),
                    message,
                    hint,
                }]));
            }
        };
        let sha256 = hex::encode(Sha256::digest(source.as_bytes()));
        let suite = Suite { path: path.to_path_buf(), source, sha256, spec };
        suite.validate()?;
        Ok(suite)
    }

    /// Checks values against each other; all problems are returned at once,
    /// in this order: `[suite]`, the workloads in file order, the plugins,
    /// the strategies.
    pub fn validate(&self) -> Result<(), SuiteErrors> {
        let mut c = Checker {
            path: &self.path,
            source: &self.source,
            doc: self.source.parse::<toml_edit::Document<String>>().ok(),
            errors: Vec::new(),
        };
        let s = &self.spec;
        c.meta(&s.suite);
        c.plan_bounds(s);
        let names = c.workloads(&s.workloads, &s.suite);
        c.plugins(&s.plugins);
        c.strategies(s, &names);
        c.tracks(s, &names);
        if let Some(p) = &s.projection {
            c.projection(p, s);
        }
        if c.errors.is_empty() {
            Ok(())
        } else {
            Err(SuiteErrors(c.errors))
        }
    }
}

/// The most cluster strings (and strategies) a `[projection]` may name: a
/// report of others' result files must not be made to project without end.
pub const MAX_PROJECTION_CLUSTERS: usize = 64;

/// The checks, one section of the file per method.
impl Checker<'_> {
    /// `[projection]`: at least one cluster, each of the shape
    /// `NODESxGPUS` or `A-BxGPUS` before its keys (the keys are read by
    /// `harness report`, which says what is wrong with them), and
    /// strategies the suite has (`allreduce` names the plain all-reduce).
    fn projection(&mut self, p: &ProjectionSpec, s: &SuiteSpec) {
        if p.clusters.is_empty() {
            self.err(
                &[Key("projection"), Key("clusters")],
                "`[projection]` needs at least one cluster",
                Some("e.g. clusters = [\"1-128x8:net=100Gbps\", \"2x4:net=10Gbps\"] (docs/projection.md)".into()),
            );
        }
        if p.clusters.len() > MAX_PROJECTION_CLUSTERS || p.strategies.len() > MAX_PROJECTION_CLUSTERS {
            self.err(
                &[Key("projection")],
                format!("`[projection]` names more than {MAX_PROJECTION_CLUSTERS} clusters or strategies"),
                Some("a range of nodes (`1-128x8:net=100Gbps`) names a cluster per power of two in one string".into()),
            );
        }
        let number =
            |x: &str| !x.is_empty() && x.len() <= 5 && x.bytes().all(|b| b.is_ascii_digit()) && x.parse::<u32>().is_ok_and(|n| n > 0);
        for (i, c) in p.clusters.iter().enumerate() {
            let shape = c.split_once(':').map_or(c.as_str(), |(a, _)| a);
            let ok = shape.split_once('x').is_some_and(|(nodes, g)| {
                number(g) && nodes.split_once('-').map_or_else(|| number(nodes), |(a, b)| number(a) && number(b))
            });
            if !ok {
                self.err(
                    &[Key("projection"), Key("clusters"), Index(i)],
                    format!("cluster `{}` is not NODESxGPUS[:key=value,...]", c.escape_debug()),
                    Some("e.g. \"64x8:net=100Gbps\" or \"1-128x8:net=400Gbps\" (docs/projection.md)".into()),
                );
            }
        }
        for (i, name) in p.strategies.iter().enumerate() {
            if name != "allreduce" && !s.strategies.iter().any(|t| &t.name == name) {
                self.err(
                    &[Key("projection"), Key("strategies"), Index(i)],
                    format!("strategy `{}` is not one of the suite's", name.escape_debug()),
                    Some("name a [[strategy]] of the suite, or `allreduce` for the plain all-reduce".into()),
                );
            }
        }
    }

    /// The `[suite]` table.
    fn meta(&mut self, meta: &SuiteMeta) {
        if meta.name.trim().is_empty() {
            self.err(&[Key("suite"), Key("name")], "the suite needs a name", None);
        }
        if meta.repeats == 0 {
            self.err(&[Key("suite"), Key("repeats")], "`repeats` must be at least 1", None);
        }
        if meta.world_size == 0 {
            self.err(&[Key("suite"), Key("world_size")], "`world_size` must be at least 1", None);
        }
        if meta.bucket_mb.is_some_and(|mb| !(mb.is_finite() && mb > 0.0)) {
            self.err(&[Key("suite"), Key("bucket_mb")], "`bucket_mb` must be a positive size in MiB", None);
        }
        if !(meta.collective_timeout_s.is_finite() && meta.collective_timeout_s > 0.0) {
            self.err(&[Key("suite"), Key("collective_timeout_s")], "`collective_timeout_s` must be a positive number of seconds", None);
        }
        if let Some(p) = meta.peak_tflops {
            if !(p.is_finite() && p > 0.0) {
                self.err(&[Key("suite"), Key("peak_tflops")], "`peak_tflops` must be a positive number", None);
            }
        }
        if meta.threads == Some(0) {
            self.err(&[Key("suite"), Key("threads")], "`threads` must be at least 1", Some("leave it out to use every core".into()));
        }
        self.description(&[Key("suite"), Key("description")], meta.description.as_deref());
        self.meta_bounds(meta);
    }

    /// A description is text for people (the report shows it, results and
    /// bundles carry it to others): tabs and line breaks, but no character
    /// that a terminal acts on or that reorders the text around it.
    fn description(&mut self, at: &[Seg], text: Option<&str>) {
        if let Some((_, c)) = text.and_then(|t| t.char_indices().find(|&(i, c)| withheld_in_lines(t, i, c))) {
            self.err(
                at,
                format!("the description holds {}, a character that a terminal acts on or that reorders text", c.escape_unicode()),
                Some("write it as plain text; tabs and line breaks are fine".into()),
            );
        }
    }

    /// Every `[[workload]]`; returns their names (strategies refer to them).
    fn workloads<'s>(&mut self, workloads: &'s [Workload], meta: &SuiteMeta) -> BTreeSet<&'s str> {
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
            if w.model.kind != ModelKind::Vision {
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
    /// regression data, the token models on tokens.
    fn model_fits_data(&mut self, i: usize, w: &Workload) {
        let data_at = [Key("workload"), Index(i), Key("data")];
        match (&w.model.kind, &w.data) {
            (ModelKind::Encoder, DataSpec::Regression { .. })
            | (ModelKind::Vision, DataSpec::Images { .. })
            | (ModelKind::T5, DataSpec::Pairs { .. }) => {}
            (ModelKind::Encoder, _) => self.err(&data_at, "the encoder model trains on `kind = \"regression\"` data", None),
            (ModelKind::Vision, _) => self.err(&data_at, "the vision model trains on `kind = \"images\"` data", None),
            (ModelKind::T5, _) => self.err(&data_at, "the t5 model trains on sequence pairs: `kind = \"pairs\"` data", None),
            (_, DataSpec::Images { .. }) => self.err(&data_at, "image data needs `model.kind = \"vision\"`", None),
            (_, DataSpec::Pairs { .. }) => self.err(
                &data_at,
                "pairs data needs `model.kind = \"t5\"`",
                Some("gpt and mlp train on tokens: use `synthetic` or `bin` data".into()),
            ),
            (_, DataSpec::Regression { .. }) => self.err(
                &data_at,
                "regression data needs `model.kind = \"encoder\"`",
                Some("gpt and mlp train on tokens: use `synthetic` or `bin` data".into()),
            ),
            _ => {}
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
    /// sizes), and its dropout.
    fn model(&mut self, i: usize, w: &Workload) {
        let model_at = [Key("workload"), Index(i), Key("model")];
        if let Err((msg, hint)) = ModelConfig::resolve(&w.model, 2, w.seq_len) {
            self.err(&model_at, msg, hint);
        }
        if let Some(d) = w.model.dropout {
            if !(0.0..1.0).contains(&d) {
                self.err(&[Key("workload"), Index(i), Key("model"), Key("dropout")], "`dropout` must lie in [0, 1)", None);
            }
        }
        if w.model.kind == ModelKind::Vision {
            let patch = ModelConfig::resolve(&w.model, 2, 1).ok().and_then(|c| c.patch);
            if let (Some(p), DataSpec::Images { image_size, .. }) = (patch, &w.data) {
                if i64::from(*image_size) % p != 0 {
                    self.err(
                        &[Key("workload"), Index(i), Key("data"), Key("image_size")],
                        format!("the Vision Transformer cuts images into {p} x {p} patches: `image_size` must be a multiple of {p}"),
                        None,
                    );
                }
            }
            if w.seq_len != 1 {
                self.err(
                    &[Key("workload"), Index(i), Key("seq_len")],
                    "a vision workload's sample is one image: `seq_len` must be 1",
                    Some("tokens/s then counts images/s".into()),
                );
            }
        }
        if let Some(Err(msg)) = w.recompute.as_ref().map(|r| r.resolve()) {
            self.err(
                &[Key("workload"), Index(i), Key("recompute")],
                msg,
                Some("recompute = \"all\" drops every layer's activations".into()),
            );
        } else if w.recompute().is_ok_and(|r| r != Recompute::None) {
            // The families whose layers are not wrapped for recomputation.
            let family = match w.model.kind {
                ModelKind::Vision => Some("vision"),
                ModelKind::T5 => Some("t5"),
                _ => None,
            };
            if let Some(family) = family {
                self.err(
                    &[Key("workload"), Index(i), Key("recompute")],
                    format!("the {family} model does not recompute activations"),
                    Some("leave `recompute` out, or set it to \"none\"".into()),
                );
            }
        }
    }

    /// Every `[[plugin]]`.
    fn plugins(&mut self, plugins: &[PluginSpec]) {
        let mut pnames = BTreeSet::new();
        for (i, p) in plugins.iter().enumerate() {
            let at = |k: &'static str| [Key("plugin"), Index(i), Key(k)];
            if !pnames.insert(p.name.as_str()) {
                self.err(&at("name"), format!("plugin name `{}` is used twice", p.name), None);
            }
            if !valid_name(&p.name) {
                self.err(&at("name"), format!("plugin name `{}` is not a plain name", p.name), Some(NAME_HINT.into()));
            }
            if COMPRESSORS.contains(&p.name.as_str())
                || BATCH_POLICIES.contains(&p.name.as_str())
                || CHECKPOINT_POLICIES.contains(&p.name.as_str())
            {
                self.err(
                    &at("name"),
                    format!("plugin name `{}` is the name of a built-in strategy", p.name),
                    Some("choose another name".into()),
                );
            }
            if let Some(k) = &p.kind {
                if !TRACK_KINDS.contains(&k.as_str()) {
                    self.err(&at("kind"), format!("unknown plugin kind `{k}`"), Some(format!("one of: {}", TRACK_KINDS.join(", "))));
                }
            }
            if let Some(h) = &p.sha256 {
                if h.len() != 64 || !h.chars().all(|ch| ch.is_ascii_hexdigit()) {
                    self.err(&at("sha256"), "`sha256` must be 64 hex digits", Some("`harness plugin inspect PATH` prints it".into()));
                }
            }
            if p.memory_mb == 0 {
                self.err(&at("memory_mb"), "`memory_mb` must be at least 1", None);
            }
            if p.deadline_ms == 0 {
                self.err(&at("deadline_ms"), "`deadline_ms` must be at least 1", None);
            }
            if p.tensor_mb == 0 {
                self.err(&at("tensor_mb"), "`tensor_mb` must be at least 1", None);
            }
            if p.path.as_os_str().is_empty() {
                self.err(&at("path"), "`path` must name the plugin's artifact", None);
            }
            self.plugin_bounds(i, p);
        }
    }

    /// Every `[[strategy]]`, against the suite's workloads (`names`) and
    /// plugins; then that at most one is the baseline.
    fn strategies(&mut self, s: &SuiteSpec, names: &BTreeSet<&str>) {
        let mut snames = BTreeSet::new();
        let mut baselines = 0;
        for (i, st) in s.strategies.iter().enumerate() {
            let at = |k: &'static str| [Key("strategy"), Index(i), Key(k)];
            if !snames.insert(st.name.as_str()) {
                self.err(&at("name"), format!("strategy name `{}` is used twice", st.name), None);
            }
            if !valid_name(&st.name) {
                self.err(&at("name"), format!("strategy name `{}` is not a plain name", st.name), Some(NAME_HINT.into()));
            }
            baselines += st.baseline as u32;
            self.strategy(i, st, s, names);
        }
        if baselines > 1 && s.tracks.is_empty() {
            self.err(
                &[Key("strategy")],
                "more than one strategy says `baseline = true`",
                Some("mark exactly one strategy as the baseline".into()),
            );
        }
    }

    /// Every `[[track]]`: its kind, workloads and strategies exist, no
    /// workload runs a strategy in two tracks, and `[suite.hardware]`, when
    /// given, lists the suite's GPU count among its divisions.
    fn tracks(&mut self, s: &SuiteSpec, names: &BTreeSet<&str>) {
        let snames: BTreeSet<&str> = s.strategies.iter().map(|st| st.name.as_str()).collect();
        let mut tnames = BTreeSet::new();
        let mut pairs = BTreeSet::new();
        for (i, t) in s.tracks.iter().enumerate() {
            let at = |k: &'static str| [Key("track"), Index(i), Key(k)];
            if !tnames.insert(t.name.as_str()) || !valid_name(&t.name) {
                self.err(&at("name"), format!("track name `{}` is used twice or is not a plain name", t.name), Some(NAME_HINT.into()));
            }
            self.track_bounds(i, t);
            self.description(&at("description"), t.description.as_deref());
            if !TRACK_KINDS.contains(&t.kind.as_str()) {
                self.err(&at("kind"), format!("unknown track kind `{}`", t.kind), Some(format!("one of: {}", TRACK_KINDS.join(", "))));
            }
            if t.workloads.is_empty() {
                self.err(&at("workloads"), "a track needs at least one workload", None);
            }
            for w in t.workloads.iter().filter(|w| !names.contains(w.as_str())) {
                self.err(&at("workloads"), format!("track `{}` names workload `{w}`, which the suite does not define", t.name), None);
            }
            for st in std::iter::once(&t.baseline).chain(&t.strategies) {
                if !snames.contains(st.as_str()) {
                    self.err(&at("strategies"), format!("track `{}` names strategy `{st}`, which the suite does not define", t.name), None);
                }
                for w in &t.workloads {
                    if !pairs.insert((w.as_str(), st.as_str())) {
                        self.err(
                            &at("strategies"),
                            format!("workload `{w}` runs strategy `{st}` in two tracks"),
                            Some("give each track its own strategy names".into()),
                        );
                    }
                }
            }
        }
        if let Some(h) = &s.suite.hardware {
            if !h.gpus.contains(&s.suite.world_size) {
                self.err(
                    &[Key("suite"), Key("hardware"), Key("gpus")],
                    format!("`world_size` {} is not one of the divisions {:?}", s.suite.world_size, h.gpus),
                    None,
                );
            }
        }
    }

    /// The `i`-th strategy, after its name: its link, what it names
    /// (compressor, batch policy, checkpoint policy), ZeRO, its workloads.
    fn strategy(&mut self, i: usize, st: &Strategy, s: &SuiteSpec, names: &BTreeSet<&str>) {
        let at = |k: &'static str| [Key("strategy"), Index(i), Key(k)];
        let meta = &s.suite;
        if let Some(l) = &st.link {
            if !(l.gbps.is_finite() && l.gbps > 0.0 && l.latency_us.is_finite() && l.latency_us >= 0.0) {
                self.err(
                    &at("link"),
                    "a link needs `gbps` > 0 and `latency_us` >= 0",
                    Some("e.g. link = { gbps = 10, latency_us = 5 }".into()),
                );
            }
            self.link_bounds(i, l);
            // A standard suite's multi-GPU tracks run only with --gpus >= 2.
            let in_multi_gpu_track = s.tracks.iter().any(|t| t.min_gpus >= 2 && (t.baseline == st.name || t.strategies.contains(&st.name)));
            if meta.world_size < 2 && !in_multi_gpu_track {
                self.err(&at("link"), "an emulated link needs world_size >= 2", None);
            }
            if let Some(nodes) = l.nodes {
                let world = meta.world_size;
                if nodes < 2 || (world >= 2 && (nodes > world || world % nodes != 0)) {
                    self.err(
                        &at("link"),
                        format!("`nodes = {nodes}` does not split world_size = {world} into 2 or more nodes of equal size"),
                        Some(format!("e.g. link = {{ gbps = 10, latency_us = 5, nodes = 2 }} for 2 nodes of {} ranks", (world / 2).max(1))),
                    );
                }
            }
        }
        for (k, v) in &st.nccl {
            // Each becomes an environment variable of the ranks, and shows in
            // their NCCL line: a name of NCCL's form, a value of printable
            // ASCII.
            let named = k
                .strip_prefix("NCCL_")
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_'));
            if !named {
                self.err(
                    &at("nccl"),
                    format!("`{k}` is not an NCCL setting"),
                    Some("keys are NCCL's variables, e.g. NCCL_ALGO = \"Ring\"".into()),
                );
            } else if NCCL_RESERVED.contains(&k.as_str()) {
                self.err(
                    &at("nccl"),
                    format!("`{k}` is set by harness, which reads NCCL's debug output to record the transports"),
                    Some("set it in the environment of `harness run` if you need it; the transports are then not recorded".into()),
                );
            }
            if let toml::Value::String(text) = v {
                if !text.bytes().all(|b| (b' '..=b'~').contains(&b)) {
                    self.err(
                        &at("nccl"),
                        format!("`{k}` = {text:?} holds a character other than printable ASCII"),
                        Some("NCCL's settings are names, numbers and lists of them, e.g. \"Ring,Tree\"".into()),
                    );
                }
            }
            if !matches!(v, toml::Value::String(_) | toml::Value::Integer(_) | toml::Value::Boolean(_)) {
                self.err(&at("nccl"), format!("`{k}` must be a string, an integer or a boolean"), None);
            }
        }
        self.strategy_parts(i, st, &s.plugins);
        if st.zero > 2 {
            self.err(&at("zero"), format!("ZeRO stage {} does not exist", st.zero), Some("use 0 (plain data parallelism), 1 or 2".into()));
        } else if st.zero > 0 {
            if meta.world_size < 2 {
                self.err(
                    &at("zero"),
                    format!("ZeRO stage {} shards over ranks and needs world_size >= 2", st.zero),
                    Some(format!("set `world_size` in [suite], or use `zero = 0` (the suite has world_size = {})", meta.world_size)),
                );
            }
            if st.compressor != "allreduce" {
                self.err(
                    &at("zero"),
                    format!("ZeRO stage {} reduce-scatters gradients itself and cannot use compressor `{}`", st.zero, st.compressor),
                    Some("use `compressor = \"allreduce\"` (the default) with ZeRO".into()),
                );
            }
        }
        if st.reduce_dtype != crate::suite::ReduceDtype::Fp32 {
            let why = if st.compressor != "allreduce" {
                Some(format!("compressor `{}` reduces the gradients itself", st.compressor))
            } else if st.zero > 0 {
                Some("ZeRO reduce-scatters them in their own type".to_owned())
            } else if st.link.is_some() {
                Some("an emulated link reduces after the backward pass, which averages in the gradients' type".to_owned())
            } else {
                None
            };
            if let Some(why) = why {
                self.err(
                    &at("reduce_dtype"),
                    format!("`reduce_dtype = \"bf16\"` is for the built-in all-reduce on its own: {why}"),
                    Some("use it with `compressor = \"allreduce\"`, `zero = 0` and no `link`".into()),
                );
            }
        }
        if let Some(ws) = &st.workloads {
            for w in ws {
                if !names.contains(w.as_str()) {
                    self.err(
                        &at("workloads"),
                        format!("strategy `{}` names workload `{w}`, which the suite does not define", st.name),
                        Some(format!("workloads here: {}", names.iter().copied().collect::<Vec<_>>().join(", "))),
                    );
                }
            }
        }
    }

    /// The compressor, batch policy and checkpoint policy a strategy names:
    /// each built in or a plugin of the suite (of the pinned kind), and
    /// configured only if a plugin.
    fn strategy_parts(&mut self, i: usize, st: &Strategy, plugins: &[PluginSpec]) {
        let at = |k: &'static str| [Key("strategy"), Index(i), Key(k)];
        for (key, value, known, kind, config) in [
            ("compressor", &st.compressor, COMPRESSORS, "compressor", ("compressor_config", &st.compressor_config)),
            ("batch_policy", &st.batch_policy, BATCH_POLICIES, "batch-policy", ("batch_policy_config", &st.batch_policy_config)),
            ("checkpoint", &st.checkpoint, CHECKPOINT_POLICIES, "checkpoint-policy", ("checkpoint_config", &st.checkpoint_config)),
        ] {
            let plugin = plugins.iter().find(|p| &p.name == value);
            if !known.contains(&value.as_str()) && plugin.is_none() {
                let plugins: Vec<&str> = plugins.iter().map(|p| p.name.as_str()).collect();
                let hint = if plugins.is_empty() {
                    format!("built in: {}; or declare a [[plugin]] with this name", known.join(", "))
                } else {
                    format!("built in: {}; plugins in this suite: {}", known.join(", "), plugins.join(", "))
                };
                self.err(&at(key), format!("unknown {key} `{value}`"), Some(hint));
            }
            if let Some(Some(pk)) = plugin.map(|p| p.kind.as_deref()) {
                if pk != kind {
                    self.err(&at(key), format!("plugin `{value}` is pinned as a {pk}, not a {kind}"), None);
                }
            }
            if config.1.is_some() && plugin.is_none() {
                self.err(
                    &at(config.0),
                    format!("`{}` configures a plugin, and `{value}` is built in", config.0),
                    Some("built-in strategies take no configuration".into()),
                );
            }
        }
    }
}

/// A plain name: names become parts of paths (the suite's result file,
/// entry ids in checkpoint and trace folders), so only ASCII letters,
/// digits, `-`, `_` and `.`, and at most [`MAX_NAME_LEN`] of them.
fn valid_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_NAME_LEN && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

/// The hint of a name that is not plain.
const NAME_HINT: &str = "use letters, digits, '-', '_' and '.', at most 100 characters";

fn parse_hint(message: &str) -> Option<String> {
    if message.contains("unknown field") {
        Some("check the spelling; docs/suite-format.md lists every key".into())
    } else if message.contains("missing field") {
        Some("add the key; docs/suite-format.md says what it means".into())
    } else if message.contains("invalid type") {
        Some("check the value's type (strings need quotes; numbers do not)".into())
    } else if message.contains("unknown variant") {
        Some("use one of the values listed above".into())
    } else {
        None
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Parses suite text named `test.toml` (also for the plan's tests).
    pub(in crate::suite) fn parse(src: &str) -> Result<Suite, SuiteErrors> {
        Suite::parse(Path::new("test.toml"), src.to_owned())
    }

    /// A valid suite: one workload, two strategies, two repeats.
    pub(in crate::suite) const OK: &str = r#"
[suite]
name = "t"
repeats = 2

[[workload]]
name = "w"
model = { kind = "gpt", preset = "tiny" }
data = { kind = "synthetic", vocab = 64 }
batch = 4
seq_len = 16
steps = 10
optimizer = { kind = "adamw", lr = 1e-3 }

[[strategy]]
name = "a"
baseline = true

[[strategy]]
name = "b"
"#;

    #[test]
    fn fault_budgets_are_positive_and_only_bound_injected_failures() {
        // Issue 61: the budgets that end an entry failing without end.
        for (faults, says) in [
            ("{ at_steps = [3], max_restarts = 0 }", "`max_restarts` must be at least 1"),
            ("{ at_steps = [3], max_time_lost_ratio = 0.0 }", "`max_time_lost_ratio` must be a positive multiple"),
            ("{ mtbf_s = 5, max_time_lost_ratio = -1.0 }", "`max_time_lost_ratio` must be a positive multiple"),
            ("{ mtbf_s = 5, max_time_lost_ratio = nan }", "`max_time_lost_ratio` must be a positive multiple"),
            ("{ oom_above_batch = 8, max_restarts = 5 }", "`max_restarts` only bounds injected failures"),
            ("{ max_time_lost_ratio = 5.0 }", "`max_time_lost_ratio` only bounds injected failures"),
        ] {
            let e = parse(&OK.replace("steps = 10", &format!("steps = 10\nfaults = {faults}"))).expect_err(faults);
            assert_eq!(e.0.len(), 1, "{faults}: {e}");
            assert!(e.0[0].message.contains(says) && e.0[0].line_col().unwrap().0 == 13, "{faults}: {e}");
        }
        let s =
            parse(&OK.replace("steps = 10", "steps = 10\nfaults = { mtbf_s = 5, max_restarts = 7, max_time_lost_ratio = 2.5 }")).unwrap();
        let f = s.spec.workloads[0].faults.as_ref().unwrap();
        assert_eq!((f.max_restarts(), f.max_time_lost_ratio()), (7, 2.5));
        let f = FaultSpec::default();
        assert_eq!((f.max_restarts(), f.max_time_lost_ratio()), (1000, 10.0));
    }

    /// `[projection]`: clusters of the `harness project` shape, strategies
    /// of the suite; each mistake at its line.
    #[test]
    fn a_projection_section_names_clusters_and_the_suites_strategies() {
        let ok =
            format!("{OK}\n[projection]\nclusters = [\"1-128x8:net=100Gbps\", \"2x4:net=10Gbps\"]\nstrategies = [\"allreduce\", \"b\"]\n");
        let s = parse(&ok).unwrap();
        let p = s.spec.projection.as_ref().unwrap();
        assert_eq!(p.clusters.len(), 2);
        assert_eq!(p.strategies, ["allreduce", "b"]);
        assert!(parse(OK).unwrap().spec.projection.is_none());
        for (from, to, says) in [
            ("\"2x4:net=10Gbps\"", "\"2by4\"", "cluster `2by4` is not NODESxGPUS"),
            ("\"1-128x8:net=100Gbps\", \"2x4:net=10Gbps\"", "", "needs at least one cluster"),
            ("\"allreduce\", \"b\"", "\"c\"", "strategy `c` is not one of the suite's"),
        ] {
            let e = parse(&ok.replace(from, to)).expect_err(says);
            assert_eq!(e.0.len(), 1, "{e}");
            assert!(e.0[0].message.contains(says), "{e}");
            assert!(e.0[0].line_col().is_some_and(|(l, _)| l >= 23), "{e}");
        }
        assert!(parse(&format!("{OK}\n[projection]\nclusters = [\"1x8\"]\nnodes = 2\n")).is_err());
        let many = vec!["\"1x8\""; MAX_PROJECTION_CLUSTERS + 1].join(", ");
        let e = parse(&format!("{OK}\n[projection]\nclusters = [{many}]\n")).unwrap_err();
        assert!(e.0[0].message.contains("more than 64"), "{e}");
    }

    #[test]
    fn errors_point_at_line_and_column() {
        let bad = OK.replace("batch = 4", "batch = 0");
        let e = parse(&bad).unwrap_err();
        assert_eq!(e.0.len(), 1);
        assert_eq!(e.0[0].line_col(), Some((10, 9)));
    }

    #[test]
    fn what_a_terminal_would_act_on_is_shown_not_sent() {
        // A suite may spell escape sequences in its strings and keys, and
        // put raw control or bidirectional characters in its text; its
        // errors quote the former and show lines holding the latter.
        let sent = |text: &str| -> Vec<char> { text.chars().filter(|&c| crate::fmt::unseen(c) && c != '\n').collect() };
        for (quoted, says) in [
            (OK.replace("name = \"w\"", "name = \"w\\u001b]0;title\\u0007\""), r"workload name `w\u{1b}]0;title\u{7}` is not a plain name"),
            (OK.replace("steps = 10", "steps = 10\n\"k\\u001b[2J\" = 1"), r"unknown field `k\u{1b}[2J`"),
        ] {
            let text = parse(&quoted).unwrap_err().to_string();
            assert!(sent(&text).is_empty(), "{:?} in {text}", sent(&text));
            assert!(text.contains(says), "{text}");
        }
        // Raw characters: TOML refuses control characters, not the
        // bidirectional ones; either way the excerpt shows U+FFFD, and its
        // caret stays under the character the message is about.
        for (raw, at) in [("batch = 0 # \u{202e} x \u{2066}", "batch = 0"), ("batch = 4 # \u{1b}[31m red \u{9b}", "\u{fffd}[31m")] {
            let e = parse(&OK.replace("batch = 4", raw)).unwrap_err();
            let text = e.to_string();
            assert!(sent(&text).is_empty(), "{:?} in {text}", sent(&text));
            let (_, col) = e.0[0].line_col().unwrap();
            let line = text.lines().find(|l| l.contains(at)).unwrap_or_else(|| panic!("{text}"));
            let caret = text.lines().skip_while(|l| *l != line).nth(1).unwrap();
            let start = line.find("batch").unwrap();
            assert_eq!(caret[start..].chars().position(|c| c == '^'), Some(col - 1), "{text}");
        }
        // A description is text for people: tabs and line breaks, nothing
        // a terminal acts on (the report shows it; bundles carry it).
        let described = |d: &str| OK.replace("repeats = 2", &format!("repeats = 2\ndescription = \"{d}\""));
        assert!(parse(&described(r"two lines\n\tand a tab, ünïcode")).is_ok());
        for d in [r"\u001b]0;title\u0007", r"right \u202e to left"] {
            let text = parse(&described(d)).unwrap_err().to_string();
            assert!(sent(&text).is_empty(), "{:?} in {text}", sent(&text));
            assert!(text.contains("test.toml:5:15: the description holds"), "{text}");
        }
    }

    #[test]
    fn nccl_settings_and_topologies_are_checked_where_written() {
        let two_ranks = OK.replace("repeats = 2", "repeats = 2\nworld_size = 4");
        let good = two_ranks.replace(
            "name = \"b\"",
            "name = \"b\"\nnccl = { NCCL_ALGO = \"Ring\", NCCL_MAX_NCHANNELS = 4 }\nnccl_transport = \"network\"\nlink = { gbps = 10, nodes = 2 }",
        );
        let s = parse(&good).unwrap();
        let env = s.spec.strategies[1].nccl_env();
        assert_eq!(env["NCCL_ALGO"], "Ring");
        assert_eq!(env["NCCL_MAX_NCHANNELS"], "4");
        assert_eq!(env["NCCL_P2P_DISABLE"], "1");
        for (bad, says) in [
            ("nccl = { ALGO = \"Ring\" }", "`ALGO` is not an NCCL setting"),
            ("nccl = { NCCL_DEBUG = \"WARN\" }", "`NCCL_DEBUG` is set by harness"),
            ("nccl = { NCCL_ALGO = [1] }", "must be a string, an integer or a boolean"),
            ("nccl = { \"NCCL_ALGO\\u001b[2J\" = \"Ring\" }", "`NCCL_ALGO\u{1b}[2J` is not an NCCL setting"),
            ("nccl = { NCCL_ = 1 }", "`NCCL_` is not an NCCL setting"),
            (
                "nccl = { NCCL_ALGO = \"Ring\\u001b]0;t\\u0007\" }",
                r#"`NCCL_ALGO` = "Ring\u{1b}]0;t\u{7}" holds a character other than printable ASCII"#,
            ),
            ("nccl_transport = \"ib\"", "unknown variant `ib`"),
            ("link = { gbps = 10, nodes = 3 }", "`nodes = 3` does not split world_size = 4"),
            ("link = { gbps = 10, nodes = 1 }", "`nodes = 1` does not split"),
        ] {
            let e = parse(&two_ranks.replace("name = \"b\"", &format!("name = \"b\"\n{bad}"))).unwrap_err();
            assert!(e.0[0].message.contains(says), "{bad}: {e}");
            assert_eq!(e.0[0].line_col().unwrap().0, 22, "{bad}: {e}");
        }
    }

    #[test]
    fn a_bf16_reduction_is_for_the_built_in_all_reduce_alone() {
        let two_ranks = OK.replace("repeats = 2", "repeats = 2\nworld_size = 2");
        let s = parse(&two_ranks.replace("name = \"b\"", "name = \"b\"\nreduce_dtype = \"bf16\"")).unwrap();
        assert_eq!(s.spec.strategies[1].reduce_dtype, crate::suite::ReduceDtype::Bf16);
        assert_eq!(s.spec.strategies[0].reduce_dtype, crate::suite::ReduceDtype::Fp32);
        for (bad, says) in [
            ("zero = 1", "ZeRO reduce-scatters them in their own type"),
            ("link = { gbps = 10 }", "an emulated link reduces after the backward pass"),
            ("compressor = \"none\"", "compressor `none` reduces the gradients itself"),
        ] {
            let text = two_ranks.replace("name = \"b\"", &format!("name = \"b\"\nreduce_dtype = \"bf16\"\n{bad}"));
            let e = parse(&text).unwrap_err();
            assert!(e.0.iter().any(|e| e.message.contains(says)), "{bad}: {e}");
        }
        let e = parse(&two_ranks.replace("name = \"b\"", "name = \"b\"\nreduce_dtype = \"fp8\"")).unwrap_err();
        assert!(e.0[0].message.contains("unknown variant `fp8`"), "{e}");
    }

    #[test]
    fn cudnn_autotuning_is_off_unless_a_workload_turns_it_on() {
        let off = parse(OK).unwrap();
        assert!(!off.spec.workloads[0].cudnn_benchmark);
        let on = parse(&OK.replace("steps = 10", "steps = 10\ncudnn_benchmark = true")).unwrap();
        assert!(on.spec.workloads[0].cudnn_benchmark);
        let e = parse(&OK.replace("steps = 10", "steps = 10\ncudnn_benchmark = \"yes\"")).unwrap_err();
        assert!(e.to_string().contains("invalid type"), "{e}");
    }

    #[test]
    fn cuda_graphs_are_off_unless_a_workload_turns_them_on() {
        let off = parse(OK).unwrap();
        assert!(!off.spec.workloads[0].cuda_graph);
        let on = parse(&OK.replace("steps = 10", "steps = 10\ncuda_graph = true")).unwrap();
        assert!(on.spec.workloads[0].cuda_graph);
        let e = parse(&OK.replace("steps = 10", "steps = 10\ncuda_graph = \"auto\"")).unwrap_err();
        assert!(e.to_string().contains("invalid type"), "{e}");
    }

    #[test]
    fn stop_at_target_needs_a_target_and_evaluations() {
        let stop = OK.replace("steps = 10", "steps = 10\nstop_at_target = true");
        let e = parse(&stop).unwrap_err();
        let all = e.to_string();
        assert!(all.contains("`stop_at_target` needs a target"), "{all}");
        assert!(all.contains("`stop_at_target` needs evaluations during training"), "{all}");
        assert_eq!(e.0[0].line_col().unwrap().0, 13);
        parse(&stop.replace("steps = 10", "steps = 10\ntarget_above_floor = 0.2\neval_every_tokens = 256")).unwrap();
        parse(&stop.replace("steps = 10", "steps = 10\ntarget_loss = 3.0\neval_every = 2")).unwrap();
        for (bad, says) in
            [("eval_every_tokens = 0", "`eval_every_tokens` must be at least 1"), ("eval_every_tokens = 64\neval_every = 2", "not both")]
        {
            let e = parse(&OK.replace("steps = 10", &format!("steps = 10\n{bad}"))).unwrap_err();
            assert!(e.0[0].message.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn vision_workloads_need_images_one_image_per_sample_and_a_resnet_depth_or_vit_patches() {
        let vision = OK
            .replace(r#"model = { kind = "gpt", preset = "tiny" }"#, r#"model = { kind = "vision", preset = "tiny" }"#)
            .replace(r#"data = { kind = "synthetic", vocab = 64 }"#, r#"data = { kind = "images" }"#)
            .replace("seq_len = 16", "seq_len = 1");
        parse(&vision).unwrap();
        parse(&vision.replace(
            "steps = 10",
            "steps = 10
target_accuracy = 0.8
stop_at_target = true
eval_every = 5",
        ))
        .unwrap();
        parse(&vision.replace(r#"preset = "tiny""#, r#"preset = "vit-tiny""#)).unwrap();
        parse(&vision.replace(r#"preset = "tiny""#, "n_layer = 50, d_model = 16")).unwrap();
        for (from, to, says) in [
            ("seq_len = 1", "seq_len = 4", "`seq_len` must be 1"),
            (r#"data = { kind = "images" }"#, r#"data = { kind = "synthetic", vocab = 64 }"#, "trains on `kind = \"images\"` data"),
            (r#"preset = "tiny""#, r#"preset = "tiny", n_layer = 12"#, "no ResNet of depth 12"),
            (r#"preset = "tiny""#, r#"preset = "tiny", n_head = 2"#, "a ResNet has no `n_head`"),
            (r#"data = { kind = "images" }"#, r#"data = { kind = "images", label_noise = 0.9 }"#, "`label_noise` must lie in [0, 0.9000)"),
            (r#"data = { kind = "images" }"#, r#"data = { kind = "images", image_size = 8, padding = 8 }"#, "`padding` must be smaller"),
            (r#"data = { kind = "images" }"#, r#"data = { kind = "images", threads = 0 }"#, "`threads` must be at least 1"),
            (
                r#"data = { kind = "images" }"#,
                r#"data = { kind = "images", threads = 2, pipeline = "device" }"#,
                "`pipeline = \"device\"` makes them on the device",
            ),
            (r#"data = { kind = "images" }"#, r#"data = { kind = "images", pipeline = "gpu" }"#, "unknown variant `gpu`"),
            (
                "steps = 10",
                "steps = 10
target_accuracy = 1.5",
                "`target_accuracy` is a top-1 accuracy",
            ),
            (
                "steps = 10",
                "steps = 10
target_accuracy = 0.5
target_loss = 1.0",
                "not both",
            ),
            (
                "steps = 10",
                "steps = 10
recompute = \"all\"",
                "does not recompute",
            ),
        ] {
            let e = parse(&vision.replace(from, to)).unwrap_err();
            assert!(e.to_string().contains(says), "{to}: {e}");
        }
        // A ViT cuts the image into whole patches.
        let e = parse(
            &vision
                .replace(r#"preset = "tiny""#, r#"preset = "vit-tiny""#)
                .replace(r#"{ kind = "images" }"#, r#"{ kind = "images", image_size = 30 }"#),
        )
        .unwrap_err();
        assert!(e.to_string().contains("a multiple of 4"), "{e}");
        // Accuracy targets are for classifiers; images for the vision model.
        let e = parse(&OK.replace(
            "steps = 10",
            "steps = 10
target_accuracy = 0.9",
        ))
        .unwrap_err();
        assert!(e.to_string().contains("only classification workloads"), "{e}");
        let e = parse(&OK.replace(r#"data = { kind = "synthetic", vocab = 64 }"#, r#"data = { kind = "images" }"#)).unwrap_err();
        assert!(e.to_string().contains("image data needs `model.kind = \"vision\"`"), "{e}");
    }

    #[test]
    fn unknown_key_is_an_error_with_location() {
        let bad = OK.replace("seq_len = 16", "seq_len = 16\nsteps_ = 3");
        let e = parse(&bad).unwrap_err();
        assert!(e.0[0].message.contains("unknown field `steps_`"), "{}", e);
        assert_eq!(e.0[0].line_col().unwrap().0, 12);
    }
}
