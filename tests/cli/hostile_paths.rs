//! Hostile inputs: planted symlinks at output paths, and text that plugins
//! and file names choose reaching the terminal.

use std::os::unix::fs::symlink;
use std::process::Output;

use crate::*;

/// Stdout and stderr together, as the terminal shows them.
fn shown(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Issue 61: a symlink at `<out>.log` made `harness run` append its log to
/// the link's target.
#[test]
fn a_link_planted_at_the_runs_log_is_refused_by_name_and_its_target_untouched() {
    let dir = tempfile::tempdir().unwrap();
    // A run that would finish in seconds, so that without the refusal the
    // log would reach the target.
    let s = write(dir.path(), "s.toml", &suite("links", "", &tiny_gpt("w", 3, "")));
    let target = write(dir.path(), "profile", "mine\n");
    let log = dir.path().join("r.log");
    symlink(&target, &log).unwrap();
    let out = harness(dir.path()).args(["run", "-q"]).arg(&s).args(["--out", "r.json"]).output().unwrap();
    let said = shown(&out);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("r.log is a symbolic link") && said.contains("remove the link"), "{said}");
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "mine\n");
    assert!(!dir.path().join("r.json").exists(), "the run went on: {said}");
}

/// Issue 61: `harness keygen KEY` wrote KEY.pub through a dangling link.
#[test]
fn keygen_refuses_a_dangling_link_at_the_public_key_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("planted");
    symlink(&target, dir.path().join("op.key.pub")).unwrap();
    let out = harness(dir.path()).args(["keygen", "op.key"]).output().unwrap();
    let said = shown(&out);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("op.key.pub is a symbolic link") && said.contains("remove the link"), "{said}");
    assert!(!target.exists(), "the public key was written through the link");
    assert!(!dir.path().join("op.key").exists(), "a secret key without its public key was left behind");
    // Without the link, the pair is made.
    std::fs::remove_file(dir.path().join("op.key.pub")).unwrap();
    run_ok(harness(dir.path()).args(["keygen", "op.key"]));
    assert!(dir.path().join("op.key").is_file() && dir.path().join("op.key.pub").is_file());
}

/// Issue 61: `harness plugin inspect` printed the NAME and VERSION a
/// plugin chose raw (7 ESC, 3 BEL, 2 U+202E reached the terminal).
#[test]
fn plugin_inspect_shows_a_hostile_name_and_version_escaped() {
    let dir = tempfile::tempdir().unwrap();
    run_ok(harness(dir.path()).args(["plugin", "new", "compressor", "evil", "--lang", "c"]));
    let folder = dir.path().join("evil");
    let source = std::fs::read_to_string(folder.join("plugin.c")).unwrap();
    let hostile = source
        .replace(r#"#define NAME "evil""#, r#"#define NAME "evil\x1b]0;owned\x07\xe2\x80\xae\x1b[2J""#)
        .replace(r#"#define VERSION "0.1.0""#, r#"#define VERSION "0.1.0\r\x1b[1A\x07\xe2\x80\xae""#);
    assert_ne!(hostile, source, "the template's NAME and VERSION lines moved");
    std::fs::write(folder.join("plugin.c"), hostile).unwrap();
    let make = std::process::Command::new("make").current_dir(&folder).output().expect("make is installed");
    assert!(make.status.success(), "{}", String::from_utf8_lossy(&make.stderr));
    let out = run_ok(harness(&folder).args(["plugin", "inspect"]).arg(folder.join("libevil.so")));
    let said = shown(&out);
    assert!(!said.contains(['\u{1b}', '\u{7}', '\u{202e}', '\r']), "{said:?}");
    // What the artifact said, as TOML escapes that read back as it.
    assert!(said.contains(r#"name = "evil\u001B]0;owned\u0007\u202E\u001B[2J""#), "{said}");
    assert!(said.contains(r#"version = "0.1.0\u000D\u001B[1A\u0007\u202E""#), "{said}");
}

/// Issue 61: `fmt::printable` kept `\r`, so `harness verify` printed a
/// carriage return from a bundle folder's name.
#[test]
fn verify_shows_a_carriage_return_in_a_bundle_folders_name_escaped() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = dir.path().join("ok\rverified.bundle");
    std::fs::create_dir(&bundle).unwrap();
    let out = harness(dir.path()).arg("verify").arg(&bundle).output().unwrap();
    let said = shown(&out);
    assert_eq!(out.status.code(), Some(harness::cli::exit::NOT_VERIFIED), "{said}");
    assert!(!said.contains('\r'), "{said:?}");
    assert!(said.contains(r"ok\u{d}verified.bundle: NOT verified"), "{said}");
}
