pub fn val() -> u8 {
    assert!(crate::o::y());
    1
}
