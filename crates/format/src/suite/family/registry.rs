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

    /// The backticked paths of docs/architecture.md's recipe for a model
    /// family, `<kind>` replaced by each family's name, exist: a new
    /// family that misses a file the recipe names fails here.
    #[test]
    fn the_model_family_recipe_names_files_that_exist_for_every_family() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let docs = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
        let recipe = docs.split("### a model family").nth(1).expect("docs/architecture.md has a model-family recipe");
        let recipe = recipe.split("\n### ").next().unwrap();
        let paths: Vec<&str> =
            recipe.split('`').skip(1).step_by(2).filter(|s| ["crates/", "tests/", "docs/"].iter().any(|d| s.starts_with(d))).collect();
        assert!(paths.iter().any(|p| p.contains("<kind>")), "the recipe names no file per family: {paths:?}");
        for path in paths {
            for f in FAMILIES {
                let p = path.replace("<kind>", f.name());
                assert!(root.join(&p).exists(), "docs/architecture.md's model-family recipe names {p}, which does not exist");
            }
        }
    }
}
