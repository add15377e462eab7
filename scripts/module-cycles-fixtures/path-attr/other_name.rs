pub fn r() {
    crate::plain::p()
}
