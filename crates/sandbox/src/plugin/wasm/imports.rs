//! The contract's imports (`types`, `tensor`, `collective`, `log`) as host
//! functions, for each contract version the host loads: the same functions,
//! generated once per version's bindings by `imports!`. Every one of them
//! runs a host op of `HostSide` (`ops.rs`).

use harness_sdk::abi::Op;
use wasmtime::component::Resource;

use super::super::ops::KINDS;
use super::{State, TensorRes};

/// One contract version's worlds bound from its WIT package at `$path`:
/// the compressor's (which defines the shared `log`, `types` and `tensor`
/// interfaces, the tensor resource as the host's `TensorRes`), then each
/// policy world `$module: $world` bound against those same interfaces.
macro_rules! worlds {
    ($path:tt, $($module:ident: $world:tt),*) => {
        pub mod compressor {
            wasmtime::component::bindgen!({
                path: $path,
                world: "compressor",
                imports: { default: trappable },
                with: { "harness:strategy/tensor.tensor": crate::plugin::wasm::TensorRes },
                anyhow: true,
            });
        }
        $(
            pub mod $module {
                wasmtime::component::bindgen!({
                    path: $path,
                    world: $world,
                    imports: { default: trappable },
                    with: {
                        "harness:strategy/log": super::compressor::harness::strategy::log,
                        "harness:strategy/types": super::compressor::harness::strategy::types,
                    },
                    anyhow: true,
                });
            }
        )*
    };
}

#[allow(missing_docs, clippy::all)]
pub(super) mod bindings {
    /// Contract 0.1 (`sdk/wit-0.1`): loaded as it was.
    pub mod v0_1 {
        worlds!(
            "../../sdk/wit-0.1",
            batch_policy: "batch-policy",
            checkpoint_policy: "checkpoint-policy",
            tiered_checkpoint_policy: "tiered-checkpoint-policy"
        );
    }

    /// Contract 0.2 (`sdk/wit`), the SDK's.
    pub mod v0_2 {
        worlds!("../../sdk/wit", batch_policy: "batch-policy", checkpoint_policy: "checkpoint-policy");
    }
}

/// Contract 0.1's imported interfaces.
pub(super) mod v0_1 {
    pub use super::bindings::v0_1::compressor::harness::strategy::*;
}
/// Contract 0.2's imported interfaces.
pub(super) mod v0_2 {
    pub use super::bindings::v0_2::compressor::harness::strategy::*;
}

pub(super) type R<T> = anyhow::Result<T>;
pub(super) type T = Resource<TensorRes>;

pub(super) fn own(id: u32) -> T {
    Resource::new_own(id)
}

fn u64s(v: &[u64]) -> Vec<i64> {
    v.iter().map(|&x| x.min(i64::MAX as u64) as i64).collect()
}

impl State {
    fn one(&mut self, op: Op, ids: &[u32], floats: &[f64], ints: &[i64]) -> R<T> {
        Ok(own(self.host.exec(op, ids, floats, ints, &[])?.ids[0]))
    }
    fn scalar(&mut self, op: Op, ids: &[u32]) -> R<f64> {
        Ok(self.host.exec(op, ids, &[], &[], &[])?.scalar)
    }
}

const _: () = assert!(KINDS.len() == 8);

/// The host functions of one contract version's imports (`$m`: its
/// interfaces), with its dtype conversions in module `$glue`.
macro_rules! imports {
    ($m:ident, $glue:ident) => {
        pub(crate) mod $glue {
            use super::*;

            /// The WIT `step-telemetry`.
            pub(crate) fn telemetry(t: &crate::strategy::StepTelemetry) -> $m::types::StepTelemetry {
                $m::types::StepTelemetry {
                    step: t.step,
                    loss: t.loss,
                    step_time_s: t.step_time_s,
                    elapsed_s: t.elapsed_s,
                    memory_used_bytes: t.memory_used_bytes,
                    memory_total_bytes: t.memory_total_bytes,
                    tokens_per_s: t.tokens_per_s,
                    micro_batch: t.micro_batch,
                    accum_steps: t.accum_steps,
                    world_size: t.world_size,
                    grad_sq_norm: t.grad_sq_norm,
                    local_grad_sq_norm: t.local_grad_sq_norm,
                    out_of_memory: t.out_of_memory,
                }
            }

            pub(crate) fn dtype_to_wit(i: usize) -> $m::types::Dtype {
                use $m::types::Dtype::*;
                [F32, F16, Bf16, F64, I64, I32, U8, Boolean][i]
            }

            pub(crate) fn dtype_from_wit(d: $m::types::Dtype) -> i64 {
                use $m::types::Dtype::*;
                match d {
                    F32 => 0,
                    F16 => 1,
                    Bf16 => 2,
                    F64 => 3,
                    I64 => 4,
                    I32 => 5,
                    U8 => 6,
                    Boolean => 7,
                }
            }
        }

        impl $m::types::Host for State {}

        impl $m::tensor::HostTensor for State {
            fn shape(&mut self, s: T) -> R<Vec<u64>> {
                Ok(self.host.exec(Op::Shape, &[s.rep()], &[], &[], &[])?.ints.into_iter().map(|d| d as u64).collect())
            }
            fn numel(&mut self, s: T) -> R<u64> {
                Ok(self.scalar(Op::Numel, &[s.rep()])? as u64)
            }
            fn dtype(&mut self, s: T) -> R<$m::types::Dtype> {
                Ok($glue::dtype_to_wit(self.scalar(Op::Dtype, &[s.rep()])? as usize))
            }
            fn device(&mut self, s: T) -> R<$m::types::DeviceKind> {
                Ok(if self.scalar(Op::Device, &[s.rep()])? == 1.0 { $m::types::DeviceKind::Cuda } else { $m::types::DeviceKind::Cpu })
            }
            fn assign(&mut self, s: T, src: T) -> R<()> {
                self.host.exec(Op::Assign, &[s.rep(), src.rep()], &[], &[], &[])?;
                Ok(())
            }
            fn duplicate(&mut self, s: T) -> R<T> {
                self.one(Op::Duplicate, &[s.rep()], &[], &[])
            }
            fn add(&mut self, s: T, o: T) -> R<T> {
                self.one(Op::Add, &[s.rep(), o.rep()], &[], &[])
            }
            fn sub(&mut self, s: T, o: T) -> R<T> {
                self.one(Op::Sub, &[s.rep(), o.rep()], &[], &[])
            }
            fn mul(&mut self, s: T, o: T) -> R<T> {
                self.one(Op::Mul, &[s.rep(), o.rep()], &[], &[])
            }
            fn div(&mut self, s: T, o: T) -> R<T> {
                self.one(Op::Div, &[s.rep(), o.rep()], &[], &[])
            }
            fn add_scalar(&mut self, s: T, x: f64) -> R<T> {
                self.one(Op::AddScalar, &[s.rep()], &[x], &[])
            }
            fn mul_scalar(&mut self, s: T, x: f64) -> R<T> {
                self.one(Op::MulScalar, &[s.rep()], &[x], &[])
            }
            fn abs(&mut self, s: T) -> R<T> {
                self.one(Op::Abs, &[s.rep()], &[], &[])
            }
            fn sign(&mut self, s: T) -> R<T> {
                self.one(Op::Sign, &[s.rep()], &[], &[])
            }
            fn floor(&mut self, s: T) -> R<T> {
                self.one(Op::Floor, &[s.rep()], &[], &[])
            }
            fn sqrt(&mut self, s: T) -> R<T> {
                self.one(Op::Sqrt, &[s.rep()], &[], &[])
            }
            fn less_than(&mut self, s: T, o: T) -> R<T> {
                self.one(Op::LessThan, &[s.rep(), o.rep()], &[], &[])
            }
            fn cast(&mut self, s: T, to: $m::types::Dtype) -> R<T> {
                self.one(Op::Cast, &[s.rep()], &[], &[$glue::dtype_from_wit(to)])
            }
            fn reshape(&mut self, s: T, shape: Vec<i64>) -> R<T> {
                self.one(Op::Reshape, &[s.rep()], &[], &shape)
            }
            fn transpose(&mut self, s: T, a: u32, b: u32) -> R<T> {
                self.one(Op::Transpose, &[s.rep()], &[], &[a as i64, b as i64])
            }
            fn narrow(&mut self, s: T, dim: u32, start: u64, len: u64) -> R<T> {
                self.one(Op::Narrow, &[s.rep()], &[], &[dim as i64, start.min(i64::MAX as u64) as i64, len.min(i64::MAX as u64) as i64])
            }
            fn topk(&mut self, s: T, k: u64) -> R<(T, T)> {
                let o = self.host.exec(Op::Topk, &[s.rep()], &[], &[k.min(i64::MAX as u64) as i64], &[])?;
                Ok((own(o.ids[0]), own(o.ids[1])))
            }
            fn gather(&mut self, s: T, index: T) -> R<T> {
                self.one(Op::Gather, &[s.rep(), index.rep()], &[], &[])
            }
            fn scatter_add(&mut self, s: T, index: T, src: T) -> R<T> {
                self.one(Op::ScatterAdd, &[s.rep(), index.rep(), src.rep()], &[], &[])
            }
            fn sum(&mut self, s: T) -> R<f64> {
                self.scalar(Op::Sum, &[s.rep()])
            }
            fn norm(&mut self, s: T) -> R<f64> {
                self.scalar(Op::Norm, &[s.rep()])
            }
            fn mean_abs(&mut self, s: T) -> R<f64> {
                self.scalar(Op::MeanAbs, &[s.rep()])
            }
            fn matmul(&mut self, s: T, o: T) -> R<T> {
                self.one(Op::Matmul, &[s.rep(), o.rep()], &[], &[])
            }
            fn orthonormalize(&mut self, s: T) -> R<T> {
                self.one(Op::Orthonormalize, &[s.rep()], &[], &[])
            }
            fn pack_signs(&mut self, s: T) -> R<T> {
                self.one(Op::PackSigns, &[s.rep()], &[], &[])
            }
            fn read_f32(&mut self, s: T) -> R<Vec<f32>> {
                Ok(self.host.exec(Op::ReadF32, &[s.rep()], &[], &[], &[])?.data)
            }
            fn drop(&mut self, s: T) -> R<()> {
                self.host.remove(s.rep());
                Ok(())
            }
        }

        impl $m::tensor::Host for State {
            fn zeros(&mut self, shape: Vec<u64>, dtype: $m::types::Dtype, like: T) -> R<T> {
                let mut ints = vec![$glue::dtype_from_wit(dtype)];
                ints.extend(u64s(&shape));
                self.one(Op::Zeros, &[like.rep()], &[], &ints)
            }
            fn rand_uniform(&mut self, shape: Vec<u64>, seed: u64, like: T) -> R<T> {
                let mut ints = vec![seed as i64];
                ints.extend(u64s(&shape));
                self.one(Op::RandUniform, &[like.rep()], &[], &ints)
            }
            fn rand_normal(&mut self, shape: Vec<u64>, seed: u64, like: T) -> R<T> {
                let mut ints = vec![seed as i64];
                ints.extend(u64s(&shape));
                self.one(Op::RandNormal, &[like.rep()], &[], &ints)
            }
            fn rand_indices(&mut self, n: u64, k: u64, seed: u64, like: T) -> R<T> {
                self.one(Op::RandIndices, &[like.rep()], &[], &[n.min(i64::MAX as u64) as i64, k.min(i64::MAX as u64) as i64, seed as i64])
            }
            fn from_f32(&mut self, data: Vec<f32>, shape: Vec<u64>, like: T) -> R<T> {
                Ok(own(self.host.exec(Op::FromF32, &[like.rep()], &[], &u64s(&shape), &data)?.ids[0]))
            }
            fn unpack_signs(&mut self, packed: T, numel: u64) -> R<T> {
                self.one(Op::UnpackSigns, &[packed.rep()], &[], &[numel.min(i64::MAX as u64) as i64])
            }
        }

        impl $m::collective::Host for State {
            fn rank(&mut self) -> R<u32> {
                Ok(self.scalar(Op::Rank, &[])? as u32)
            }
            fn world_size(&mut self) -> R<u32> {
                Ok(self.scalar(Op::WorldSize, &[])? as u32)
            }
            fn all_reduce_sum(&mut self, t: T) -> R<()> {
                self.host.exec(Op::AllReduceSum, &[t.rep()], &[], &[], &[])?;
                Ok(())
            }
            fn all_gather(&mut self, t: T) -> R<T> {
                self.one(Op::AllGather, &[t.rep()], &[], &[])
            }
            fn broadcast(&mut self, t: T, root: u32) -> R<()> {
                self.host.exec(Op::Broadcast, &[t.rep()], &[], &[root as i64], &[])?;
                Ok(())
            }
            fn reduce_scatter_sum(&mut self, t: T) -> R<T> {
                self.one(Op::ReduceScatterSum, &[t.rep()], &[], &[])
            }
        }

        impl $m::log::Host for State {
            fn write(&mut self, level: $m::log::Level, message: String) -> R<()> {
                super::super::log_line(&self.host.log, &self.host.name, level as u32, &message);
                Ok(())
            }
        }
    };
}

imports!(v0_1, v0_1_glue);
imports!(v0_2, v0_2_glue);
