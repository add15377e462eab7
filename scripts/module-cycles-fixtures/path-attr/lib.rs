//! `#[path]` modules are read from their file.
#[path = "other_name.rs"]
mod renamed;
mod plain;
