use super::{padded, DataParallel};
pub fn hook() {}
impl DataParallel {
    pub fn bucket(&self) -> usize {
        padded(1)
    }
}
