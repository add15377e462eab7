//! Standard suites: the versions this harness releases (their exact text is
//! compiled in, so a result can be checked against them), selecting a
//! suite's tracks, and entering a submission's plugin into them
//! (`harness run SUITE --plugin KIND=PATH [--track NAME]`).
//!
//! docs/rules.md says what a submission may change and what makes a run
//! official.

use std::collections::BTreeSet;
use std::path::PathBuf;

use super::spec::{PluginSpec, Strategy, Track};
use super::validate::Suite;
use crate::plugin::Kind;

/// A standard suite as released: its file in the repository and its text.
pub struct Released {
    pub file: &'static str,
    pub text: &'static str,
}

/// The standard suites this build releases, current versions first, then
/// earlier versions kept under suites/standard/VERSION/ so that their
/// submissions still verify. A result is official only if its suite text
/// is byte-identical to one of them.
pub const RELEASED: &[Released] = &[
    Released { file: "suites/cpu-standard.toml", text: include_str!("../../../../suites/cpu-standard.toml") },
    Released { file: "suites/a100.toml", text: include_str!("../../../../suites/a100.toml") },
    Released { file: "suites/h100.toml", text: include_str!("../../../../suites/h100.toml") },
    Released { file: "suites/h200.toml", text: include_str!("../../../../suites/h200.toml") },
    Released { file: "suites/standard/1.1/cpu-standard.toml", text: include_str!("../../../../suites/standard/1.1/cpu-standard.toml") },
    Released { file: "suites/standard/1.1/a100.toml", text: include_str!("../../../../suites/standard/1.1/a100.toml") },
    Released { file: "suites/standard/1.1/h100.toml", text: include_str!("../../../../suites/standard/1.1/h100.toml") },
    Released { file: "suites/standard/1.1/h200.toml", text: include_str!("../../../../suites/standard/1.1/h200.toml") },
    Released { file: "suites/standard/1.0/cpu-standard.toml", text: include_str!("../../../../suites/standard/1.0/cpu-standard.toml") },
    Released { file: "suites/standard/1.0/a100.toml", text: include_str!("../../../../suites/standard/1.0/a100.toml") },
    Released { file: "suites/standard/1.0/h100.toml", text: include_str!("../../../../suites/standard/1.0/h100.toml") },
    Released { file: "suites/standard/1.0/h200.toml", text: include_str!("../../../../suites/standard/1.0/h200.toml") },
];

/// The released standard suite whose text is exactly `text`.
pub fn released(text: &str) -> Option<&'static Released> {
    RELEASED.iter().find(|r| r.text == text)
}

/// The strategy slot a plugin kind fills.
fn set_slot(st: &mut Strategy, kind: Kind, plugin: &str, config: Option<toml::Table>) {
    match kind {
        Kind::Compressor => (st.compressor, st.compressor_config) = (plugin.to_owned(), config),
        Kind::BatchPolicy => (st.batch_policy, st.batch_policy_config) = (plugin.to_owned(), config),
        Kind::CheckpointPolicy => (st.checkpoint, st.checkpoint_config) = (plugin.to_owned(), config),
    }
}

/// A plugin entered into a standard suite's tracks.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Its kind: "compressor", "batch-policy" or "checkpoint-policy".
    pub kind: String,
    /// The artifact (absolute, or relative to the caller).
    pub path: PathBuf,
    /// `--plugin-config` keys.
    pub config: Option<toml::Table>,
}

/// The name of the `[[plugin]]` an entered plugin gets.
pub const ENTERED_PLUGIN: &str = "submission";

impl Suite {
    /// Keeps the tracks named by `track` (all when `None`) and only what
    /// they run: their workloads, and each of their strategies on the
    /// track's workloads, the track's baseline marked as such. `entry`, if
    /// any, runs in every kept track of its kind, as a copy of the track's
    /// baseline with the entered plugin in its kind's slot, named
    /// `submission-<track>`. Returns the kept tracks and the submission's
    /// strategies. A suite without tracks is left alone, and takes no entry.
    pub fn select(&mut self, track: Option<&str>, entry: Option<&Entry>) -> Result<(Vec<String>, Vec<String>), String> {
        let gpus = self.spec.suite.world_size;
        let spec = &mut self.spec;
        if spec.tracks.is_empty() {
            return match (track, entry) {
                (None, None) => Ok((Vec::new(), Vec::new())),
                _ => Err(format!(
                    "{} has no tracks, so --track and --plugin do not apply\nhint: enter a plugin into a standard suite (suites/cpu-standard.toml, suites/h200.toml, ...), or name it in a [[plugin]] table of your own suite",
                    self.path.display()
                )),
            };
        }
        let kept: Vec<Track> = match track {
            Some(name) => {
                let t = spec.tracks.iter().find(|t| t.name == name).cloned().ok_or_else(|| {
                    format!("{} has no track `{name}`\nhint: its tracks are {}", self.path.display(), track_names(&spec.tracks))
                })?;
                if t.min_gpus > gpus {
                    return Err(format!(
                        "track `{name}` needs at least {} GPUs (ranks), and this run has {gpus}\nhint: pass --gpus {}",
                        t.min_gpus, t.min_gpus
                    ));
                }
                vec![t]
            }
            // Tracks that need more GPUs than the run has are left out.
            None => spec.tracks.iter().filter(|t| t.min_gpus <= gpus).cloned().collect(),
        };
        let mut submissions = Vec::new();
        if let Some(e) = entry {
            let of_kind: Vec<&Track> = kept.iter().filter(|t| t.kind == e.kind).collect();
            if of_kind.is_empty() {
                // Tracks of its kind that this run has too few GPUs for: say
                // how many they need, not that no track takes the plugin.
                let fewer: Vec<&Track> = spec.tracks.iter().filter(|t| t.kind == e.kind && t.min_gpus > gpus).collect();
                if let Some(need) = fewer.iter().map(|t| t.min_gpus).min().filter(|_| track.is_none()) {
                    let names: Vec<String> = fewer.iter().map(|t| format!("`{}`", t.name)).collect();
                    return Err(format!(
                        "the {} tracks ({}) need {need} GPUs (ranks) or more, and this run has {gpus}\nhint: pass --gpus {need}",
                        e.kind,
                        names.join(", ")
                    ));
                }
                let have: Vec<String> = kept.iter().map(|t| format!("`{}` takes {} plugins", t.name, t.kind)).collect();
                return Err(format!("the plugin is a {}, and no track selected here takes one ({})", e.kind, have.join("; ")));
            }
            spec.plugins.push(PluginSpec {
                name: ENTERED_PLUGIN.into(),
                path: e.path.clone(),
                sha256: None,
                version: None,
                kind: Some(e.kind.clone()),
                ..default_plugin_limits()
            });
            for t in of_kind {
                let base = spec
                    .strategies
                    .iter()
                    .find(|s| s.name == t.baseline)
                    .cloned()
                    .ok_or_else(|| format!("track `{}` names no baseline", t.name))?;
                let mut st = Strategy { name: format!("submission-{}", t.name), baseline: false, ..base };
                let kind = Kind::from_name(&e.kind).ok_or_else(|| format!("`{}` is not a plugin kind", e.kind))?;
                set_slot(&mut st, kind, ENTERED_PLUGIN, e.config.clone());
                submissions.push((t.name.clone(), st));
            }
        }
        // Each strategy runs on the workloads of the kept tracks that list it.
        let mut strategies = Vec::new();
        for st in &spec.strategies {
            let tracks: Vec<&Track> = kept.iter().filter(|t| t.baseline == st.name || t.strategies.contains(&st.name)).collect();
            if tracks.is_empty() {
                continue;
            }
            let mut st = st.clone();
            st.workloads = Some(tracks.iter().flat_map(|t| t.workloads.iter().cloned()).collect());
            st.baseline = tracks.iter().any(|t| t.baseline == st.name);
            strategies.push(st);
        }
        let mut names = Vec::new();
        for (track, mut st) in submissions {
            st.workloads = kept.iter().find(|t| t.name == track).map(|t| t.workloads.clone());
            names.push(st.name.clone());
            strategies.push(st);
        }
        let used: BTreeSet<String> = kept.iter().flat_map(|t| t.workloads.iter().cloned()).collect();
        spec.workloads.retain(|w| used.contains(&w.name));
        spec.strategies = strategies;
        spec.tracks = kept.clone();
        Ok((kept.into_iter().map(|t| t.name).collect(), names))
    }
}

fn track_names(tracks: &[Track]) -> String {
    tracks.iter().map(|t| format!("`{}` ({})", t.name, t.kind)).collect::<Vec<_>>().join(", ")
}

/// A `[[plugin]]` table's defaults (memory, deadline and tensor caps).
fn default_plugin_limits() -> PluginSpec {
    toml::from_str("name = \"\"\npath = \"\"").expect("a plugin table of two keys parses")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn the_strategy_kinds_are_the_plugin_kinds_names() {
        let names: Vec<&str> = Kind::ALL.iter().map(|k| k.name()).collect();
        assert_eq!(names, crate::suite::TRACK_KINDS);
    }

    #[test]
    fn every_released_suite_validates_and_has_tracks_of_every_kind() {
        for r in RELEASED {
            let s = Suite::parse(Path::new(r.file), r.text.to_owned()).unwrap_or_else(|e| panic!("{}: {e}", r.file));
            s.validate().unwrap_or_else(|e| panic!("{}: {e}", r.file));
            assert!(s.spec.suite.version.is_some() && s.spec.suite.hardware.is_some(), "{}: no version or hardware", r.file);
            let kinds: BTreeSet<&str> = s.spec.tracks.iter().map(|t| t.kind.as_str()).collect();
            assert_eq!(kinds.len(), 3, "{}: tracks of kinds {kinds:?}", r.file);
            assert!(s.spec.suite.repeats >= 3, "{}: fewer than 3 repeats", r.file);
            assert!(released(r.text).is_some());
        }
    }

    /// The GPU standard suites are one definition rendered per hardware
    /// class: suites/standard/template.toml with the class's values from
    /// suites/standard/hardware.toml. `HARNESS_BLESS=1` rewrites them.
    #[test]
    fn gpu_standard_suites_are_rendered_from_one_definition() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let template = std::fs::read_to_string(root.join("suites/standard/template.toml")).unwrap();
        let hardware: toml::Table = std::fs::read_to_string(root.join("suites/standard/hardware.toml")).unwrap().parse().unwrap();
        for (class, values) in &hardware {
            let values = values.as_table().unwrap();
            let note = values["note"].as_str().unwrap();
            let mut text = template.replace("{{class}}", class).replace("{{CLASS}}", &class.to_uppercase()).replace("{{NOTE}}", note);
            for (k, v) in values {
                let v = v.as_str().map_or_else(|| v.to_string(), str::to_owned);
                text = text.replace(&format!("{{{{{k}}}}}"), &v);
            }
            assert!(!text.contains("{{"), "{class}: a placeholder is left: {text}");
            let file = root.join(format!("suites/{class}.toml"));
            if crate::switches::get().bless {
                std::fs::write(&file, &text).unwrap();
            }
            assert_eq!(
                std::fs::read_to_string(&file).unwrap(),
                text,
                "{} is not the rendering of the template (HARNESS_BLESS=1 rewrites it)",
                file.display()
            );
        }
    }

    #[test]
    fn an_entry_runs_in_the_tracks_of_its_kind_next_to_their_baselines() {
        let r = &RELEASED[0];
        let mut s = Suite::parse(Path::new(r.file), r.text.to_owned()).unwrap();
        let e = Entry { kind: "batch-policy".into(), path: "x.wasm".into(), config: None };
        let (tracks, subs) = s.select(None, Some(&e)).unwrap();
        assert_eq!(tracks.len(), s.spec.tracks.len());
        assert_eq!(subs, vec!["submission-batch-size".to_owned()]);
        let sub = s.spec.strategies.iter().find(|st| st.name == subs[0]).unwrap();
        assert_eq!(sub.batch_policy, ENTERED_PLUGIN);
        let t = s.spec.tracks.iter().find(|t| t.name == "batch-size").unwrap();
        assert_eq!(sub.workloads.as_ref(), Some(&t.workloads));
        s.validate().unwrap();
        // The wrong kind for the named track is refused before anything runs.
        let mut s = Suite::parse(Path::new(r.file), r.text.to_owned()).unwrap();
        let err = s.select(Some("checkpointing"), Some(&e)).unwrap_err();
        assert!(err.contains("the plugin is a batch-policy"), "{err}");
    }

    /// Issue 63: a compressor entered in a GPU suite without `--gpus` (one
    /// GPU) was told that no track takes one; the compression tracks need
    /// two GPUs, and the error says so.
    #[test]
    fn a_compressor_on_one_gpu_is_told_how_many_gpus_the_compression_tracks_need() {
        let r = RELEASED.iter().find(|r| r.file.ends_with("h200.toml")).expect("the H200 suite is released");
        let mut s = Suite::parse(Path::new(r.file), r.text.to_owned()).unwrap();
        assert_eq!(s.spec.suite.world_size, 1);
        let e = Entry { kind: "compressor".into(), path: "x.wasm".into(), config: None };
        let err = s.select(None, Some(&e)).unwrap_err();
        assert!(err.starts_with("the compressor tracks (`compression`, `compression-10gbps`, `compression-25gbps`) need 2 GPUs (ranks) or more, and this run has 1"), "{err}");
        assert!(err.ends_with("hint: pass --gpus 2"), "{err}");
    }
}
