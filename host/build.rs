//! Records the git revision the binary is built from (HARNESS_GIT_REVISION,
//! in every result's machine fingerprint). The libtorch shim is built by
//! harness-kernels' build script (crates/kernels/build.rs).
use std::process::Command;

fn main() {
    git_revision();
}

/// Records the git revision (with `-dirty` for uncommitted changes) as
/// HARNESS_GIT_REVISION, for the machine fingerprint of every result. The
/// script runs again when a commit is made or checked out and when any of
/// the crate's sources, or those of the workspace crates it builds on
/// (`crates/`), changes, so that a binary built from edited sources says
/// `-dirty` (it did not, when only the commit was watched).
fn git_revision() {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    let rev = match git(&["rev-parse", "HEAD"]) {
        Some(rev) => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{rev}-dirty")
            } else {
                rev
            }
        }
        None => "unknown".into(),
    };
    println!("cargo:rustc-env=HARNESS_GIT_REVISION={rev}");
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=../crates");
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        println!("cargo:rerun-if-changed={dir}/HEAD");
        println!("cargo:rerun-if-changed={dir}/index");
    }
}
