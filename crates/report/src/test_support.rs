//! What the crate's tests share: copying a bundle folder to forge it, and
//! an inspector that stands in for the sandbox.

use std::path::{Path, PathBuf};

use harness_format::plugin::ArtifactFormat;
use sha2::{Digest, Sha256};

/// Copies the folder `from` (a bundle: files and subfolders) to `to`.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let dst = to.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

/// An inspector that loads nothing: it is handed a component's bytes only
/// (it fails the test otherwise) and says the component is the plugin the
/// bundle's result names, as the sandbox would for the real artifact.
pub fn inspect_as(name: &str, version: &str) -> impl Fn(&[u8]) -> anyhow::Result<harness_format::plugin::Manifest> {
    let (name, version) = (name.to_owned(), version.to_owned());
    move |bytes: &[u8]| {
        assert_eq!(ArtifactFormat::of(bytes), ArtifactFormat::Component, "verify handed the inspector something that is no component");
        Ok(harness_format::plugin::Manifest {
            name: name.clone(),
            version: version.clone(),
            kind: harness_format::plugin::Kind::Compressor,
            transport: harness_format::plugin::Transport::Wasm,
            abi: "0.1.1".into(),
            // Hashed here, not through `submission::sha256_hex`: the submission
            // module's tests use this one, and modules do not circle.
            sha256: hex::encode(Sha256::digest(bytes)),
            path: PathBuf::new(),
        })
    }
}
