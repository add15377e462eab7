mod overlap;
mod plan;
mod zero;

pub struct DataParallel {
    pub stage: plan::Stage,
}

fn padded(n: usize) -> usize {
    n
}

impl DataParallel {
    pub fn step(&self) {
        overlap::hook();
    }
}
