pub fn f() -> crate::Handle {
    crate::open()
}
