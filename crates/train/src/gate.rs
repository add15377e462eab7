//! Parameters still being gathered (ZeRO's prefetch, see
//! [`crate::dp::DataParallel::prefetch_params`]): after a step's update each
//! bucket's parameters are all-gathered beside the next forward pass, and a
//! layer that reads them first makes the device wait for their bucket only
//! ([`before`]). Each rank's thread holds its own gate (thread ranks in the
//! tests share a process).

use std::cell::RefCell;
use std::collections::HashMap;

use tch::Tensor;

use harness_runtime::comm::Gathered;

/// The buckets whose gathers are in flight, and where each parameter lies.
struct Gate {
    /// A parameter's bucket, by its address.
    bucket_of: HashMap<usize, usize>,
    /// Each bucket's gather not waited for yet, with the bucket's parameters.
    pending: Vec<Option<(Gathered, Vec<Tensor>)>>,
}

thread_local! {
    static GATE: RefCell<Option<Gate>> = const { RefCell::new(None) };
}

/// Holds the gathers in flight: `gathers[b]` is bucket `b`'s (None where
/// its gather is done already) and `members[b]` its parameters. Whatever an
/// earlier [`arm`] left is waited for first.
pub fn arm(gathers: Vec<Option<Gathered>>, members: Vec<Vec<Tensor>>) -> anyhow::Result<()> {
    settle()?;
    let mut bucket_of = HashMap::new();
    let mut pending = Vec::with_capacity(gathers.len());
    for (b, (g, ps)) in gathers.into_iter().zip(members).enumerate() {
        match g {
            Some(g) => {
                bucket_of.extend(ps.iter().filter(|p| p.numel() > 0).map(|p| (p.data_ptr() as usize, b)));
                pending.push(Some((g, ps)));
            }
            None => pending.push(None),
        }
    }
    if pending.iter().any(Option::is_some) {
        GATE.with(|g| *g.borrow_mut() = Some(Gate { bucket_of, pending }));
    }
    Ok(())
}

/// Whether `p`'s bucket is still being gathered.
pub fn pending(p: &Tensor) -> bool {
    GATE.with(|g| g.borrow().as_ref().is_some_and(|g| g.bucket_of.get(&(p.data_ptr() as usize)).is_some_and(|&b| g.pending[b].is_some())))
}

/// Makes the work queued from now on wait for the buckets of `params`
/// still in flight; returns the parameters of the buckets it waited for
/// (for what they were held back from, e.g. the step's bf16 casts).
pub fn before(params: &[&Tensor]) -> anyhow::Result<Vec<Tensor>> {
    let mut out = Vec::new();
    let done = GATE.with(|g| -> anyhow::Result<bool> {
        let mut g = g.borrow_mut();
        let Some(gate) = g.as_mut() else { return Ok(false) };
        for p in params {
            let Some(&b) = gate.bucket_of.get(&(p.data_ptr() as usize)) else { continue };
            if let Some((gathered, members)) = gate.pending[b].take() {
                gathered.wait()?;
                out.extend(members);
            }
        }
        Ok(gate.pending.iter().all(Option::is_none))
    })?;
    if done {
        GATE.with(|g| *g.borrow_mut() = None);
    }
    Ok(out)
}

/// Makes the work queued from now on wait for every gather in flight.
pub fn settle() -> anyhow::Result<()> {
    let Some(gate) = GATE.with(|g| g.borrow_mut().take()) else { return Ok(()) };
    for (gathered, _) in gate.pending.into_iter().flatten() {
        gathered.wait()?;
    }
    Ok(())
}

/// Drops the gathers in flight without waiting for them: at an entry's
/// start, where what an earlier entry on this thread left (one that failed
/// between its update and its next forward pass) belongs to a collective
/// that is gone.
pub fn forget() {
    GATE.with(|g| g.borrow_mut().take());
}
