pub fn uses_only(_: &crate::Context) {}
