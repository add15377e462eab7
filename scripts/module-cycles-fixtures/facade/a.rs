pub struct A;
pub fn f() -> &'static str {
    let _ = super::B; // the root's private import: b, not the root
    crate::VERSION
}
