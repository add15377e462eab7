//! Autograd nodes of harness's own: a block whose activations are
//! recomputed in the backward pass ([`recompute`]) and a differentiable
//! operation computed by harness's kernels ([`custom_op`]), both run by the
//! shim through callbacks into Rust.

use std::ffi::{c_char, c_int, c_void};

use tch::Tensor;

use super::{check, ffi, TorchError};

/// A block of a model whose activations [`recompute`] drops.
type Block = Box<dyn Fn(&Tensor) -> Tensor + Send>;

/// Tests that seed or draw from libtorch's global generators take turns
/// (this crate's, and with the `testing` feature those of the crates above).
#[cfg(any(test, feature = "testing"))]
pub static GLOBAL_RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[cfg(any(test, feature = "testing"))]
thread_local! {
    /// How often a block given to [`recompute`] ran on this thread (tests).
    pub static BLOCK_RUNS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// `block(x)`, with its activations dropped after the forward pass and
/// recomputed in the backward pass (as `torch.utils.checkpoint` does): the
/// backward pass runs `block` again on the kept input, with the autocast
/// state of the forward pass and, with `rng` (the block draws random
/// numbers: dropout), the random state it had, then back-propagates
/// through it. The gradients are those of `block(x)` computed directly.
/// With grad mode off, `block` just runs.
///
/// `block` is kept by the graph of the result until the backward pass (it
/// may run on the autograd engine's thread), so it owns what it uses:
/// shallow clones of the parameters.
pub fn recompute(x: &Tensor, rng: bool, block: impl Fn(&Tensor) -> Tensor + Send + 'static) -> Result<Tensor, TorchError> {
    unsafe extern "C" fn run(ctx: *mut c_void, input: *mut c_void, out: *mut *mut c_void, err: *mut c_char, err_len: usize) {
        // SAFETY: ctx is the Box<Block> leaked below, alive until drop_block;
        // input is a new at::Tensor handed over to us.
        let (block, input) = unsafe { (&*(ctx as *const Block), Tensor::from_ptr(input as *mut _)) };
        #[cfg(any(test, feature = "testing"))]
        BLOCK_RUNS.with(|n| n.set(n.get() + 1));
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| block(&input))) {
            // SAFETY: out is valid for one write; the shim takes the tensor.
            Ok(y) => {
                // SAFETY: out is valid for one write; the shim takes over the
                // at::Tensor, so y must not free it.
                unsafe { *out = y.as_ptr() as *mut c_void };
                std::mem::forget(y);
            }
            Err(payload) => {
                let msg = payload
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| payload.downcast_ref::<&str>().copied())
                    .unwrap_or("the recomputed block panicked");
                let n = msg.len().min(err_len.saturating_sub(1));
                // SAFETY: err holds err_len bytes; n + 1 <= err_len.
                unsafe {
                    std::ptr::copy_nonoverlapping(msg.as_ptr(), err as *mut u8, n);
                    *err.add(n) = 0;
                }
            }
        }
    }
    unsafe extern "C" fn drop_block(ctx: *mut c_void) {
        // SAFETY: ctx is the Box<Block> leaked below; the shim calls this once.
        drop(unsafe { Box::from_raw(ctx as *mut Block) });
    }
    let ctx = Box::into_raw(Box::new(Box::new(block) as Block)) as *mut c_void;
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: x is a live tensor; the shim owns ctx from here on and frees it
    // through drop_block, also when it fails.
    check(unsafe { ffi::hx_recompute(x.as_ptr() as *mut c_void, run, drop_block, ctx, rng as c_int, &mut out) })?;
    // SAFETY: out is a heap at::Tensor from the shim, owned from here on.
    Ok(unsafe { Tensor::from_ptr(out as *mut _) })
}

/// The most outputs (and kept tensors) a [`CustomOp`] may have.
pub const CUSTOM_OP_MAX: usize = 8;

/// A differentiable operation computed by code of harness's own (the fused
/// kernels), run through [`custom_op`]: autograd calls `backward` with the
/// tensors `forward` kept and the gradients of its outputs.
pub trait CustomOp: Send + Sync + 'static {
    /// The outputs (at least one, at most [`CUSTOM_OP_MAX`]) and the tensors
    /// to keep for the backward pass (at most [`CUSTOM_OP_MAX`]; an output
    /// may be among them).
    fn forward(&self, inputs: &[Tensor]) -> anyhow::Result<(Vec<Tensor>, Vec<Tensor>)>;
    /// The inputs' gradients (None for an input without one) from the kept
    /// tensors and the outputs' gradients (None where no gradient flowed).
    fn backward(&self, saved: &[Tensor], grads: &[Option<Tensor>]) -> anyhow::Result<Vec<Option<Tensor>>>;
}

/// Writes a callback's failure (an error or a panic) into the shim's buffer.
fn report(msg: &str, err: *mut c_char, err_len: usize) {
    let n = msg.len().min(err_len.saturating_sub(1));
    // SAFETY: err holds err_len bytes; n + 1 <= err_len.
    unsafe {
        std::ptr::copy_nonoverlapping(msg.as_ptr(), err as *mut u8, n);
        *err.add(n) = 0;
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a fused operation panicked".into())
}

/// Takes `n` tensors handed over by the shim (NULL: none).
///
/// # Safety
/// `ptrs` holds `n` pointers, each NULL or a heap at::Tensor the caller owns.
unsafe fn take(ptrs: *mut *mut c_void, n: c_int) -> Vec<Option<Tensor>> {
    (0..n.max(0) as usize)
        .map(|i| {
            // SAFETY: per the function's contract.
            let p = unsafe { *ptrs.add(i) };
            // SAFETY: a non-null p is a heap at::Tensor the caller owns
            // (the function's contract), taken over here once.
            (!p.is_null()).then(|| unsafe { Tensor::from_ptr(p as *mut _) })
        })
        .collect()
}

/// Hands tensors to the shim (which frees them) through `ptrs`.
///
/// # Safety
/// `ptrs` has room for `ts.len()` pointers.
unsafe fn give(ts: Vec<Option<Tensor>>, ptrs: *mut *mut c_void) {
    for (i, t) in ts.into_iter().enumerate() {
        let p = match t {
            Some(t) => {
                let p = t.as_ptr() as *mut c_void;
                std::mem::forget(t);
                p
            }
            None => std::ptr::null_mut(),
        };
        // SAFETY: per the function's contract.
        unsafe { *ptrs.add(i) = p };
    }
}

/// `op(inputs)` as one node of the autograd graph (see [`CustomOp`]); with
/// grad mode off, just its forward pass. The op is kept by the graph until
/// the backward pass, which may run on the autograd engine's thread.
pub fn custom_op(op: impl CustomOp, inputs: &[&Tensor]) -> Result<Vec<Tensor>, TorchError> {
    type Boxed = Box<dyn CustomOp>;
    unsafe extern "C" fn fwd(
        ctx: *mut c_void,
        input: *mut *mut c_void,
        n_in: c_int,
        out: *mut *mut c_void,
        n_out: *mut c_int,
        saved: *mut *mut c_void,
        n_saved: *mut c_int,
        err: *mut c_char,
        err_len: usize,
    ) {
        // SAFETY: ctx is the Box<Boxed> leaked in custom_op, alive until
        // drop_op; the inputs are new tensors handed to us.
        let (op, inputs) = unsafe { (&*(ctx as *const Boxed), take(input, n_in)) };
        let inputs: Vec<Tensor> = inputs.into_iter().flatten().collect();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| op.forward(&inputs))) {
            Ok(Ok((outs, keep))) if !outs.is_empty() && outs.len() <= CUSTOM_OP_MAX && keep.len() <= CUSTOM_OP_MAX => {
                // SAFETY: n_out/n_saved are valid; out and saved have room
                // for CUSTOM_OP_MAX (HX_OP_MAX) pointers.
                unsafe {
                    *n_out = outs.len() as c_int;
                    *n_saved = keep.len() as c_int;
                    give(outs.into_iter().map(Some).collect(), out);
                    give(keep.into_iter().map(Some).collect(), saved);
                }
            }
            Ok(Ok(_)) => report("a fused operation returned no outputs, or too many", err, err_len),
            Ok(Err(e)) => report(&format!("{e:#}"), err, err_len),
            Err(p) => report(&panic_message(&*p), err, err_len),
        }
    }
    unsafe extern "C" fn bwd(
        ctx: *mut c_void,
        saved: *mut *mut c_void,
        n_saved: c_int,
        grads: *mut *mut c_void,
        n_grads: c_int,
        in_grads: *mut *mut c_void,
        n_in: c_int,
        err: *mut c_char,
        err_len: usize,
    ) {
        // SAFETY: as in fwd; the kept tensors and gradients are handed to us.
        let (op, saved, grads) = unsafe { (&*(ctx as *const Boxed), take(saved, n_saved), take(grads, n_grads)) };
        let saved: Vec<Tensor> = saved.into_iter().map(|t| t.unwrap_or_else(Tensor::new)).collect();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| op.backward(&saved, &grads))) {
            Ok(Ok(g)) if g.len() == n_in as usize => {
                // SAFETY: in_grads has room for n_in pointers.
                unsafe { give(g, in_grads) }
            }
            Ok(Ok(g)) => report(&format!("a fused operation gave {} gradients for {n_in} inputs", g.len()), err, err_len),
            Ok(Err(e)) => report(&format!("{e:#}"), err, err_len),
            Err(p) => report(&panic_message(&*p), err, err_len),
        }
    }
    unsafe extern "C" fn drop_op(ctx: *mut c_void) {
        // SAFETY: ctx is the Box<Boxed> leaked below; the shim calls this once.
        drop(unsafe { Box::from_raw(ctx as *mut Boxed) });
    }
    let ctx = Box::into_raw(Box::new(Box::new(op) as Boxed)) as *mut c_void;
    let ptrs: Vec<*mut c_void> = inputs.iter().map(|t| t.as_ptr() as *mut c_void).collect();
    let mut out = [std::ptr::null_mut::<c_void>(); CUSTOM_OP_MAX];
    let mut n_out: c_int = 0;
    // SAFETY: the inputs are live tensors (the shim copies the handles);
    // out has room for CUSTOM_OP_MAX results; the shim owns ctx from here on
    // and frees it through drop_op, also when it fails.
    check(unsafe { ffi::hx_custom_op(ptrs.as_ptr(), ptrs.len() as c_int, fwd, bwd, drop_op, ctx, out.as_mut_ptr(), &mut n_out) })?;
    // SAFETY: the shim wrote n_out (<= CUSTOM_OP_MAX) new tensors we now own.
    Ok(unsafe { take(out.as_mut_ptr(), n_out.min(CUSTOM_OP_MAX as c_int)) }.into_iter().flatten().collect())
}
