//! A root whose own items name no child: children may use them, its
//! re-exports and private imports are no dependency of its own.
mod a;
mod b;
pub use a::A;
use b::B;
pub const VERSION: &str = "1";
