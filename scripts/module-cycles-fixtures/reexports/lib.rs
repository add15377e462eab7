//! `pub use`, `pub(crate) use {..}` and `pub use ..::*` in lib.rs: a path
//! through the root names the module that defines the item.
mod a;
mod b;
mod c;
mod d;
pub use a::Alpha;
pub(crate) use b::{Beta, Gamma as G};
pub use c::*;
pub use std::fmt::Debug;
