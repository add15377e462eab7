use crate::Debug; // from outside the crate: no edge
pub struct Alpha;
pub fn f() -> crate::Beta {
    crate::Beta
}
