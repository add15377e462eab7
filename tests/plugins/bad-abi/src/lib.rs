//! A native plugin library with the wrong ABI version, written by hand
//! (without `harness_sdk::export!`): the host must read
//! `harness_abi_version`, see 999, refuse the library naming both versions,
//! and never look up another symbol. It exports nothing else on purpose.
//!
//! Native only: on wasm32 this crate is empty (and `scripts/build-plugins.sh`
//! does not build it for wasm).

/// Deliberately not `harness_sdk::abi::ABI_VERSION`.
#[cfg(not(target_arch = "wasm32"))]
#[unsafe(no_mangle)]
pub extern "C" fn harness_abi_version() -> u32 {
    999
}
