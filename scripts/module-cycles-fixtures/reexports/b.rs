pub struct Beta;
pub struct Gamma;
pub fn g() {
    let _ = crate::Alpha;
}
