use crate::Delta;
pub fn k() {
    let _ = Delta;
}
