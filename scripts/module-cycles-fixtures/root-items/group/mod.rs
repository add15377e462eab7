mod part;
pub const SHARED: u8 = 1;
pub fn f() -> u8 {
    part::g()
}
