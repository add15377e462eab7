//! Out-of-memory detection, in one place: libtorch reports an allocation
//! failure either as a returned error (fallible `f_` ops, our kernels) or as
//! a panic of `tch` carrying the C++ exception's text. Both are recognised
//! here, and the step's passes run under [`OomGuard::catch`] so that the
//! step can be retried with a smaller batch.

use anyhow::Result;

use harness_format::error::is_oom_message;

/// Whether `e` (any link of its chain) is an out-of-memory error.
pub fn is_oom_error(e: &anyhow::Error) -> bool {
    is_oom_message(&format!("{e:#}"))
}

/// Whether a panic's payload is libtorch's out-of-memory error.
fn is_oom_payload(payload: &(dyn std::any::Any + Send)) -> bool {
    let msg = payload.downcast_ref::<String>().map(String::as_str).or_else(|| payload.downcast_ref::<&str>().copied()).unwrap_or("");
    is_oom_message(msg)
}

/// Out-of-memory recovery of an entry. With a batch-policy plugin (which may
/// shrink the batch) or an emulated memory limit, an out-of-memory error in
/// the forward or backward pass is caught and the step retried smaller.
/// With several ranks they agree after the backward pass on whether any ran
/// out.
#[derive(Debug, Clone, Copy)]
pub struct OomGuard {
    /// `faults.oom_above_batch`: micro-batches above this run out of memory
    /// (an emulated limit, for tests and CPU runs).
    pub limit: Option<u32>,
    /// Whether errors are caught at all (else they fail the entry).
    pub armed: bool,
    /// Whether the ranks must agree after each step's passes (armed, and
    /// more than one rank). Collectives in flight during the backward pass
    /// would break that agreement, so the overlap is off then.
    pub agree: bool,
}

impl OomGuard {
    pub fn new(limit: Option<u32>, has_batch_plugin: bool, world: usize) -> OomGuard {
        let armed = limit.is_some() || has_batch_plugin;
        OomGuard { limit, armed, agree: armed && world > 1 }
    }

    /// Whether `micro_batch` is over the emulated memory limit.
    pub fn emulated(&self, micro_batch: u32) -> bool {
        self.limit.is_some_and(|l| micro_batch > l)
    }

    /// Runs the step's passes; `Ok(true)` when they ran out of memory and
    /// recovery is armed. Other errors and panics go on as they were.
    /// (libtorch's panics are not printed: the run's panic hook,
    /// `console::QuietPanics`, keeps them for messages.)
    pub fn catch(&self, passes: impl FnOnce() -> Result<()>) -> Result<bool> {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(passes));
        match outcome {
            Ok(Err(e)) if self.armed && is_oom_error(&e) => Ok(true),
            Ok(r) => r.map(|()| false),
            Err(payload) if self.armed && is_oom_payload(payload.as_ref()) => Ok(true),
            Err(payload) => std::panic::resume_unwind(payload),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caught_only_when_armed_and_out_of_memory() {
        let armed = OomGuard { limit: None, armed: true, agree: false };
        assert!(armed.catch(|| anyhow::bail!("CUDA out of memory. Tried to allocate 2 GiB")).unwrap());
        assert!(!armed.catch(|| Ok(())).unwrap());
        assert!(armed.catch(|| anyhow::bail!("shape mismatch")).is_err());
        let off = OomGuard { limit: None, armed: false, agree: false };
        assert!(off.catch(|| anyhow::bail!("CUDA out of memory")).is_err());
        assert!(OomGuard { limit: Some(4), armed: true, agree: false }.emulated(5));
    }
}
