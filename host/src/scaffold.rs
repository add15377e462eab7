//! `harness plugin new` and `harness plugin inspect`: a plugin crate that
//! builds and runs as generated, and the manifest of an artifact.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use harness_format::plugin::Kind;
use harness_sandbox::plugin::{Manifest, Transport};

struct Template {
    cargo: &'static str,
    lib: &'static str,
    readme: &'static str,
}

fn template(kind: &str) -> Result<Template> {
    Ok(match kind {
        "compressor" => Template {
            cargo: include_str!("../../sdk/templates/compressor/Cargo.toml.tmpl"),
            lib: include_str!("../../sdk/templates/compressor/src/lib.rs.tmpl"),
            readme: include_str!("../../sdk/templates/compressor/README.md.tmpl"),
        },
        "batch-policy" => Template {
            cargo: include_str!("../../sdk/templates/batch-policy/Cargo.toml.tmpl"),
            lib: include_str!("../../sdk/templates/batch-policy/src/lib.rs.tmpl"),
            readme: include_str!("../../sdk/templates/batch-policy/README.md.tmpl"),
        },
        "checkpoint-policy" => Template {
            cargo: include_str!("../../sdk/templates/checkpoint-policy/Cargo.toml.tmpl"),
            lib: include_str!("../../sdk/templates/checkpoint-policy/src/lib.rs.tmpl"),
            readme: include_str!("../../sdk/templates/checkpoint-policy/README.md.tmpl"),
        },
        other => bail!("unknown plugin kind `{other}` (compressor, batch-policy or checkpoint-policy)"),
    })
}

/// The SDK crate as `harness plugin new` vendors it into a Rust plugin's
/// folder (`harness-sdk/`): the plugin builds from its own folder, against
/// the SDK and contract of the harness that made it, with no path into a
/// harness checkout. (A test checks that every file of sdk/src is here.)
const SDK_FILES: [(&str, &str); 17] = [
    ("src/lib.rs", include_str!("../../sdk/src/lib.rs")),
    ("src/abi.rs", include_str!("../../sdk/src/abi.rs")),
    ("src/collective.rs", include_str!("../../sdk/src/collective.rs")),
    ("src/config.rs", include_str!("../../sdk/src/config.rs")),
    ("src/contract.rs", include_str!("../../sdk/src/contract.rs")),
    ("src/error.rs", include_str!("../../sdk/src/error.rs")),
    ("src/log.rs", include_str!("../../sdk/src/log.rs")),
    ("src/native.rs", include_str!("../../sdk/src/native.rs")),
    ("src/native_backend.rs", include_str!("../../sdk/src/native_backend.rs")),
    ("src/native_glue.rs", include_str!("../../sdk/src/native_glue.rs")),
    ("src/tensor.rs", include_str!("../../sdk/src/tensor.rs")),
    ("src/types.rs", include_str!("../../sdk/src/types.rs")),
    ("src/wasm.rs", include_str!("../../sdk/src/wasm.rs")),
    ("src/wasm_backend.rs", include_str!("../../sdk/src/wasm_backend.rs")),
    ("src/wasm_glue.rs", include_str!("../../sdk/src/wasm_glue.rs")),
    ("wit/strategy.wit", include_str!("../../sdk/wit/strategy.wit")),
    ("Cargo.toml", include_str!("../../sdk/Cargo.toml")),
];

/// Writes the SDK crate into `dir`, its manifest made standalone
/// ([`standalone_manifest`]).
fn vendor_sdk(dir: &Path) -> Result<()> {
    write_files(
        dir,
        SDK_FILES.iter().map(|&(file, text)| {
            let text = if file == "Cargo.toml" { standalone_manifest(text) } else { text.to_owned() };
            (file, text)
        }),
    )
}

/// The tables of the SDK's manifest that a vendored copy drops: `[lints]`
/// (`workspace = true`: the workspace's lints, and the plugin's folder is in
/// no workspace) and the dev-dependencies (the SDK's tests are not vendored).
/// A table of one of these names, a sub-table of it (`[lints.clippy]`) or a
/// target's (`[target.'cfg(..)'.dev-dependencies]`) goes whole.
const WORKSPACE_ONLY_TABLES: [&str; 2] = ["lints", "dev-dependencies"];

/// The SDK's manifest as a crate outside the workspace builds it: the values
/// it inherits from the workspace (`version.workspace = true`, ...) written
/// out, and the [`WORKSPACE_ONLY_TABLES`] left out.
fn standalone_manifest(text: &str) -> String {
    // rust-version first: "version.workspace" is part of it.
    let manifest = text
        .replace("rust-version.workspace = true", "rust-version = \"1.85\"")
        .replace("version.workspace = true", &format!("version = \"{}\"", env!("CARGO_PKG_VERSION")))
        .replace("edition.workspace = true", "edition = \"2021\"")
        .replace("license.workspace = true", "license = \"Apache-2.0\"");
    let mut kept = String::new();
    let mut keep = true;
    for line in manifest.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('[') && trimmed.ends_with(']') {
            let table = trimmed.trim_matches(|c| c == '[' || c == ']').trim();
            keep = !WORKSPACE_ONLY_TABLES
                .iter()
                .any(|t| table == *t || table.starts_with(&format!("{t}.")) || table.ends_with(&format!(".{t}")));
        }
        if keep {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    format!(
        "# Vendored by `harness plugin new` from harness {}: the plugin SDK at that version.\n{}\n",
        env!("CARGO_PKG_VERSION"),
        kept.trim_end()
    )
}

/// Writes each `(relative path, text)` under `dir`, making folders as
/// needed; scripts (`*.sh`) are made executable. Each file is new
/// ([`harness_format::outfile::create_new`]): nothing already at its path,
/// a link least of all, is written through.
fn write_files<'a>(dir: &Path, files: impl IntoIterator<Item = (&'a str, String)>) -> Result<()> {
    use std::io::Write;
    for (file, text) in files {
        let path = dir.join(file);
        std::fs::create_dir_all(path.parent().expect("a file in a folder")).with_context(|| format!("cannot create {}", dir.display()))?;
        let mode = if file.ends_with(".sh") { 0o777 } else { 0o666 };
        let mut f = harness_format::outfile::create_new(&path, Some(mode))?;
        f.write_all(text.as_bytes()).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// The C template (compressors): the source, the SDK's header copied next
/// to it (so the folder builds on its own, at this ABI version), a Makefile.
const C_COMPRESSOR: [(&str, &str); 4] = [
    ("plugin.c", include_str!("../../sdk/templates/c-compressor/plugin.c.tmpl")),
    ("harness_strategy.h", include_str!("../../sdk/include/harness_strategy.h")),
    ("Makefile", include_str!("../../sdk/templates/c-compressor/Makefile.tmpl")),
    ("README.md", include_str!("../../sdk/templates/c-compressor/README.md.tmpl")),
];

/// The C-to-WebAssembly template (compressors): the source, the contract's
/// WIT package, and a build script that runs wit-bindgen's C generator, a
/// clang for wasm32-wasi and wasm-tools.
const C_WASM_COMPRESSOR: [(&str, &str); 4] = [
    ("plugin.c", include_str!("../../sdk/templates/c-wasm-compressor/plugin.c.tmpl")),
    ("wit/strategy.wit", include_str!("../../sdk/wit/strategy.wit")),
    ("build.sh", include_str!("../../sdk/templates/c-wasm-compressor/build.sh.tmpl")),
    ("README.md", include_str!("../../sdk/templates/c-wasm-compressor/README.md.tmpl")),
];

/// The Python templates, one per kind: the source, the contract's WIT
/// package copied next to it, and a build script that runs componentize-py
/// (`{{world}}`: the kind's world).
const PY_BUILD: (&str, &str) = ("build.sh", include_str!("../../sdk/templates/py-compressor/build.sh.tmpl"));
const PY_COMPRESSOR: [(&str, &str); 4] = [
    ("app.py", include_str!("../../sdk/templates/py-compressor/app.py.tmpl")),
    ("wit/strategy.wit", include_str!("../../sdk/wit/strategy.wit")),
    PY_BUILD,
    ("README.md", include_str!("../../sdk/templates/py-compressor/README.md.tmpl")),
];
const PY_BATCH_POLICY: [(&str, &str); 4] = [
    ("app.py", include_str!("../../sdk/templates/py-batch-policy/app.py.tmpl")),
    ("wit/strategy.wit", include_str!("../../sdk/wit/strategy.wit")),
    PY_BUILD,
    ("README.md", include_str!("../../sdk/templates/py-batch-policy/README.md.tmpl")),
];
const PY_CHECKPOINT_POLICY: [(&str, &str); 4] = [
    ("app.py", include_str!("../../sdk/templates/py-checkpoint-policy/app.py.tmpl")),
    ("wit/strategy.wit", include_str!("../../sdk/wit/strategy.wit")),
    PY_BUILD,
    ("README.md", include_str!("../../sdk/templates/py-checkpoint-policy/README.md.tmpl")),
];

/// The JavaScript templates, one per kind: the source, the contract's WIT
/// package, and a build script that runs componentize-js.
const JS_BUILD: [(&str, &str); 2] = [
    ("build.mjs", include_str!("../../sdk/templates/js-compressor/build.mjs.tmpl")),
    ("build.sh", include_str!("../../sdk/templates/js-compressor/build.sh.tmpl")),
];
const JS_COMPRESSOR: [(&str, &str); 5] = [
    ("app.js", include_str!("../../sdk/templates/js-compressor/app.js.tmpl")),
    ("wit/strategy.wit", include_str!("../../sdk/wit/strategy.wit")),
    JS_BUILD[0],
    JS_BUILD[1],
    ("README.md", include_str!("../../sdk/templates/js-compressor/README.md.tmpl")),
];
const JS_BATCH_POLICY: [(&str, &str); 5] = [
    ("app.js", include_str!("../../sdk/templates/js-batch-policy/app.js.tmpl")),
    ("wit/strategy.wit", include_str!("../../sdk/wit/strategy.wit")),
    JS_BUILD[0],
    JS_BUILD[1],
    ("README.md", include_str!("../../sdk/templates/js-batch-policy/README.md.tmpl")),
];
const JS_CHECKPOINT_POLICY: [(&str, &str); 5] = [
    ("app.js", include_str!("../../sdk/templates/js-checkpoint-policy/app.js.tmpl")),
    ("wit/strategy.wit", include_str!("../../sdk/wit/strategy.wit")),
    JS_BUILD[0],
    JS_BUILD[1],
    ("README.md", include_str!("../../sdk/templates/js-checkpoint-policy/README.md.tmpl")),
];

/// A small CPU suite that runs the generated plugin against the built-in
/// baseline (two thread ranks for a compressor, so its collectives run),
/// three repeats each, scored by time to a target the baseline reaches at
/// about half its steps (eval loss 0.2 above the data's floor: reached at
/// step 50 of 100 in each repeat on the development VM).
fn suite(kind: Kind, name: &str, artifact: &str, build: &str) -> String {
    let slot = match kind {
        Kind::Compressor => "compressor",
        Kind::BatchPolicy => "batch_policy",
        Kind::CheckpointPolicy => "checkpoint",
    };
    let world = if kind == Kind::Compressor { 2 } else { 1 };
    format!(
        r#"# Runs the `{name}` plugin next to the built-in baseline on CPU.
# Build the plugin first: {build}
[suite]
name = "{name}-smoke"
device = "cpu"
seed = 1
world_size = {world}
warmup_steps = 5
repeats = 3
order = "rotate"

[[workload]]
name = "mlp-tiny"
model = {{ kind = "mlp", preset = "tiny" }}
data = {{ kind = "synthetic", vocab = 256, branching = 4 }}
batch = 32
seq_len = 64
steps = 100
optimizer = {{ kind = "adamw", lr = 1e-2, weight_decay = 0.0 }}
eval_batches = 2
eval_every = 10
# Scored by training time to this eval loss (the floor of the data + 0.2).
target_above_floor = 0.2

[[plugin]]
name = "{name}"
path = "{artifact}"

[[strategy]]
name = "baseline"
baseline = true

[[strategy]]
name = "with-{name}"
{slot} = "{name}"
"#
    )
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// A plugin that `harness plugin new` cannot make as asked (a kind the
/// language's template does not make): a usage error, exit code
/// [`harness_format::exit::USAGE`].
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Usage(pub String);

/// Writes a new plugin `dir/name` in `lang` ("rust": a crate that builds
/// to a component and a native library, against the SDK vendored into its
/// folder or the one at `sdk`; "c": a native library, compressors
/// only; "c-wasm": C built into a component by wit-bindgen, a clang for
/// wasm32-wasi and wasm-tools, compressors only; "python" / "js": a
/// component built by componentize-py / componentize-js, of any kind);
/// returns its folder.
pub fn create(kind: &str, name: &str, dir: &Path, sdk: Option<&Path>, lang: &str) -> Result<PathBuf> {
    if !valid_name(name) {
        bail!("plugin name `{name}` must start with a letter and use only letters, digits, '-' and '_'");
    }
    let t = template(kind)?;
    let k = Kind::from_name(kind).with_context(|| format!("`{kind}` is not a plugin kind"))?;
    let root = dir.join(name);
    // A link there, dangling or not, is something there too.
    if std::fs::symlink_metadata(&root).is_ok() {
        bail!("{} already exists; choose another name or --dir", root.display());
    }
    match lang {
        "rust" => {}
        "c" | "c-wasm" | "python" | "js" if kind == "compressor" || matches!(lang, "python" | "js") => {
            let (template, artifact, build, ignore): (&[(&str, &str)], _, _, _) = match (lang, k) {
                ("c", _) => (&C_COMPRESSOR, format!("lib{name}.so"), "make", "/*.so\n/results\n"),
                ("c-wasm", _) => (&C_WASM_COMPRESSOR, format!("{name}.wasm"), "./build.sh", "/*.wasm\n/gen\n/results\n"),
                ("python", k) => (
                    match k {
                        Kind::Compressor => &PY_COMPRESSOR,
                        Kind::BatchPolicy => &PY_BATCH_POLICY,
                        Kind::CheckpointPolicy => &PY_CHECKPOINT_POLICY,
                    },
                    format!("{name}.wasm"),
                    "./build.sh",
                    "/*.wasm\n/results\n/__pycache__\n",
                ),
                (_, k) => (
                    match k {
                        Kind::Compressor => &JS_COMPRESSOR,
                        Kind::BatchPolicy => &JS_BATCH_POLICY,
                        Kind::CheckpointPolicy => &JS_CHECKPOINT_POLICY,
                    },
                    format!("{name}.wasm"),
                    "./build.sh",
                    "/*.wasm\n/results\n",
                ),
            };
            let mut files: Vec<(&str, String)> =
                template.iter().map(|(f, t)| (*f, t.replace("{{name}}", name).replace("{{world}}", kind))).collect();
            files.push(("suite.toml", suite(k, name, &artifact, build)));
            files.push((".gitignore", ignore.to_owned()));
            write_files(&root, files)?;
            return Ok(root);
        }
        "c" | "c-wasm" => {
            return Err(Usage(format!(
                "the {lang} template is a compressor; for a {kind}, start from `harness plugin new {kind} {name}` (Rust, Python or JavaScript){}",
                if lang == "c" { " or from sdk/include/harness_strategy.h" } else { " or from sdk/wit/strategy.wit" }
            ))
            .into())
        }
        other => return Err(Usage(format!("no template in `{other}` (rust, c, c-wasm, python, js)")).into()),
    }
    // The SDK: vendored into the folder, or the crate at `--sdk PATH`.
    let sdk_path = match sdk {
        Some(sdk) => std::fs::canonicalize(sdk)
            .with_context(|| format!("harness-sdk not found at {} (pass --sdk PATH)", sdk.display()))?
            .display()
            .to_string()
            .replace('\\', "/"),
        None => "harness-sdk".to_owned(),
    };
    let crate_name = name.replace('-', "_");
    let fill = |s: &str| s.replace("{{name}}", name).replace("{{crate_name}}", &crate_name).replace("{{sdk_path}}", &sdk_path);
    let files = [
        ("Cargo.toml", fill(t.cargo)),
        ("src/lib.rs", fill(t.lib)),
        ("README.md", fill(t.readme)),
        (
            "suite.toml",
            suite(k, name, &format!("target/wasm32-wasip2/release/{crate_name}.wasm"), "cargo build --release --target wasm32-wasip2"),
        ),
        (".gitignore", "/target\n/results\n".to_owned()),
    ];
    write_files(&root, files)?;
    if sdk.is_none() {
        vendor_sdk(&root.join("harness-sdk"))?;
    }
    Ok(root)
}

/// The manifest as a `[[plugin]]` table that pins it. The artifact chose
/// its name, version and contract version: each value is a TOML string
/// ([`toml_string`]) that spells every character a terminal acts on as an
/// escape, and reads back as what the artifact said.
pub fn manifest_toml(m: &Manifest) -> String {
    let transport = match m.transport {
        Transport::Wasm => "wasm component (sandboxed)",
        Transport::Native => "native library (unsandboxed)",
    };
    let abi = match m.transport {
        Transport::Wasm => format!("harness:strategy@{}", m.abi),
        Transport::Native => format!("native ABI {}", m.abi),
    };
    format!(
        "# {transport}, {}\n[[plugin]]\nname = {}\npath = {}\nkind = {}\nversion = {}\nsha256 = {}\n",
        harness_format::fmt::printable_line(&abi),
        toml_string(&m.name),
        toml_string(&m.path.display().to_string()),
        toml_string(m.kind.name()),
        toml_string(&m.version),
        toml_string(&m.sha256)
    )
}

/// `s` as a TOML basic string: `"` and `\` escaped, and every character
/// that [`harness_format::fmt::unseen`] names (control and bidirectional
/// characters) written as `\uXXXX`. (The `toml` crate's writer leaves C1
/// controls and the bidirectional ones as they are.)
fn toml_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if harness_format::fmt::unseen(c) => out.push_str(&format!("\\u{:04X}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 61: `harness plugin inspect` printed the name and version an
    /// artifact chose raw (escape sequences, bells, U+202E).
    #[test]
    fn the_manifest_table_spells_what_the_artifact_chose_as_toml_escapes() {
        let m = Manifest {
            name: "evil\u{1b}]0;owned\u{7}\u{202e}\"q\\\n".into(),
            version: "1.0\u{9b}2J\r".into(),
            kind: harness_sandbox::plugin::Kind::Compressor,
            transport: Transport::Native,
            abi: "1\u{1b}[2J".into(),
            sha256: "ab".repeat(32),
            path: "/p/lib\u{7}x.so".into(),
        };
        let shown = manifest_toml(&m);
        assert!(!shown.chars().any(|c| harness_format::fmt::unseen(c) && c != '\n'), "{shown:?}");
        assert!(shown.contains(r#"name = "evil\u001B]0;owned\u0007\u202E\"q\\\u000A""#), "{shown}");
        assert!(shown.contains(r#"version = "1.0\u009B2J\u000D""#), "{shown}");
        assert!(shown.starts_with("# native library (unsandboxed), native ABI 1\\u{1b}[2J\n"), "{shown}");
        // Pasted into a suite, the table pins what the artifact said.
        let t: toml::Table = shown.parse().unwrap();
        let p = &t["plugin"][0];
        assert_eq!(p["name"].as_str(), Some(m.name.as_str()));
        assert_eq!(p["version"].as_str(), Some(m.version.as_str()));
        assert_eq!(p["path"].as_str(), Some("/p/lib\u{7}x.so"));
        assert_eq!(p["kind"].as_str(), Some("compressor"));
    }

    #[test]
    fn a_new_plugin_is_not_written_through_a_link_at_its_folder() {
        let d = tempfile::tempdir().unwrap();
        let elsewhere = d.path().join("elsewhere");
        std::os::unix::fs::symlink(&elsewhere, d.path().join("p")).unwrap();
        let e = create("compressor", "p", d.path(), None, "c").unwrap_err();
        assert!(e.to_string().contains("already exists"), "{e}");
        assert!(!elsewhere.exists());
        let made = create("compressor", "q", d.path(), None, "python").unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert!(std::fs::metadata(made.join("build.sh")).unwrap().permissions().mode() & 0o100 != 0);
        assert!(std::fs::metadata(made.join("app.py")).unwrap().permissions().mode() & 0o111 == 0);
    }

    #[test]
    fn the_vendored_sdk_holds_every_source_file_of_the_sdk() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../sdk/src");
        let mut on_disk: Vec<String> =
            std::fs::read_dir(&src).unwrap().map(|e| format!("src/{}", e.unwrap().file_name().to_string_lossy())).collect();
        on_disk.sort();
        let mut vendored: Vec<String> = SDK_FILES.iter().map(|(f, _)| f.to_string()).filter(|f| f.starts_with("src/")).collect();
        vendored.sort();
        assert_eq!(vendored, on_disk, "add the new SDK file to SDK_FILES");
        let d = tempfile::tempdir().unwrap();
        vendor_sdk(d.path()).unwrap();
        let manifest = std::fs::read_to_string(d.path().join("Cargo.toml")).unwrap();
        assert!(!manifest.contains("workspace") && !manifest.contains("dev-dependencies") && !manifest.contains("[lints"), "{manifest}");
        assert!(manifest.contains("[dependencies]") && manifest.contains(".dependencies]\nwit-bindgen"), "{manifest}");
        assert!(
            manifest.contains("rust-version = \"1.85\"") && manifest.contains(&format!("\nversion = \"{}\"", env!("CARGO_PKG_VERSION"))),
            "{manifest}"
        );
    }
}
