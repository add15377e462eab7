//! Layers computed by harness's own kernels (the workload's `kernels =
//! "fused"`), as autograd nodes: the forward and backward passes are
//! written out, not recorded op by op.
//!
//! [`add_norm`] is a residual add followed by LayerNorm, the junction that
//! appears twice in every pre-norm transformer block: `x' = x + f` (the fp32
//! residual stream plus a bf16 branch output) and `y = LayerNorm(x')` in
//! bf16, the input of the next matmul. libtorch under autocast runs it as
//! five kernels forward (add, an fp32 LayerNorm, a cast to bf16) and as
//! many backward (cast, two LayerNorm kernels, two adds); the fused form is
//! one kernel each way, reading and writing each row once.
//!
//! The same maths in libtorch operations
//! ([`Engine::Reference`](engine::Engine::Reference)) runs on the CPU: the
//! tests check the backward pass written out against autograd's there, and
//! the CUDA kernels against it on a GPU.
//!
//! One module per layer family: `norm` (residual adds with LayerNorm or
//! RMS normalisation), `dense` (linear layers, the attention's q, k, v
//! projection), `ffn` (the MLP, the bias and GELU), `embedding` (token and
//! position embeddings, tied to the output layer), `conv` (batch norm and
//! max pooling, channels-last); `gemm` holds the matmuls and the step's
//! weight casts they share, `engine` what else they share, and `grad` the
//! one way a layer reaches a parameter's gradient buffer
//! ([`grad::GradBuffer`]). This file only declares them and names what
//! other modules call.

mod conv;
mod dense;
mod embedding;
mod engine;
mod ffn;
mod gemm;
mod grad;
mod norm;
#[cfg(test)]
mod tests;

pub use conv::{batch_norm_act, batch_norm_cuda_fits, channels_last, is_channels_last, libtorch_max_pool, max_pool, BatchNormParams};
#[cfg(test)]
pub(crate) use dense::reference_linear;
pub use dense::{linear, qkv, qkv_cuda_fits, tied_linear};
pub use embedding::{embed, embed_cuda_fits, Tie};
pub use engine::{EPS, RMS_EPS};
pub use ffn::{bias_gelu, gelu_cuda_fits, mlp, mlp_cuda_fits};
pub use gemm::{params_ready, WeightCasts};
pub use norm::{add_norm, add_rms_norm, cuda_fits, post_norm, post_norm_cuda_fits, post_norm_on, rms_cuda_fits};

/// An MLP's activation ([`mlp`]).
pub use harness_kernels::blaslt::Act;

/// A max pooling's window ([`max_pool`]).
pub use harness_kernels::kernels::Pool;
