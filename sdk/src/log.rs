//! Messages for the run's log, prefixed by the host with the plugin's name.
//!
//! Logging is a host call: keep it out of per-bucket hot paths.

#[cfg(not(target_arch = "wasm32"))]
use crate::native_backend as backend;
#[cfg(target_arch = "wasm32")]
use crate::wasm_backend as backend;

pub use crate::types::Level;

/// Writes one line at `level`.
pub fn write(level: Level, message: &str) {
    backend::log(level, message)
}
/// Writes one debug line.
pub fn debug(message: &str) {
    write(Level::Debug, message)
}
/// Writes one info line.
pub fn info(message: &str) {
    write(Level::Info, message)
}
/// Writes one warning line.
pub fn warn(message: &str) {
    write(Level::Warn, message)
}
