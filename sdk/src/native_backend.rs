//! The native transport: every op through [`Host::op`], on the host table
//! of the instance whose callback runs on this thread.

use std::cell::Cell;

use crate::abi::{Host, Op, OpArgs, OpResult, STATUS_OK};
use crate::types::{Device, Dtype, Level};

thread_local! {
    /// The host table of the instance whose callback runs on this thread.
    pub(crate) static CURRENT_HOST: Cell<*const Host> = const { Cell::new(std::ptr::null()) };
}

/// Makes `host` the current host of this thread until dropped.
pub(crate) struct EnterHost {
    previous: *const Host,
}

impl EnterHost {
    pub(crate) fn new(host: *const Host) -> EnterHost {
        EnterHost { previous: CURRENT_HOST.with(|c| c.replace(host)) }
    }
}

impl Drop for EnterHost {
    fn drop(&mut self) {
        CURRENT_HOST.with(|c| c.set(self.previous));
    }
}

/// A tensor handle and the host table it belongs to (which lives in the
/// plugin instance, so it outlives the plugin's tensors).
pub struct Raw {
    pub handle: u64,
    pub host: *const Host,
}

/// The collectives' host table.
pub struct RawComm {
    pub host: *const Host,
}

fn host_error(host: &Host) -> String {
    let mut len = 0usize;
    // SAFETY: the host table's functions are valid for the instance's
    // life; the returned bytes are valid until the next host call.
    let ptr = unsafe { (host.last_error)(host.ctx, &mut len) };
    if ptr.is_null() || len == 0 {
        return "(the host gave no message)".to_owned();
    }
    // SAFETY: as above, `len` bytes at `ptr`.
    String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(ptr, len) }).into_owned()
}

/// Runs one op; panics with the host's message when it fails.
pub fn call(host: *const Host, op: Op, tensors: &[u64], floats: &[f64], ints: &[i64], data: &[f32]) -> OpResult {
    // SAFETY: `host` points at the instance's copy of the host table.
    let h = unsafe { &*host };
    let args = OpArgs {
        tensors: tensors.as_ptr(),
        n_tensors: tensors.len(),
        floats: floats.as_ptr(),
        n_floats: floats.len(),
        ints: ints.as_ptr(),
        n_ints: ints.len(),
        data: data.as_ptr(),
        n_data: data.len(),
    };
    let mut out = OpResult::default();
    // SAFETY: arguments are valid for the call; `out` is writable.
    let status = unsafe { (h.op)(h.ctx, op as u32, &args, &mut out) };
    if status != STATUS_OK {
        panic!("host op {} failed: {}", op.wit_name(), host_error(h));
    }
    out
}

fn tensor_out(op: Op, out: &OpResult, i: usize) -> u64 {
    let t = out.tensors[i];
    assert!(t != 0, "host op {} failed: the host returned no tensor", op.wit_name());
    t
}

fn ints_out(out: &OpResult) -> Vec<i64> {
    if out.n_ints == 0 || out.ints.is_null() {
        return Vec::new();
    }
    // SAFETY: the host's ints are valid until its next call.
    unsafe { std::slice::from_raw_parts(out.ints, out.n_ints) }.to_vec()
}

impl Raw {
    fn op(&self, op: Op, more: &[&Raw], floats: &[f64], ints: &[i64]) -> OpResult {
        let mut handles = [0u64; 3];
        handles[0] = self.handle;
        for (slot, t) in handles[1..].iter_mut().zip(more) {
            *slot = t.handle;
        }
        call(self.host, op, &handles[..1 + more.len()], floats, ints, &[])
    }
    fn new_tensor(&self, op: Op, more: &[&Raw], floats: &[f64], ints: &[i64]) -> Raw {
        let out = self.op(op, more, floats, ints);
        Raw { handle: tensor_out(op, &out, 0), host: self.host }
    }
    fn scalar(&self, op: Op) -> f64 {
        self.op(op, &[], &[], &[]).scalar
    }
}

pub fn handle(t: &Raw) -> u64 {
    t.handle
}
pub fn release(t: &mut Raw) {
    if t.handle != 0 {
        // SAFETY: the plugin owns this handle; the host table is alive.
        unsafe {
            let h = &*t.host;
            (h.drop_tensor)(h.ctx, t.handle);
        }
        t.handle = 0;
    }
}

pub fn shape(t: &Raw) -> Vec<u64> {
    ints_out(&t.op(Op::Shape, &[], &[], &[])).into_iter().map(|d| d as u64).collect()
}
pub fn numel(t: &Raw) -> u64 {
    t.scalar(Op::Numel) as u64
}
pub fn dtype(t: &Raw) -> Dtype {
    let i = t.scalar(Op::Dtype);
    Dtype::from_index(i as u32).unwrap_or_else(|| panic!("host op tensor.dtype failed: unknown dtype index {i}"))
}
pub fn device(t: &Raw) -> Device {
    if t.scalar(Op::Device) == 0.0 {
        Device::Cpu
    } else {
        Device::Cuda
    }
}
pub fn assign(t: &Raw, src: &Raw) {
    t.op(Op::Assign, &[src], &[], &[]);
}

macro_rules! unary {
    ($($name:ident => $op:ident),* $(,)?) => {$(
        pub fn $name(t: &Raw) -> Raw {
            t.new_tensor(Op::$op, &[], &[], &[])
        }
    )*};
}
macro_rules! binary {
    ($($name:ident => $op:ident),* $(,)?) => {$(
        pub fn $name(t: &Raw, other: &Raw) -> Raw {
            t.new_tensor(Op::$op, &[other], &[], &[])
        }
    )*};
}
macro_rules! reduction {
    ($($name:ident => $op:ident),* $(,)?) => {$(
        pub fn $name(t: &Raw) -> f64 {
            t.scalar(Op::$op)
        }
    )*};
}
unary!(duplicate => Duplicate, abs => Abs, sign => Sign, floor => Floor, sqrt => Sqrt, orthonormalize => Orthonormalize,
    pack_signs => PackSigns);
binary!(add => Add, sub => Sub, mul => Mul, div => Div, less_than => LessThan, gather => Gather, matmul => Matmul);
reduction!(sum => Sum, norm => Norm, mean_abs => MeanAbs);

pub fn add_scalar(t: &Raw, s: f64) -> Raw {
    t.new_tensor(Op::AddScalar, &[], &[s], &[])
}
pub fn mul_scalar(t: &Raw, s: f64) -> Raw {
    t.new_tensor(Op::MulScalar, &[], &[s], &[])
}
pub fn cast(t: &Raw, to: Dtype) -> Raw {
    t.new_tensor(Op::Cast, &[], &[], &[to.index() as i64])
}
pub fn reshape(t: &Raw, shape: &[i64]) -> Raw {
    t.new_tensor(Op::Reshape, &[], &[], shape)
}
pub fn transpose(t: &Raw, a: u32, b: u32) -> Raw {
    t.new_tensor(Op::Transpose, &[], &[], &[a as i64, b as i64])
}
pub fn narrow(t: &Raw, dim: u32, start: u64, len: u64) -> Raw {
    t.new_tensor(Op::Narrow, &[], &[], &[dim as i64, start as i64, len as i64])
}
pub fn topk(t: &Raw, k: u64) -> (Raw, Raw) {
    let out = t.op(Op::Topk, &[], &[], &[k as i64]);
    let values = Raw { handle: tensor_out(Op::Topk, &out, 0), host: t.host };
    (values, Raw { handle: tensor_out(Op::Topk, &out, 1), host: t.host })
}
pub fn scatter_add(t: &Raw, index: &Raw, src: &Raw) -> Raw {
    t.new_tensor(Op::ScatterAdd, &[index, src], &[], &[])
}
pub fn read_f32(t: &Raw) -> Vec<f32> {
    let out = t.op(Op::ReadF32, &[], &[], &[]);
    if out.n_data == 0 || out.data.is_null() {
        return Vec::new();
    }
    // SAFETY: the host's data is valid until its next call.
    unsafe { std::slice::from_raw_parts(out.data, out.n_data) }.to_vec()
}

fn with_dims(first: i64, dims: &[u64]) -> Vec<i64> {
    std::iter::once(first).chain(dims.iter().map(|&d| d as i64)).collect()
}
pub fn zeros(shape: &[u64], dtype: Dtype, like: &Raw) -> Raw {
    like.new_tensor(Op::Zeros, &[], &[], &with_dims(dtype.index() as i64, shape))
}
pub fn rand_uniform(shape: &[u64], seed: u64, like: &Raw) -> Raw {
    like.new_tensor(Op::RandUniform, &[], &[], &with_dims(seed as i64, shape))
}
pub fn rand_normal(shape: &[u64], seed: u64, like: &Raw) -> Raw {
    like.new_tensor(Op::RandNormal, &[], &[], &with_dims(seed as i64, shape))
}
pub fn rand_indices(n: u64, k: u64, seed: u64, like: &Raw) -> Raw {
    like.new_tensor(Op::RandIndices, &[], &[], &[n as i64, k as i64, seed as i64])
}
pub fn from_f32(data: &[f32], shape: &[u64], like: &Raw) -> Raw {
    let ints: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    let out = call(like.host, Op::FromF32, &[like.handle], &[], &ints, data);
    Raw { handle: tensor_out(Op::FromF32, &out, 0), host: like.host }
}
pub fn unpack_signs(packed: &Raw, numel: u64) -> Raw {
    packed.new_tensor(Op::UnpackSigns, &[], &[], &[numel as i64])
}

pub fn rank(c: &RawComm) -> u32 {
    call(c.host, Op::Rank, &[], &[], &[], &[]).scalar as u32
}
pub fn world_size(c: &RawComm) -> u32 {
    call(c.host, Op::WorldSize, &[], &[], &[], &[]).scalar as u32
}
pub fn all_reduce_sum(c: &RawComm, t: &Raw) {
    call(c.host, Op::AllReduceSum, &[t.handle], &[], &[], &[]);
}
pub fn all_gather(c: &RawComm, t: &Raw) -> Raw {
    let out = call(c.host, Op::AllGather, &[t.handle], &[], &[], &[]);
    Raw { handle: tensor_out(Op::AllGather, &out, 0), host: t.host }
}
pub fn broadcast(c: &RawComm, t: &Raw, root: u32) {
    call(c.host, Op::Broadcast, &[t.handle], &[], &[root as i64], &[]);
}
pub fn reduce_scatter_sum(c: &RawComm, t: &Raw) -> Raw {
    let out = call(c.host, Op::ReduceScatterSum, &[t.handle], &[], &[], &[]);
    Raw { handle: tensor_out(Op::ReduceScatterSum, &out, 0), host: t.host }
}

pub fn log(level: Level, message: &str) {
    let host = CURRENT_HOST.with(Cell::get);
    if host.is_null() {
        // Outside a callback (a unit test of plugin code): stderr.
        eprintln!("[{level:?}] {message}");
        return;
    }
    // SAFETY: the current host table is alive during the callback.
    unsafe {
        let h = &*host;
        (h.log)(h.ctx, level as u32, message.as_ptr(), message.len());
    }
}
