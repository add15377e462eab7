//! A root that is both the loop and the shared context: its own items and
//! a child that names them form a circle (so do a mod.rs and its child).
mod child;
mod group;
mod other;

pub struct Context;

pub fn run() {
    child::step(&Context);
}
