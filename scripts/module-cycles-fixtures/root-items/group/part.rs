pub fn g() -> u8 {
    super::SHARED
}
