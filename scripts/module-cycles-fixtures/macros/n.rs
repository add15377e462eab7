pub fn work() {
    crate::m::helper()
}
