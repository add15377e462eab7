//! Paths in `macro_rules!` bodies (`$crate::` is `crate::`) and in a
//! macro's arguments count like any other.
mod m;
mod n;
mod o;
mod p;
