pub fn h() {
    super::b::g()
}
