//! The models of the training core, written with `tch`.
//!
//! * `gpt`: decoder-only transformer as GPT-2 (pre-LayerNorm, learned
//!   positions, GELU(tanh), tied embedding), causal attention through
//!   `scaled_dot_product_attention` (flash / memory-efficient kernels on CUDA).
//! * `encoder`: `nn.TransformerEncoder` (post-LayerNorm, ReLU, batch first)
//!   with a mean-pool regression head (the TransformerEncoder regression
//!   benchmark of docs/benchmarks.md).
//! * `mlp`: a token MLP that predicts the next token from the current one.
//! * `vision`: ResNet and ViT image classifiers ([`vision`]).
//!
//! Activation recomputation (the workload's `recompute`) wraps a layer in
//! [`torch_ext::recompute`]: its activations are dropped after the forward
//! pass and computed again in the backward pass. A layer is a GPT block, an
//! encoder layer, or the MLP's hidden layer.

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

pub use harness_format::suite::ModelConfig;
use harness_format::suite::{ModelKind, Recompute};
use harness_kernels::torch_ext;
pub mod fused;
pub mod layers;
pub mod t5;
pub mod vision;

pub use layers::token_loss;
use layers::{linear, residual, share, Branch, Norm, Shape};

pub struct GptBlock {
    ln1: Norm,
    c_attn: nn::Linear,
    attn_proj: nn::Linear,
    ln2: Norm,
    c_fc: nn::Linear,
    mlp_proj: nn::Linear,
}

impl GptBlock {
    fn forward(&self, x: &Tensor, s: &Shape) -> Tensor {
        let (x, f) = self.forward_pending(x, None, s);
        residual(&x, f.value())
    }

    /// The block on the residual stream `x` plus the previous block's
    /// pending MLP output `f`, which is added here, in the same kernel as
    /// the first LayerNorm when fused: returns the stream before this
    /// block's MLP output, and that output (pending for the next block).
    fn forward_pending(&self, x: &Tensor, f: Option<&Branch>, s: &Shape) -> (Tensor, Branch) {
        let (x, h) = self.ln1.add_forward(x, f, s.fused);
        let y = s.qkv_attention(&self.c_attn, &h, true);
        let (x, h) = self.ln2.add_forward(&x, Some(&s.project(&self.attn_proj, &y)), s.fused);
        (x, s.mlp(&self.c_fc, &self.mlp_proj, &h))
    }

    /// Its parameters, for [`fused::params_ready`].
    fn params(&self) -> Vec<&Tensor> {
        let mut ps = self.ln1.params();
        for l in [&self.c_attn, &self.attn_proj, &self.c_fc, &self.mlp_proj] {
            ps.push(&l.ws);
            ps.extend(l.bs.as_ref());
        }
        ps.extend(self.ln2.params());
        ps
    }

    fn share(&self) -> GptBlock {
        GptBlock {
            ln1: self.ln1.share(),
            c_attn: share(&self.c_attn),
            attn_proj: share(&self.attn_proj),
            ln2: self.ln2.share(),
            c_fc: share(&self.c_fc),
            mlp_proj: share(&self.mlp_proj),
        }
    }
}

/// One `nn.TransformerEncoderLayer` (post-norm). With the fused kernels
/// its attention is [`layers::qkv_attention`]'s, its feed-forward block one
/// [`fused::mlp`] node (the ReLU in cuBLASLt's epilogues), its other linear
/// layers [`fused::linear`]'s nodes, and each residual add with its
/// LayerNorm (and the bias of the layer before) one [`fused::post_norm`]
/// node, whose output stays the fp32 residual stream.
pub struct EncoderLayer {
    in_proj: nn::Linear,
    out_proj: nn::Linear,
    norm1: Norm,
    lin1: nn::Linear,
    lin2: nn::Linear,
    norm2: Norm,
}

impl EncoderLayer {
    fn forward(&self, x: &Tensor, s: &Shape) -> Tensor {
        let y = s.qkv_attention(&self.in_proj, x, false);
        let x = self.norm1.post_forward(x, &s.project(&self.out_proj, &y), s.fused);
        self.norm2.post_forward(&x, &s.relu_mlp(&self.lin1, &self.lin2, &x), s.fused)
    }

    fn share(&self) -> EncoderLayer {
        EncoderLayer {
            in_proj: share(&self.in_proj),
            out_proj: share(&self.out_proj),
            norm1: self.norm1.share(),
            lin1: share(&self.lin1),
            lin2: share(&self.lin2),
            norm2: self.norm2.share(),
        }
    }
}

/// The MLP's hidden layer.
pub struct Hidden {
    fc: nn::Linear,
}

impl Hidden {
    fn forward(&self, x: &Tensor, _: &Shape) -> Tensor {
        self.fc.forward(x).gelu("tanh")
    }

    fn share(&self) -> Hidden {
        Hidden { fc: share(&self.fc) }
    }
}

/// What a forward pass ends with.
pub enum Output {
    /// A scalar loss with its graph.
    Loss(Tensor),
    /// `[n, vocab]` next-token logits and their `[n]` targets.
    Logits { logits: Tensor, target: Tensor },
}

/// The networks, one enum so the step loop needs no dynamic dispatch.
enum Net {
    Gpt { wte: nn::Embedding, wpe: nn::Embedding, blocks: Vec<GptBlock>, ln_f: Norm },
    Encoder { layers: Vec<EncoderLayer>, head: nn::Linear },
    Mlp { emb: nn::Embedding, hidden: Hidden, out: nn::Linear },
    Vision(Box<vision::Vision>),
    T5(Box<t5::T5>),
}

/// A model: its configuration, its network and which of its layers
/// recompute their activations.
pub struct Model {
    cfg: ModelConfig,
    net: Net,
    recompute: Recompute,
    fused: bool,
}

/// Runs `layer` on `x`; with `recompute`, through [`torch_ext::recompute`]
/// on a copy sharing the layer's parameters.
macro_rules! layer {
    ($layer:expr, $x:expr, $shape:expr, $recompute:expr) => {{
        let (layer, x, s) = ($layer, $x, $shape);
        if $recompute && s.train {
            let (own, s) = (layer.share(), *s);
            torch_ext::recompute(x, s.dropout > 0.0, move |x| own.forward(x, &s)).unwrap_or_else(|e| panic!("{e}"))
        } else {
            layer.forward(x, s)
        }
    }};
}

impl Model {
    /// Builds a model's variables under `p` (initialisation as nanoGPT:
    /// N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 L)), zero biases).
    pub fn new(p: &nn::Path, cfg: &ModelConfig, recompute: Recompute) -> Model {
        let d = cfg.d_model;
        let std = 0.02;
        let proj_std = 0.02 / ((2 * cfg.n_layer) as f64).sqrt();
        let emb_cfg = nn::EmbeddingConfig { ws_init: nn::Init::Randn { mean: 0.0, stdev: std }, ..Default::default() };
        let net = match cfg.kind {
            ModelKind::Gpt => {
                let wte = nn::embedding(p / "wte", cfg.vocab, d, emb_cfg);
                let wpe = nn::embedding(p / "wpe", cfg.seq_len, d, emb_cfg);
                let blocks = (0..cfg.n_layer)
                    .map(|i| {
                        let b = p / "h" / i;
                        GptBlock {
                            ln1: Norm::new(&b / "ln_1", d),
                            c_attn: linear(&b / "attn" / "c_attn", d, 3 * d, std),
                            attn_proj: linear(&b / "attn" / "c_proj", d, d, proj_std),
                            ln2: Norm::new(&b / "ln_2", d),
                            c_fc: linear(&b / "mlp" / "c_fc", d, cfg.d_ff, std),
                            mlp_proj: linear(&b / "mlp" / "c_proj", cfg.d_ff, d, proj_std),
                        }
                    })
                    .collect();
                Net::Gpt { wte, wpe, blocks, ln_f: Norm::new(p / "ln_f", d) }
            }
            ModelKind::Encoder => {
                let layers = (0..cfg.n_layer)
                    .map(|i| {
                        let l = p / "layers" / i;
                        EncoderLayer {
                            in_proj: linear(&l / "self_attn" / "in_proj", d, 3 * d, std),
                            out_proj: linear(&l / "self_attn" / "out_proj", d, d, proj_std),
                            norm1: Norm::new(&l / "norm1", d),
                            lin1: linear(&l / "linear1", d, cfg.d_ff, std),
                            lin2: linear(&l / "linear2", cfg.d_ff, d, proj_std),
                            norm2: Norm::new(&l / "norm2", d),
                        }
                    })
                    .collect();
                Net::Encoder { layers, head: linear(p / "head", d, 1, std) }
            }
            ModelKind::Mlp => Net::Mlp {
                emb: nn::embedding(p / "emb", cfg.vocab, d, emb_cfg),
                hidden: Hidden { fc: linear(p / "fc", d, cfg.d_ff, std) },
                out: linear(p / "out", cfg.d_ff, cfg.vocab, std),
            },
            ModelKind::Vision => Net::Vision(Box::new(vision::Vision::new(p, cfg))),
            ModelKind::T5 => Net::T5(Box::new(t5::T5::new(p, cfg.vocab, d, cfg.d_ff, cfg.n_head, cfg.n_layer, cfg.dropout))),
        };
        Model { cfg: cfg.clone(), net, recompute, fused: false }
    }

    /// Computes layers with harness's fused kernels where they apply (bf16
    /// autocast on CUDA): residual adds and LayerNorms ([`fused::add_norm`]),
    /// linear layers ([`fused::linear`]), attention projections
    /// ([`fused::qkv`]), ...
    pub fn use_fused_kernels(&mut self, on: bool) {
        self.fused = on;
        match &mut self.net {
            Net::T5(m) => m.use_fused_kernels(on),
            Net::Vision(v) => v.use_fused_kernels(on),
            _ => {}
        }
    }

    /// Whether the forward pass waits for each layer's parameters itself
    /// ([`fused::params_ready`]), so that ZeRO's gathers of the others may
    /// still run (GPT); other models' parameters are all gathered first.
    pub fn waits_per_layer(&self) -> bool {
        matches!(self.net, Net::Gpt { .. })
    }

    /// Whether the fused kernels are on ([`Model::use_fused_kernels`]).
    pub fn uses_fused_kernels(&self) -> bool {
        self.fused
    }

    /// Whether the residual adds and LayerNorms run through
    /// [`fused::add_norm`]'s (or, post-norm, [`fused::post_norm`]'s) CUDA kernels.
    pub fn fused_layer_norm(&self) -> bool {
        let with_norms = match &self.net {
            Net::Gpt { .. } => true,
            Net::Encoder { .. } => fused::post_norm_on(),
            Net::Vision(v) => v.is_transformer(),
            _ => false,
        };
        self.fused && with_norms && harness_kernels::kernels::layer_norm_fits(self.cfg.d_model)
    }

    /// The resolved configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Which layers recompute their activations.
    pub fn recompute(&self) -> Recompute {
        self.recompute
    }

    /// Forward pass and loss (cross-entropy in nats, or MSE for regression).
    pub fn loss(&self, input: &Tensor, target: &Tensor, train: bool) -> Tensor {
        match self.forward(input, target, train) {
            Output::Loss(l) => l,
            Output::Logits { logits, target } => token_loss(&logits, &target),
        }
    }

    /// Forward pass up to the loss: token models stop at the logits, so the
    /// caller may compute the loss with a fused kernel.
    pub fn forward(&self, input: &Tensor, target: &Tensor, train: bool) -> Output {
        let cfg = &self.cfg;
        let shape = |b, t| Shape { b, t, heads: cfg.n_head, d_model: cfg.d_model, dropout: cfg.dropout, train, fused: self.fused };
        let again = |i: usize| self.recompute.layer(i);
        match &self.net {
            Net::Gpt { wte, wpe, blocks, ln_f } => {
                let (b, t) = input.size2().expect("token batches are 2-d");
                let s = shape(b, t);
                fused::params_ready(&[&wte.ws, &wpe.ws]);
                let (x, tie) = if s.fused && fused::embed_cuda_fits(cfg.d_model, input.device()) {
                    let (x, tie) = fused::embed(input, &wte.ws, &wpe.ws);
                    (x, Some(tie))
                } else {
                    let pos = Tensor::arange(t, (Kind::Int64, input.device()));
                    (wte.forward(input) + wpe.forward(&pos), None)
                };
                let mut x = s.dropout(x);
                // Each block leaves its MLP output pending, for the next
                // LayerNorm to add (fused with it on CUDA). A recomputed
                // block takes one tensor: the pending output is added first.
                let mut pending: Option<Branch> = None;
                for (i, blk) in blocks.iter().enumerate() {
                    fused::params_ready(&blk.params());
                    if again(i) && s.train {
                        if let Some(f) = pending.take() {
                            x = residual(&x, f.value());
                        }
                        x = layer!(blk, &x, &s, true);
                    } else {
                        let (nx, f) = blk.forward_pending(&x, pending.as_ref(), &s);
                        (x, pending) = (nx, Some(f));
                    }
                }
                fused::params_ready(&ln_f.params());
                let (_, x) = ln_f.add_forward(&x, pending.as_ref(), s.fused);
                let logits = fused::tied_linear(&x, &wte.ws, tie.as_ref(), s.fused);
                Output::Logits { logits: logits.view([b * t, cfg.vocab]), target: target.reshape([b * t]) }
            }
            Net::Encoder { layers, head } => {
                let (b, t, _) = input.size3().expect("regression batches are 3-d");
                let s = shape(b, t);
                let mut x = input.shallow_clone();
                for (i, l) in layers.iter().enumerate() {
                    x = layer!(l, &x, &s, again(i));
                }
                let pred = head.forward(&x.mean_dim(1, false, None)).view([b]);
                Output::Loss(pred.to_kind(Kind::Float).mse_loss(&target.to_kind(Kind::Float), tch::Reduction::Mean))
            }
            Net::Mlp { emb, hidden, out } => {
                let (b, t) = input.size2().expect("token batches are 2-d");
                let s = shape(b, t);
                let logits = out.forward(&layer!(hidden, &emb.forward(input), &s, again(0)));
                Output::Logits { logits: logits.view([b * t, cfg.vocab]), target: target.reshape([b * t]) }
            }
            Net::Vision(net) => Output::Logits { logits: net.forward(input, train), target: target.shallow_clone() },
            // Teacher forcing: the target is also the decoder's input.
            Net::T5(m) => Output::Logits { logits: m.forward(input, target, train), target: target.reshape([-1]) },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use harness_format::suite::{ModelSpec, Recompute};

    /// Gradients of a tiny GPT's loss, and how many layer runs went
    /// through recomputation.
    fn grads(recompute: Recompute) -> (Vec<Tensor>, u64) {
        let spec = ModelSpec {
            kind: ModelKind::Gpt,
            preset: Some("tiny".into()),
            n_layer: Some(3),
            n_head: None,
            d_model: None,
            d_ff: None,
            dropout: Some(0.1),
        };
        let cfg = ModelConfig::resolve(&spec, 32, 8).unwrap();
        let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(3);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let model = Model::new(&vs.root(), &cfg, recompute);
        let input = Tensor::randint(32, [2, 8], (Kind::Int64, tch::Device::Cpu));
        let before = torch_ext::BLOCK_RUNS.with(|n| n.get());
        model.loss(&input, &input, true).backward();
        let runs = torch_ext::BLOCK_RUNS.with(|n| n.get()) - before;
        let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        (named.into_iter().map(|(_, p)| p.grad()).collect(), runs)
    }

    #[test]
    fn recomputed_layers_run_twice_and_give_the_same_gradients() {
        let (plain, none) = grads(Recompute::None);
        assert_eq!(none, 0);
        // Three layers: "all" runs each twice; every 2nd: layers 0 and 2.
        for (r, want) in [(Recompute::Every(1), 6), (Recompute::Every(2), 4)] {
            let (g, runs) = grads(r);
            assert_eq!(runs, want, "{r:?}");
            for (a, b) in plain.iter().zip(&g) {
                assert!(a.equal(b), "{r:?}: a gradient differs");
            }
        }
    }
}
