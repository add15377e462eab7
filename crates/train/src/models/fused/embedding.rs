//! GPT-2's token and position embeddings as one node ([`embed`]), and the
//! [`Tie`] between its table and the output layer that shares it.

use tch::{Kind, Tensor};

use harness_kernels::kernels;
use harness_kernels::torch_ext::{self, CustomOp};

use super::engine::{aligned, engine, Engine};
use super::grad::GradBuffer;

/// The link between a tied embedding's two uses of its table in one forward
/// pass ([`embed`] and [`tied_linear`](super::tied_linear)): the output layer's
/// backward pass, which runs first, leaves the table's dense gradient here
/// (where the table has no gradient buffer) instead of handing it to autograd;
/// the embedding's backward pass adds its rows into it and hands autograd the
/// sum. Autograd would otherwise sum a dense gradient from each use: a
/// zero-filled table, a scatter into it, and an add of two tables (about 0.5 ms
/// per step for GPT-2 124M on an H100).
#[derive(Clone, Default)]
pub struct Tie(std::sync::Arc<std::sync::Mutex<Option<Tensor>>>);

impl Tie {
    /// Leaves the output layer's gradient for the embedding (returns none
    /// for autograd).
    pub(super) fn put(&self, g: Tensor) -> Option<Tensor> {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(g);
        None
    }

    /// The output layer's gradient, if its backward pass left one.
    fn take(&self) -> Option<Tensor> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// Token plus position embeddings: the autograd node behind [`embed`].
/// Inputs `[idx, wte, wpe]`, output `[x]`, kept `[idx, wte, wpe]`.
struct Embed {
    engine: Engine,
    tie: Tie,
}

impl CustomOp for Embed {
    fn forward(&self, inputs: &[Tensor]) -> anyhow::Result<(Vec<Tensor>, Vec<Tensor>)> {
        let [idx, wte, wpe] = inputs else { anyhow::bail!("embed: {} inputs", inputs.len()) };
        let t = idx.size2()?.1;
        let x = if self.engine == Engine::Cuda && aligned(&[wte, wpe]) {
            kernels::embed(idx, wte, wpe)?
        } else {
            Tensor::f_embedding(wte, idx, -1, false, false)? + wpe.narrow(0, 0, t)
        };
        Ok((vec![x], vec![idx.shallow_clone(), wte.shallow_clone(), wpe.shallow_clone()]))
    }

    fn backward(&self, saved: &[Tensor], grads: &[Option<Tensor>]) -> anyhow::Result<Vec<Option<Tensor>>> {
        let ([idx, wte, wpe], [dx]) = (saved, grads) else { anyhow::bail!("embed: {} kept, {} gradients", saved.len(), grads.len()) };
        let head = self.tie.take();
        let Some(dx) = dx else { return Ok(vec![None, head, None]) };
        let t = idx.size2()?.1;
        // The table's gradient: its buffer (where the output layer has
        // already added its part), else the output layer's, else zeros.
        let (gwte, wte_out) = match (GradBuffer::claim(wte), head) {
            // The kernel adds the rows: a stale buffer gets the output
            // layer's part or zeros first.
            (Some(g), Some(h)) => {
                let gwte = g.tensor().shallow_clone();
                g.store(&h)?;
                (gwte, None)
            }
            (Some(g), None) => (g.for_adding()?, None),
            (None, Some(h)) => (h.shallow_clone(), Some(h)),
            (None, None) => {
                let z = wte.zeros_like();
                (z.shallow_clone(), Some(z))
            }
        };
        // Positions beyond the sequence get no gradient: the kernel writes
        // the first t rows, so a fresh tensor is zeroed where t is shorter.
        let (gwpe, wpe_out, assign) = match GradBuffer::claim(wpe) {
            // A stale buffer: the kernel writes the first t rows over it,
            // and the rest are zeroed where t is shorter.
            Some(g) if g.first() => {
                let g = g.into_tensor();
                if t < wpe.size()[0] {
                    let _ = g.narrow(0, t, wpe.size()[0] - t).f_zero_()?;
                }
                (g, None, true)
            }
            Some(g) => (g.into_tensor(), None, false),
            None if t == wpe.size()[0] => {
                let g = wpe.empty_like();
                (g.shallow_clone(), Some(g), true)
            }
            None => {
                let g = wpe.zeros_like();
                (g.shallow_clone(), Some(g), false)
            }
        };
        match self.engine {
            Engine::Cuda if aligned(&[&gwte, &gwpe]) => kernels::embed_backward(idx, dx, &gwte, &gwpe, assign)?,
            _ => {
                let c = gwte.size()[1];
                let d = dx.to_kind(Kind::Float);
                let _ = gwte.shallow_clone().f_index_add_(0, &idx.reshape([-1]), &d.reshape([-1, c]))?;
                let mut rows = gwpe.narrow(0, 0, t);
                let sum = d.sum_dim_intlist(0, false, Kind::Float);
                if assign {
                    rows.copy_(&sum);
                } else {
                    let _ = rows.f_add_(&sum)?;
                }
            }
        }
        Ok(vec![None, wte_out, wpe_out])
    }
}

/// Whether [`embed`] runs on CUDA for tables of `c` channels on this
/// device (else a caller keeps libtorch's embeddings).
/// `HARNESS_FUSED_EMBED=0` keeps libtorch's (a diagnostic).
pub fn embed_cuda_fits(c: i64, device: tch::Device) -> bool {
    harness_format::switches::get().fused_embed && device.is_cuda() && kernels::embed_fits(c)
}

/// `wte[idx] + wpe[..t]` for int64 tokens `idx` `[b, t]`: fp32 `[b, t, c]` (the
/// token and position embeddings of GPT-2, before dropout), as one autograd
/// node, and the [`Tie`] for an output layer that shares `wte`
/// ([`tied_linear`](super::tied_linear)). On CUDA ([`embed_cuda_fits`]) one
/// kernel each way: the backward pass adds each token's row into the table's
/// gradient by atomic adds and sums the positions' over the batch. Elsewhere
/// the same maths in libtorch operations.
pub fn embed(idx: &Tensor, wte: &Tensor, wpe: &Tensor) -> (Tensor, Tie) {
    embed_with(engine(), idx, wte, wpe)
}

/// [`embed`]'s autograd node on `engine`.
pub(super) fn embed_with(engine: Engine, idx: &Tensor, wte: &Tensor, wpe: &Tensor) -> (Tensor, Tie) {
    let tie = Tie::default();
    let op = Embed { engine, tie: tie.clone() };
    let idx = idx.to_kind(Kind::Int64).contiguous();
    let out = torch_ext::custom_op(op, &[&idx, wte, wpe]).unwrap_or_else(|e| panic!("{e}"));
    (out[0].shallow_clone(), tie)
}
