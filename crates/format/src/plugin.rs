//! Plugins as result files record them: the artifact's identity
//! ([`Manifest`]: name, version, kind, transport, contract, sha256) and what
//! it did in an entry ([`PluginRecord`]). Loading and running plugins is the
//! sandbox's job.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::histogram::LatencySummary;

/// The three plugin kinds (WIT worlds).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    Compressor,
    BatchPolicy,
    CheckpointPolicy,
}

impl Kind {
    /// Every kind, in the order docs and messages list them.
    pub const ALL: [Kind; 3] = [Kind::Compressor, Kind::BatchPolicy, Kind::CheckpointPolicy];

    /// The WIT world name.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Compressor => "compressor",
            Kind::BatchPolicy => "batch-policy",
            Kind::CheckpointPolicy => "checkpoint-policy",
        }
    }

    /// The kind of a WIT world name, if it is one.
    pub fn from_name(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// How a plugin runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Transport {
    #[serde(rename = "wasm")]
    Wasm,
    #[serde(rename = "native (unsandboxed)")]
    Native,
}

/// What identifies a plugin artifact; `harness plugin inspect` prints it and
/// a suite's `[[plugin]]` can pin its fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub name: String,
    pub version: String,
    pub kind: Kind,
    pub transport: Transport,
    /// WASM: the WIT package version; native: the ABI version.
    pub abi: String,
    pub sha256: String,
    pub path: PathBuf,
}

/// What one plugin did in an entry (results format, `metrics.plugins`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PluginRecord {
    /// compressor, batch_policy or checkpoint.
    pub slot: String,
    #[serde(flatten)]
    pub manifest: Manifest,
    /// Calls into the plugin, and the time inside them.
    pub calls: u64,
    pub call: Option<LatencySummary>,
    /// Host ops the plugin ran.
    pub host_ops: u64,
    /// Bytes the plugin copied into its own memory (`read-f32`).
    pub read_bytes: u64,
    /// Seconds loading the artifact took (reading, validating and, for a
    /// component, compiling it), once per run: not training time.
    #[serde(default)]
    pub load_s: f64,
    /// Seconds making and configuring this entry's instance took, before
    /// training started: not training time.
    #[serde(default)]
    pub instantiate_s: f64,
}

/// A plugin's record and its call-time histogram (encoded), for results.
pub type PluginReport = (PluginRecord, String);

/// What an artifact's bytes are, read from its first bytes alone (nothing
/// is loaded): how a plugin's transport is known without trusting a label
/// or a file name. `harness verify` loads only [`ArtifactFormat::Component`]s,
/// and only in the sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArtifactFormat {
    /// A WebAssembly component: `\0asm`, then the component layer's version
    /// and layer bytes (`0d 00 01 00`).
    Component,
    /// A core WebAssembly module (`\0asm 01 00 00 00`), not a component.
    CoreModule,
    /// `\0asm` with another version or layer.
    OtherWasm,
    /// An ELF file (a Linux shared library): native code.
    Elf,
    /// A Mach-O file (a macOS library): native code.
    MachO,
    /// A PE file (a Windows DLL): native code.
    Pe,
    /// Anything else.
    Unknown,
}

/// The first bytes of a WebAssembly component: the magic `\0asm`, version
/// 0x0d and layer 1 (the component model's binary format).
pub const COMPONENT_MAGIC: [u8; 8] = [0, b'a', b's', b'm', 0x0d, 0, 1, 0];

impl ArtifactFormat {
    /// Sniffs `bytes`.
    pub fn of(bytes: &[u8]) -> ArtifactFormat {
        const MACHO: [[u8; 4]; 5] = [
            [0xfe, 0xed, 0xfa, 0xce],
            [0xfe, 0xed, 0xfa, 0xcf],
            [0xce, 0xfa, 0xed, 0xfe],
            [0xcf, 0xfa, 0xed, 0xfe],
            [0xca, 0xfe, 0xba, 0xbe],
        ];
        match bytes {
            b if b.starts_with(&COMPONENT_MAGIC) => ArtifactFormat::Component,
            [0, b'a', b's', b'm', 1, 0, 0, 0, ..] => ArtifactFormat::CoreModule,
            b if b.starts_with(b"\0asm") => ArtifactFormat::OtherWasm,
            b if b.starts_with(b"\x7fELF") => ArtifactFormat::Elf,
            b if MACHO.iter().any(|m| b.starts_with(m)) => ArtifactFormat::MachO,
            b if b.starts_with(b"MZ") => ArtifactFormat::Pe,
            _ => ArtifactFormat::Unknown,
        }
    }

    /// Native code that runs unsandboxed once loaded.
    pub fn is_native(self) -> bool {
        matches!(self, ArtifactFormat::Elf | ArtifactFormat::MachO | ArtifactFormat::Pe)
    }

    /// What it is, for messages.
    pub fn describe(self) -> &'static str {
        match self {
            ArtifactFormat::Component => "a WebAssembly component",
            ArtifactFormat::CoreModule => "a core WebAssembly module, not a component",
            ArtifactFormat::OtherWasm => "a WebAssembly file of another version or layer",
            ArtifactFormat::Elf => "an ELF file: a native library",
            ArtifactFormat::MachO => "a Mach-O file: a native library",
            ArtifactFormat::Pe => "a PE file: a native library",
            ArtifactFormat::Unknown => "neither a WebAssembly component nor a known native library",
        }
    }
}

/// The first `n` bytes of `bytes` in hex, space-separated, for messages
/// that say what a file starts with.
pub fn head_hex(bytes: &[u8], n: usize) -> String {
    bytes.iter().take(n).map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kind_is_found_by_its_name_and_nothing_else() {
        for k in Kind::ALL {
            assert_eq!(Kind::from_name(k.name()), Some(k));
        }
        assert_eq!(Kind::from_name("checkpoint"), None);
    }

    #[test]
    fn artifacts_are_told_apart_by_their_first_bytes() {
        assert_eq!(ArtifactFormat::of(&[0, b'a', b's', b'm', 0x0d, 0, 1, 0, 7]), ArtifactFormat::Component);
        assert_eq!(ArtifactFormat::of(&[0, b'a', b's', b'm', 1, 0, 0, 0]), ArtifactFormat::CoreModule);
        assert_eq!(ArtifactFormat::of(&[0, b'a', b's', b'm', 0x0e, 0, 1, 0]), ArtifactFormat::OtherWasm);
        assert_eq!(ArtifactFormat::of(b"\x7fELF\x02\x01\x01"), ArtifactFormat::Elf);
        assert_eq!(ArtifactFormat::of(&[0xcf, 0xfa, 0xed, 0xfe, 7]), ArtifactFormat::MachO);
        assert_eq!(ArtifactFormat::of(b"MZ\x90\0"), ArtifactFormat::Pe);
        assert_eq!(ArtifactFormat::of(b"\0as"), ArtifactFormat::Unknown);
        assert!(ArtifactFormat::Elf.is_native() && !ArtifactFormat::Component.is_native() && !ArtifactFormat::Unknown.is_native());
        assert_eq!(head_hex(b"\x7fELF\x02", 4), "7f 45 4c 46");
    }
}
