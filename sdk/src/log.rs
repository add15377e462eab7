//! Messages for the run's log, prefixed by the host with the plugin's name.
//!
//! Logging is a host call: keep it out of per-bucket hot paths.

#[cfg(not(target_arch = "wasm32"))]
use crate::native::backend;
#[cfg(target_arch = "wasm32")]
use crate::wasm_backend as backend;

/// Severity (WIT `log.level`; native ABI: 0, 1, 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// Details for debugging.
    Debug,
    /// Normal messages.
    Info,
    /// Something looks wrong.
    Warn,
}

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
