//! A native library that runs code the moment it is loaded: a function in
//! `.init_array` (on Linux; `__mod_init_func` on macOS), which the dynamic
//! loader calls from `dlopen` before the host can look up a single symbol,
//! check an ABI version or refuse anything. It writes a marker file named
//! by `HARNESS_FIXTURE_CONSTRUCTOR_MARKER`, so a test can tell whether a
//! command loaded it: `harness verify` and `harness report` must never
//! load a bundle's native library (tests/cli/submit.rs), while `harness
//! plugin inspect` of a library of one's own does.
//!
//! It exports nothing else: it is no plugin, and every host that does load
//! it refuses it afterwards, too late.
//!
//! Native only: on wasm32 this crate is empty (and `scripts/build-plugins.sh`
//! does not build it for wasm).

/// The variable naming the marker file.
pub const MARKER_VAR: &str = "HARNESS_FIXTURE_CONSTRUCTOR_MARKER";

/// Writes the marker file, if the variable names one.
#[cfg(not(target_arch = "wasm32"))]
extern "C" fn leave_marker() {
    if let Some(path) = std::env::var_os(MARKER_VAR) {
        let _ = std::fs::write(path, b"the constructor of libconstructor ran\n");
    }
}

/// The loader calls every function of this section when the library is
/// loaded.
#[cfg(target_os = "linux")]
#[used]
#[unsafe(link_section = ".init_array")]
static CONSTRUCTOR: extern "C" fn() = leave_marker;

#[cfg(target_os = "macos")]
#[used]
#[unsafe(link_section = "__DATA,__mod_init_func")]
static CONSTRUCTOR: extern "C" fn() = leave_marker;
