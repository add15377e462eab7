//! The error type of plugin callbacks.

use std::fmt;

/// An error a plugin returns from a callback (configure, compress, ...).
///
/// The host fails the entry with this message, prefixed with the plugin's
/// name and the call. Build one from a message: `Error::new("...")`,
/// `"...".into()` or `format!(...).into()`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    message: String,
}

impl Error {
    /// An error with this message.
    pub fn new(message: impl Into<String>) -> Error {
        Error { message: message.into() }
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

impl From<String> for Error {
    fn from(message: String) -> Error {
        Error { message }
    }
}

impl From<&str> for Error {
    fn from(message: &str) -> Error {
        Error { message: message.to_owned() }
    }
}
