use super::DataParallel;
impl DataParallel {
    pub fn shard(&self) {}
}
