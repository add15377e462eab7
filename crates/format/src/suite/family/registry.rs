//! The registry: every model family, and the one of a `ModelKind`.

use super::encoder::Encoder;
use super::gpt::Gpt;
use super::mlp::Mlp;
use super::t5::T5;
use super::vision::Vision;
use super::Family;
use crate::suite::spec::ModelKind;

/// Every model family, in the order of [`ModelKind`]'s variants.
pub const FAMILIES: &[&dyn Family] = &[&Gpt, &Encoder, &Mlp, &Vision, &T5];

/// The family of `kind`. The match is exhaustive: a `ModelKind` variant
/// without a family does not compile.
pub fn of(kind: ModelKind) -> &'static dyn Family {
    match kind {
        ModelKind::Gpt => &Gpt,
        ModelKind::Encoder => &Encoder,
        ModelKind::Mlp => &Mlp,
        ModelKind::Vision => &Vision,
        ModelKind::T5 => &T5,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::de::IntoDeserializer;
    use serde::Deserialize;

    /// Every `model.kind` name, as serde lists `ModelKind`'s variants in
    /// the error for an unknown one ("expected one of `gpt`, ...").
    fn kind_names() -> Vec<String> {
        let err = ModelKind::deserialize(IntoDeserializer::<serde::de::value::Error>::into_deserializer("?")).unwrap_err().to_string();
        let list = err.split("expected one of").nth(1).unwrap_or_else(|| panic!("serde's message changed: {err}"));
        list.split('`').skip(1).step_by(2).map(String::from).collect()
    }

    fn kind(name: &str) -> ModelKind {
        ModelKind::deserialize(IntoDeserializer::<serde::de::value::Error>::into_deserializer(name)).unwrap()
    }

    #[test]
    fn every_model_kind_has_one_family_under_its_name() {
        let names = kind_names();
        assert!(names.len() >= 5, "{names:?}");
        assert_eq!(FAMILIES.len(), names.len(), "FAMILIES lists {} families for the kinds {names:?}", FAMILIES.len());
        for name in &names {
            let k = kind(name);
            assert_eq!(of(k).kind(), k, "{name}");
            assert_eq!(of(k).name(), name, "the family of `{name}` is named {}", of(k).name());
            assert_eq!(FAMILIES.iter().filter(|f| f.kind() == k).count(), 1, "FAMILIES has no single entry for `{name}`");
            assert!(!of(k).presets().is_empty(), "`{name}` has no presets");
            assert!(!of(k).data().kinds.is_empty(), "`{name}` trains on no data");
        }
    }

    #[test]
    fn every_data_kind_is_some_familys_and_misfits_have_a_message() {
        use super::super::DataKind;
        for data in [DataKind::Synthetic, DataKind::Bin, DataKind::Regression, DataKind::Images, DataKind::Pairs] {
            let owners: Vec<_> = FAMILIES.iter().filter(|f| f.data().kinds.contains(&data)).collect();
            assert!(!owners.is_empty(), "no family trains on {data:?}");
            // Data of one family only has a message for the others.
            assert_eq!(owners.len() == 1, owners[0].data().claimed.is_some(), "{data:?}");
        }
    }

    /// The recipes of docs/architecture.md's "How to add ..." section, as
    /// (heading, text) pairs.
    fn recipes(docs: &str) -> Vec<(&str, &str)> {
        let section = docs.split("\n## How to add ...\n").nth(1).expect("docs/architecture.md has a \"How to add ...\" section");
        let section = section.split("\n## ").next().unwrap();
        section.split("\n### ").skip(1).map(|r| r.split_once('\n').unwrap_or((r, ""))).collect()
    }

    /// The folders a backticked path the recipes name starts with.
    const CHECKED: [&str; 9] = ["crates/", "sdk/", "host/", "tests/", "docs/", "plugins/", "scripts/", "bench/", "suites/"];

    /// What `path` in the recipe under `heading` stands for: `<kind>` is
    /// each family's name in the model-family recipe, each plugin kind's
    /// name in the strategy-kind one; any other placeholder cuts the path
    /// to the folder that holds it.
    fn expand(heading: &str, path: &str) -> Vec<String> {
        let names: Vec<&str> = match heading {
            "a model family" => FAMILIES.iter().map(|f| f.name()).collect(),
            "a strategy kind" => crate::plugin::Kind::ALL.iter().map(|k| k.name()).collect(),
            _ => Vec::new(),
        };
        let paths = if names.is_empty() { vec![path.to_owned()] } else { names.iter().map(|n| path.replace("<kind>", n)).collect() };
        paths
            .into_iter()
            .map(|p| match p.find('<') {
                Some(i) => p[..p[..i].rfind('/').map_or(0, |j| j + 1)].to_owned(),
                None => p,
            })
            .collect()
    }

    /// Every backticked path of docs/architecture.md's "How to add ..."
    /// recipes exists, `<kind>` read as every family's name (model family)
    /// and every plugin kind's (strategy kind): a new family or kind that
    /// misses a file its recipe names, or a recipe that names a file that
    /// moved, fails here.
    #[test]
    fn every_how_to_add_recipe_names_paths_that_exist() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let docs = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
        let recipes = recipes(&docs);
        let headings: Vec<&str> = recipes.iter().map(|r| r.0).collect();
        for want in ["a model family", "a strategy kind", "a fault type", "a metric"] {
            assert!(headings.contains(&want), "docs/architecture.md has no recipe for {want}: {headings:?}");
        }
        let mut missing = Vec::new();
        for (heading, text) in &recipes {
            let paths: Vec<&str> = text.split('`').skip(1).step_by(2).filter(|s| CHECKED.iter().any(|d| s.starts_with(d))).collect();
            assert!(!paths.is_empty(), "the recipe for {heading} names no path");
            if ["a model family", "a strategy kind"].contains(heading) {
                assert!(paths.iter().any(|p| p.contains("<kind>")), "the recipe for {heading} names no file per kind: {paths:?}");
            }
            for path in paths {
                for p in expand(heading, path) {
                    let line = format!("{heading}: {p}");
                    if !root.join(&p).exists() && !missing.contains(&line) {
                        missing.push(line);
                    }
                }
            }
        }
        assert!(missing.is_empty(), "docs/architecture.md's recipes name paths that do not exist:\n{}", missing.join("\n"));
    }
}
