//! An inline module is part of its file's own items; a `#[cfg(test)]` one
//! is a module of its own, and `super::` inside it starts from it.
mod a;
mod g;

mod ffi {
    pub fn raw() -> super::Handle {
        super::Handle
    }
}

pub struct Handle;

pub fn open() -> Handle {
    ffi::raw()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn t() {
        let _ = crate::a::f();
        let _ = open();
    }
}
