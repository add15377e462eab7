//! Gradient buffers that a step has not written yet.
//!
//! Data parallelism keeps each parameter's gradient as a view of a flat
//! bucket buffer, and the backward pass's layers add into it. Zeroing every
//! buffer at a step's start costs a pass over all the gradients (1.2 ms of a
//! GPT 1.3B step on an H200), and every add then reads the zeros back (the
//! weight-gradient matmuls' epilogues: about 1.9 ms more). Instead the data
//! parallel code can mark the views as stale here at a step's start
//! ([`mark`]); the step's first write to a view then overwrites it (a
//! matmul with beta = 0, a copy, a kernel's assigning mode) and the later
//! ones add, which gives the same values bit for bit as adding into zeros.
//! Every writer asks [`take`] once before it writes: the fused layers
//! through their one way to a gradient buffer (`GradBuffer::claim` in
//! `models/fused/grad.rs`), the data parallel code through [`settle`].
//! Whatever is still marked when the gradient is needed is zeroed then
//! (`crate::dp`).
//!
//! The views are keyed by their first element's address, which two live
//! views of one step never share (empty ones are never marked).

use std::collections::HashSet;
use std::sync::Mutex;

use tch::Tensor;

static STALE: Mutex<Option<HashSet<usize>>> = Mutex::new(None);

fn key(g: &Tensor) -> Option<usize> {
    (g.numel() > 0).then(|| g.data_ptr() as usize)
}

/// Marks `views` as not written in this step: their contents are stale.
pub fn mark<'a>(views: impl IntoIterator<Item = &'a Tensor>) {
    let mut set = STALE.lock().unwrap_or_else(|e| e.into_inner());
    let set = set.get_or_insert_with(HashSet::new);
    set.extend(views.into_iter().filter_map(key));
}

/// Whether `g` is marked stale, clearing the mark: true tells the caller,
/// which is about to write `g`, to write over it rather than add into it.
/// Only a writer asks, just before it writes: a fused layer through its
/// `GradBuffer` (`models/fused/grad.rs`), which a test of the sources
/// keeps the only caller under `models/`.
pub(crate) fn take(g: &Tensor) -> bool {
    let mut set = STALE.lock().unwrap_or_else(|e| e.into_inner());
    match (set.as_mut(), key(g)) {
        (Some(set), Some(k)) => set.remove(&k),
        _ => false,
    }
}

/// Clears the marks of `views` (their buffers are going, or are zeroed).
pub fn forget<'a>(views: impl IntoIterator<Item = &'a Tensor>) {
    let mut set = STALE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(set) = set.as_mut() {
        for k in views.into_iter().filter_map(key) {
            set.remove(&k);
        }
    }
}

/// Zeroes `g` if it is still marked stale (nothing wrote it this step).
pub fn settle(g: &Tensor) {
    if take(g) {
        let _ = tch::no_grad(|| g.shallow_clone().zero_());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn a_mark_is_taken_once_and_settling_zeroes_what_nothing_wrote() {
        let flat = Tensor::full([6], 5.0, (Kind::Float, Device::Cpu));
        let (a, b, empty) = (flat.narrow(0, 0, 2), flat.narrow(0, 2, 4), flat.narrow(0, 6, 0));
        mark([&a, &b, &empty]);
        assert!(!take(&empty), "an empty view is never marked");
        assert!(take(&a));
        assert!(!take(&a), "the first write takes the mark");
        settle(&a);
        settle(&b);
        assert_eq!(Vec::<f32>::try_from(&flat).unwrap(), vec![5.0, 5.0, 0.0, 0.0, 0.0, 0.0]);
        mark([&a]);
        forget([&a]);
        assert!(!take(&a));
    }
}
