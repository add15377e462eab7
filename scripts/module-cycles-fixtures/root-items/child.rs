use crate::Context;
pub fn step(_: &Context) {}
