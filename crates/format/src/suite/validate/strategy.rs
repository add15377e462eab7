//! The checks of the `[[plugin]]`s, the `[[strategy]]`s and the
//! `[[track]]`s, and of what a strategy names.

use std::collections::BTreeSet;

use super::{valid_name, Checker, Seg, NAME_HINT};
use crate::suite::spec::{PluginSpec, Strategy, SuiteSpec, BATCH_POLICIES, CHECKPOINT_POLICIES, COMPRESSORS, NCCL_RESERVED, TRACK_KINDS};
use Seg::{Index, Key};

impl Checker<'_> {
    /// Every `[[plugin]]`.
    pub(super) fn plugins(&mut self, plugins: &[PluginSpec]) {
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
    pub(super) fn strategies(&mut self, s: &SuiteSpec, names: &BTreeSet<&str>) {
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
    pub(super) fn tracks(&mut self, s: &SuiteSpec, names: &BTreeSet<&str>) {
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
