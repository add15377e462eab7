//! The WASM transport: every op is an import of the `harness:strategy`
//! worlds (generated in `__wasm::compressor`).

use std::mem::ManuallyDrop;

use crate::__wasm::compressor::harness::strategy::{collective, log as wit_log, tensor as wit, types};
use crate::types::{Device, Dtype, Level};

/// The generated resource handle; dropped only when the facade owns it.
pub struct Raw(pub ManuallyDrop<wit::Tensor>);

/// Collectives are free functions of the import.
pub struct RawComm;

impl Raw {
    pub fn new(t: wit::Tensor) -> Raw {
        Raw(ManuallyDrop::new(t))
    }
    /// A handle that the host lent to this call.
    pub fn lent(t: &wit::Tensor) -> Raw {
        // SAFETY: the facade marks it borrowed and never drops it.
        Raw(ManuallyDrop::new(unsafe { wit::Tensor::from_handle(t.handle()) }))
    }
}

fn to_wit(d: Dtype) -> types::Dtype {
    match d {
        Dtype::F32 => types::Dtype::F32,
        Dtype::F16 => types::Dtype::F16,
        Dtype::Bf16 => types::Dtype::Bf16,
        Dtype::F64 => types::Dtype::F64,
        Dtype::I64 => types::Dtype::I64,
        Dtype::I32 => types::Dtype::I32,
        Dtype::U8 => types::Dtype::U8,
        Dtype::Bool => types::Dtype::Boolean,
    }
}

pub(crate) fn from_wit(d: types::Dtype) -> Dtype {
    match d {
        types::Dtype::F32 => Dtype::F32,
        types::Dtype::F16 => Dtype::F16,
        types::Dtype::Bf16 => Dtype::Bf16,
        types::Dtype::F64 => Dtype::F64,
        types::Dtype::I64 => Dtype::I64,
        types::Dtype::I32 => Dtype::I32,
        types::Dtype::U8 => Dtype::U8,
        types::Dtype::Boolean => Dtype::Bool,
    }
}

pub fn handle(t: &Raw) -> u64 {
    t.0.handle() as u64
}
pub fn release(t: &mut Raw) {
    // SAFETY: called once, from the owning facade's Drop.
    unsafe { ManuallyDrop::drop(&mut t.0) }
}

pub fn shape(t: &Raw) -> Vec<u64> {
    t.0.shape()
}
pub fn numel(t: &Raw) -> u64 {
    t.0.numel()
}
pub fn dtype(t: &Raw) -> Dtype {
    from_wit(t.0.dtype())
}
pub fn device(t: &Raw) -> Device {
    match t.0.device() {
        types::DeviceKind::Cpu => Device::Cpu,
        types::DeviceKind::Cuda => Device::Cuda,
    }
}
pub fn assign(t: &Raw, src: &Raw) {
    t.0.assign(&src.0)
}

macro_rules! unary {
    ($($name:ident),* $(,)?) => {$(
        pub fn $name(t: &Raw) -> Raw {
            Raw::new(t.0.$name())
        }
    )*};
}
macro_rules! binary {
    ($($name:ident),* $(,)?) => {$(
        pub fn $name(t: &Raw, other: &Raw) -> Raw {
            Raw::new(t.0.$name(&other.0))
        }
    )*};
}
macro_rules! reduction {
    ($($name:ident),* $(,)?) => {$(
        pub fn $name(t: &Raw) -> f64 {
            t.0.$name()
        }
    )*};
}
unary!(duplicate, abs, sign, floor, sqrt, orthonormalize, pack_signs);
binary!(add, sub, mul, div, less_than, gather, matmul);
reduction!(sum, norm, mean_abs);

pub fn add_scalar(t: &Raw, s: f64) -> Raw {
    Raw::new(t.0.add_scalar(s))
}
pub fn mul_scalar(t: &Raw, s: f64) -> Raw {
    Raw::new(t.0.mul_scalar(s))
}
pub fn cast(t: &Raw, to: Dtype) -> Raw {
    Raw::new(t.0.cast(to_wit(to)))
}
pub fn reshape(t: &Raw, shape: &[i64]) -> Raw {
    Raw::new(t.0.reshape(shape))
}
pub fn transpose(t: &Raw, a: u32, b: u32) -> Raw {
    Raw::new(t.0.transpose(a, b))
}
pub fn narrow(t: &Raw, dim: u32, start: u64, len: u64) -> Raw {
    Raw::new(t.0.narrow(dim, start, len))
}
pub fn topk(t: &Raw, k: u64) -> (Raw, Raw) {
    let (values, indices) = t.0.topk(k);
    (Raw::new(values), Raw::new(indices))
}
pub fn scatter_add(t: &Raw, index: &Raw, src: &Raw) -> Raw {
    Raw::new(t.0.scatter_add(&index.0, &src.0))
}
pub fn read_f32(t: &Raw) -> Vec<f32> {
    t.0.read_f32()
}

pub fn zeros(shape: &[u64], dtype: Dtype, like: &Raw) -> Raw {
    Raw::new(wit::zeros(shape, to_wit(dtype), &like.0))
}
pub fn rand_uniform(shape: &[u64], seed: u64, like: &Raw) -> Raw {
    Raw::new(wit::rand_uniform(shape, seed, &like.0))
}
pub fn rand_normal(shape: &[u64], seed: u64, like: &Raw) -> Raw {
    Raw::new(wit::rand_normal(shape, seed, &like.0))
}
pub fn rand_indices(n: u64, k: u64, seed: u64, like: &Raw) -> Raw {
    Raw::new(wit::rand_indices(n, k, seed, &like.0))
}
pub fn from_f32(data: &[f32], shape: &[u64], like: &Raw) -> Raw {
    Raw::new(wit::from_f32(data, shape, &like.0))
}
pub fn unpack_signs(packed: &Raw, numel: u64) -> Raw {
    Raw::new(wit::unpack_signs(&packed.0, numel))
}

pub fn rank(_: &RawComm) -> u32 {
    collective::rank()
}
pub fn world_size(_: &RawComm) -> u32 {
    collective::world_size()
}
pub fn all_reduce_sum(_: &RawComm, t: &Raw) {
    collective::all_reduce_sum(&t.0)
}
pub fn all_gather(_: &RawComm, t: &Raw) -> Raw {
    Raw::new(collective::all_gather(&t.0))
}
pub fn broadcast(_: &RawComm, t: &Raw, root: u32) {
    collective::broadcast(&t.0, root)
}
pub fn reduce_scatter_sum(_: &RawComm, t: &Raw) -> Raw {
    Raw::new(collective::reduce_scatter_sum(&t.0))
}

pub fn log(level: Level, message: &str) {
    let level = match level {
        Level::Debug => wit_log::Level::Debug,
        Level::Info => wit_log::Level::Info,
        Level::Warn => wit_log::Level::Warn,
    };
    wit_log::write(level, message)
}
