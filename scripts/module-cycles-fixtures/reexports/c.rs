pub struct Delta;
pub fn h() {
    crate::d::k()
}
