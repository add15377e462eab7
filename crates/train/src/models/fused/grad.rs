//! The fused layers' way to their parameters' gradient buffers
//! ([`GradBuffer`]), and the gradients of their vector parameters handed
//! over through it ([`Sums`]).

use tch::{Kind, Tensor};

use harness_kernels::kernels;

/// A parameter's gradient buffer, claimed by the fused layer about to write
/// its gradient there: the only way a layer under `models/` reaches a
/// gradient buffer.
///
/// The data parallel code may leave the buffers unzeroed at a step's start,
/// marked stale ([`crate::stale`]): the step's first write to a buffer must
/// write over it, the later ones add (else the gradients come out wrong,
/// silently). [`GradBuffer::claim`] finds the buffer and takes its mark at
/// once, so a layer cannot write without knowing which write it is:
/// [`store`](GradBuffer::store) copies or adds as
/// [`first`](GradBuffer::first) says, [`for_adding`](GradBuffer::for_adding)
/// zeroes a stale buffer for a kernel that only adds, and a kernel that
/// takes the choice itself is told `first` with the buffer
/// ([`tensor`](GradBuffer::tensor), [`into_tensor`](GradBuffer::into_tensor)).
/// Claim a buffer only to write it then: the mark is gone once claimed.
/// Nothing else under `models/` reads `.grad()` or takes a mark outside
/// tests (`fused/tests/buffers.rs` checks the sources).
///
/// A layer that adds a gradient there itself hands autograd none for `p`.
/// `p`'s AccumulateGrad node still runs, after the backward pass of every
/// use of `p` (so after this one), and runs the post-accumulate-grad hook
/// (the data parallel code's signal that the gradient is complete) with or
/// without a gradient to add (libtorch 2.11's `AccumulateGrad::apply`; the
/// tests pin one call per backward pass). A parameter used elsewhere too
/// (the tied embedding) gets the other uses' gradients through it as usual.
#[must_use = "a claimed buffer's stale mark is taken: write it"]
pub(super) struct GradBuffer {
    g: Tensor,
    first: bool,
}

impl GradBuffer {
    /// `p`'s gradient buffer, claimed for writing, when it has one that a
    /// fused layer can write into directly: `.grad` defined, fp32,
    /// contiguous, of `p`'s shape (the data parallel code keeps each
    /// parameter's as a view of its bucket).
    pub(super) fn claim(p: &Tensor) -> Option<GradBuffer> {
        find(p).map(GradBuffer::take)
    }

    /// The buffers of all of `params` (in order), claimed, where every one
    /// has one ([`GradBuffer::claim`]); else none, and no mark taken.
    pub(super) fn claim_all(params: &[&Tensor]) -> Option<Vec<GradBuffer>> {
        let found: Option<Vec<Tensor>> = params.iter().map(|p| find(p)).collect();
        Some(found?.into_iter().map(GradBuffer::take).collect())
    }

    /// The claim of found buffer `g`: the one place that takes a stale mark.
    fn take(g: Tensor) -> GradBuffer {
        let first = crate::stale::take(&g);
        GradBuffer { g, first }
    }

    /// Whether this is the step's first write to a stale buffer: it writes
    /// over the buffer rather than adding into it.
    pub(super) fn first(&self) -> bool {
        self.first
    }

    /// The buffer, for a kernel told [`first`](GradBuffer::first) (it writes
    /// over the buffer where it is true, else adds).
    pub(super) fn tensor(&self) -> &Tensor {
        &self.g
    }

    /// The buffer, for a kernel told [`first`](GradBuffer::first), as
    /// [`tensor`](GradBuffer::tensor).
    pub(super) fn into_tensor(self) -> Tensor {
        self.g
    }

    /// `g` added into the buffer, or copied over it where
    /// [`first`](GradBuffer::first).
    pub(super) fn store(self, g: &Tensor) -> anyhow::Result<()> {
        let mut b = self.g.shallow_clone();
        if self.first {
            b.f_copy_(g)?;
        } else {
            let _ = b.f_add_(g)?;
        }
        Ok(())
    }

    /// The buffer for a writer that only adds into it (atomic adds): zeroed
    /// first where [`first`](GradBuffer::first).
    pub(super) fn for_adding(self) -> anyhow::Result<Tensor> {
        if self.first {
            let _ = self.g.shallow_clone().f_zero_()?;
        }
        Ok(self.g)
    }
}

/// `p`'s gradient buffer where a fused layer can write into it
/// ([`GradBuffer::claim`]), its stale mark not taken.
fn find(p: &Tensor) -> Option<Tensor> {
    let g = p.grad();
    (g.defined() && g.kind() == Kind::Float && g.size() == p.size() && g.is_contiguous()).then_some(g)
}

/// The gradients of a fused layer's vector parameters (LayerNorm's weight
/// and bias, a bias), as the backward kernels leave them: per-block partial
/// sums on CUDA, finished vectors from the reference.
pub(super) enum Sums {
    Partials(kernels::Partials),
    Tensors(Vec<Tensor>),
}

impl Sums {
    /// Hands the gradients of `params` (in order) over. Where every one has
    /// a gradient buffer ([`GradBuffer::claim_all`]), adds them in there
    /// directly (on CUDA, reducing the partial sums and adding in one
    /// launch, against a reduction, a memset and an add each through
    /// autograd) and returns no gradients for autograd; else returns them.
    pub(super) fn deliver(self, params: &[&Tensor]) -> anyhow::Result<Vec<Option<Tensor>>> {
        let Some(buffers) = GradBuffer::claim_all(params) else {
            return Ok(match self {
                Sums::Partials(part) => {
                    let sums = part.sums()?;
                    (0..params.len()).map(|i| Some(sums.get(i as i64))).collect()
                }
                Sums::Tensors(ts) => ts.into_iter().map(Some).collect(),
            });
        };
        // A buffer the step has not written yet is written over, not added to.
        match self {
            Sums::Partials(part) => {
                let first: Vec<bool> = buffers.iter().map(GradBuffer::first).collect();
                part.store_into(&buffers.iter().map(GradBuffer::tensor).collect::<Vec<_>>(), &first)?
            }
            Sums::Tensors(ts) => {
                for (g, t) in buffers.into_iter().zip(&ts) {
                    g.store(t)?;
                }
            }
        }
        Ok(params.iter().map(|_| None).collect())
    }
}
