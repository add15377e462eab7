pub enum Stage {
    One,
}
pub fn size() -> usize {
    super::padded(2)
}
