//! The `t5` family: T5's encoder–decoder (Raffel et al., "Exploring the
//! Limits of Transfer Learning with a Unified Text-to-Text Transformer",
//! JMLR 2020), v1.0 as released (`t5-small`, `t5-base`, `t5-large`), trained
//! with teacher forcing on sequence pairs.
//!
//! What makes it T5 and not the `gpt` block: pre-norm layers with RMS
//! normalisation (no mean, no bias), no biases anywhere, ReLU feed-forward,
//! attention logits not scaled by 1/sqrt(d) (the scale is in the
//! initialisation), and no position embeddings: a learned scalar per head
//! and relative-position bucket is added to the attention logits (layer 0's
//! table is shared by every layer of its stack; the encoder's buckets are
//! bidirectional, the decoder's causal). The decoder's layers add
//! cross-attention to the encoder's output. The embedding is shared by both
//! stacks and the output layer, whose input is scaled by d_model^-0.5.
//!
//! Batches: `input` is the source `[b, s]`, `target` the target `[b, t]`;
//! the decoder reads the target shifted right behind token 0 (T5's decoder
//! start token), and predicts each target token.

use std::sync::Mutex;

use tch::nn::{self, Init};
use tch::{Device, Kind, Tensor};

use super::family::{Family, Network, Output, Pass};
use super::fused;
use harness_format::suite::{ModelConfig, ModelKind};

/// How a layer runs its matmuls: through [`fused::linear`], with the fused
/// kernels or without.
#[derive(Clone, Copy)]
struct Weights {
    fused: bool,
}

impl Weights {
    /// `x w^T`.
    fn linear(self, x: &Tensor, w: &Tensor) -> Tensor {
        fused::linear(x, w, None, self.fused)
    }
}

/// Relative-position buckets of T5's attention bias.
pub const BUCKETS: i64 = 32;
/// Distances from which on every distance falls in the last bucket.
pub const MAX_DISTANCE: i64 = 128;

/// T5's bucket of the relative position `rel = key position - query
/// position`. Bidirectional (encoder): half the buckets for keys before the
/// query, half for keys after; causal (decoder): only keys at or before the
/// query count. Within a half, distances below half its buckets get a
/// bucket each, and larger ones share logarithmically spaced buckets up to
/// `max_distance`, beyond which they all fall in the last.
pub fn relative_bucket(rel: i64, bidirectional: bool, buckets: i64, max_distance: i64) -> i64 {
    let mut n = -rel;
    let mut buckets = buckets;
    let mut base = 0;
    if bidirectional {
        buckets /= 2;
        if n < 0 {
            base = buckets;
        }
        n = n.abs();
    } else {
        n = n.max(0);
    }
    let exact = buckets / 2;
    if n < exact {
        return base + n;
    }
    let far = exact + ((n as f64 / exact as f64).ln() / (max_distance as f64 / exact as f64).ln() * (buckets - exact) as f64) as i64;
    base + far.min(buckets - 1)
}

/// The bucket of every (query, key) pair, `[q, k]` int64 on `device`.
fn bucket_table(q: i64, k: i64, bidirectional: bool, device: Device) -> Tensor {
    let idx: Vec<i64> = (0..q).flat_map(|i| (0..k).map(move |j| relative_bucket(j - i, bidirectional, BUCKETS, MAX_DISTANCE))).collect();
    Tensor::from_slice(&idx).view([q, k]).to_device(device)
}

/// `x / rms(x) * w` over the last dimension, in fp32 (T5's layer norm).
fn rms_norm(x: &Tensor, w: &Tensor) -> Tensor {
    let x = x.to_kind(Kind::Float);
    let ms = x.square().mean_dim(-1, true, Kind::Float);
    x * (ms + fused::RMS_EPS).rsqrt() * w
}

fn dropout(x: Tensor, p: f64, train: bool) -> Tensor {
    if train && p > 0.0 {
        x.dropout(p, true)
    } else {
        x
    }
}

/// The four projections of one attention (no biases), `[out, in]` each.
struct Attention {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
}

impl Attention {
    /// T5's initialisation (its `_init_weights`, factor 1): q N(0, (d
    /// d_kv)^-1/2), k and v N(0, d^-1/2), o N(0, (heads d_kv)^-1/2).
    fn new(p: nn::Path, d: i64, heads: i64) -> Attention {
        let inner = d; // heads x d_kv, d_kv = d / heads
        let dkv = d / heads;
        let w = |name: &str, o: i64, i: i64, std: f64| p.var(name, &[o, i], Init::Randn { mean: 0.0, stdev: std });
        Attention {
            q: w("q", inner, d, ((d * dkv) as f64).powf(-0.5)),
            k: w("k", inner, d, (d as f64).powf(-0.5)),
            v: w("v", inner, d, (d as f64).powf(-0.5)),
            o: w("o", d, inner, (inner as f64).powf(-0.5)),
        }
    }

    /// Attention of queries from `x` `[b, tq, d]` over keys and values from
    /// `kv` `[b, tk, d]`, with `bias` `[1, h, tq, tk]` added to the logits
    /// (position bias, and -inf where a decoder may not look), unscaled.
    fn forward(&self, x: &Tensor, kv: &Tensor, bias: Option<&Tensor>, heads: i64, p: f64, w: Weights) -> Tensor {
        let (b, tq, d) = x.size3().expect("[b, t, d]");
        let tk = kv.size()[1];
        let split = |t: Tensor, n: i64| t.view([b, n, heads, d / heads]).transpose(1, 2);
        let q = split(w.linear(x, &self.q), tq);
        let k = split(w.linear(kv, &self.k), tk);
        let v = split(w.linear(kv, &self.v), tk);
        let y = Tensor::scaled_dot_product_attention(&q, &k, &v, bias, p, false, Some(1.0), false);
        w.linear(&y.transpose(1, 2).contiguous().view([b, tq, d]), &self.o)
    }
}

/// The ReLU feed-forward block.
struct FeedForward {
    wi: Tensor,
    wo: Tensor,
}

impl FeedForward {
    fn new(p: nn::Path, d: i64, d_ff: i64) -> FeedForward {
        FeedForward {
            wi: p.var("wi", &[d_ff, d], Init::Randn { mean: 0.0, stdev: (d as f64).powf(-0.5) }),
            wo: p.var("wo", &[d, d_ff], Init::Randn { mean: 0.0, stdev: (d_ff as f64).powf(-0.5) }),
        }
    }

    fn forward(&self, x: &Tensor, p: f64, train: bool, w: Weights) -> Tensor {
        w.linear(&dropout(w.linear(x, &self.wi).relu(), p, train), &self.wo)
    }
}

fn norm_weight(p: &nn::Path, name: &str, d: i64) -> Tensor {
    p.var(name, &[d], Init::Const(1.0))
}

/// An encoder layer: self-attention, then the feed-forward block.
struct EncoderLayer {
    ln1: Tensor,
    attn: Attention,
    ln2: Tensor,
    ffn: FeedForward,
}

/// A decoder layer: causal self-attention, cross-attention to the
/// encoder's output, then the feed-forward block.
struct DecoderLayer {
    ln1: Tensor,
    attn: Attention,
    ln2: Tensor,
    cross: Attention,
    ln3: Tensor,
    ffn: FeedForward,
}

/// A bucket table's shape: (queries, keys, bidirectional).
type TableKey = (i64, i64, bool);

/// A T5 model (see the module's documentation).
pub struct T5 {
    shared: Tensor,
    enc_bias: Tensor,
    dec_bias: Tensor,
    encoder: Vec<EncoderLayer>,
    decoder: Vec<DecoderLayer>,
    enc_norm: Tensor,
    dec_norm: Tensor,
    d_model: i64,
    heads: i64,
    dropout: f64,
    /// Matmuls through [`fused::linear`]'s node (`kernels = "fused"`).
    fused: bool,
    /// Bucket tables by (queries, keys, bidirectional), made once per shape.
    tables: Mutex<Vec<(TableKey, Tensor)>>,
}

impl T5 {
    /// `layers` encoder layers and as many decoder layers of width `d`,
    /// `d_ff` feed-forward width, `heads` heads, over `vocab` tokens.
    pub fn new(p: &nn::Path, vocab: i64, d: i64, d_ff: i64, heads: i64, layers: i64, dropout: f64) -> T5 {
        let bias = |name: &str| p.var(name, &[BUCKETS, heads], Init::Randn { mean: 0.0, stdev: (d as f64).powf(-0.5) });
        let encoder = (0..layers)
            .map(|i| {
                let l = p / "encoder" / i;
                EncoderLayer {
                    ln1: norm_weight(&l, "ln1", d),
                    attn: Attention::new(&l / "attn", d, heads),
                    ln2: norm_weight(&l, "ln2", d),
                    ffn: FeedForward::new(&l / "ffn", d, d_ff),
                }
            })
            .collect();
        let decoder = (0..layers)
            .map(|i| {
                let l = p / "decoder" / i;
                DecoderLayer {
                    ln1: norm_weight(&l, "ln1", d),
                    attn: Attention::new(&l / "attn", d, heads),
                    ln2: norm_weight(&l, "ln2", d),
                    cross: Attention::new(&l / "cross", d, heads),
                    ln3: norm_weight(&l, "ln3", d),
                    ffn: FeedForward::new(&l / "ffn", d, d_ff),
                }
            })
            .collect();
        T5 {
            shared: p.var("shared", &[vocab, d], Init::Randn { mean: 0.0, stdev: 1.0 }),
            enc_bias: bias("encoder_position_bias"),
            dec_bias: bias("decoder_position_bias"),
            encoder,
            decoder,
            enc_norm: norm_weight(p, "encoder_norm", d),
            dec_norm: norm_weight(p, "decoder_norm", d),
            d_model: d,
            heads,
            dropout,
            fused: false,
            tables: Mutex::new(Vec::new()),
        }
    }

    /// The bucket table of a shape, made on first use.
    fn table(&self, q: i64, k: i64, bidirectional: bool, device: Device) -> Tensor {
        let mut tables = self.tables.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, t)) = tables.iter().find(|(key, t)| *key == (q, k, bidirectional) && t.device() == device) {
            return t.shallow_clone();
        }
        let t = bucket_table(q, k, bidirectional, device);
        tables.push(((q, k, bidirectional), t.shallow_clone()));
        t
    }

    /// The additive attention bias `[1, h, q, k]` of a stack's
    /// self-attention: the position bias, and -inf above the diagonal for
    /// the decoder. Contiguous: given a permuted view of the bucket
    /// lookup, libtorch's attention leaves its fused kernels for the
    /// composed one in fp32 (T5-large's encoder on an H100: 4.3 against
    /// 1.7 ms a layer forward and backward, docs/benchmarks.md).
    fn position_bias(&self, table: &Tensor, q: i64, k: i64, causal: bool, device: Device) -> Tensor {
        let idx = self.table(q, k, !causal, device);
        let mut bias = Tensor::embedding(table, &idx, -1, false, false).permute([2, 0, 1]).unsqueeze(0);
        if causal {
            let mask = Tensor::ones([q, k], (Kind::Bool, device)).triu(1);
            bias = bias.masked_fill(&mask, f64::NEG_INFINITY);
        }
        bias.contiguous()
    }

    /// Logits `[b * t, vocab]` of every target position (teacher forcing)
    /// for sources `src` `[b, s]` and targets `tgt` `[b, t]`.
    pub fn forward(&self, src: &Tensor, tgt: &Tensor, train: bool) -> Tensor {
        let device = src.device();
        let (b, s) = src.size2().expect("sources are [b, s]");
        let (_, t) = tgt.size2().expect("targets are [b, t]");
        let p = self.dropout;
        let h = self.heads;
        let w = Weights { fused: self.fused };
        let norm = Norms { fused: self.fused && fused::rms_cuda_fits(self.d_model, device) };
        // Attention-probability dropout in training only.
        let pa = if train { p } else { 0.0 };
        // Encoder. Each layer's branches are added to the fp32 stream `x`
        // together with the next normalisation (`Norms::add`): `y` is the
        // normalised stream the next branch reads.
        let enc_bias = self.position_bias(&self.enc_bias, s, s, false, device);
        let x = dropout(Tensor::embedding(&self.shared, src, -1, false, false), p, train);
        let enc_norms: Vec<&Tensor> = self.encoder.iter().flat_map(|l| [&l.ln1, &l.ln2]).chain([&self.enc_norm]).collect();
        let (mut x, mut y) = norm.add(&x, None, enc_norms[0]);
        for (i, l) in self.encoder.iter().enumerate() {
            let a = dropout(l.attn.forward(&y, &y, Some(&enc_bias), h, pa, w), p, train);
            (x, y) = norm.add(&x, Some(&a), enc_norms[2 * i + 1]);
            let f = dropout(l.ffn.forward(&y, p, train, w), p, train);
            (x, y) = norm.add(&x, Some(&f), enc_norms[2 * i + 2]);
        }
        let memory = dropout(y, p, train);
        // Decoder: the targets shifted right behind the start token (0).
        let start = Tensor::zeros([b, 1], (Kind::Int64, device));
        let dec_in = Tensor::cat(&[start, tgt.narrow(1, 0, t - 1)], 1);
        let dec_bias = self.position_bias(&self.dec_bias, t, t, true, device);
        let x = dropout(Tensor::embedding(&self.shared, &dec_in, -1, false, false), p, train);
        let dec_norms: Vec<&Tensor> = self.decoder.iter().flat_map(|l| [&l.ln1, &l.ln2, &l.ln3]).chain([&self.dec_norm]).collect();
        let (mut x, mut y) = norm.add(&x, None, dec_norms[0]);
        for (i, l) in self.decoder.iter().enumerate() {
            let a = dropout(l.attn.forward(&y, &y, Some(&dec_bias), h, pa, w), p, train);
            (x, y) = norm.add(&x, Some(&a), dec_norms[3 * i + 1]);
            let c = dropout(l.cross.forward(&y, &memory, None, h, pa, w), p, train);
            (x, y) = norm.add(&x, Some(&c), dec_norms[3 * i + 2]);
            let f = dropout(l.ffn.forward(&y, p, train, w), p, train);
            (x, y) = norm.add(&x, Some(&f), dec_norms[3 * i + 3]);
        }
        drop(x);
        let y = dropout(y, p, train) * (self.d_model as f64).powf(-0.5);
        w.linear(&y, &self.shared).view([b * t, -1])
    }
}

impl Network for T5 {
    /// Teacher forcing: the target is also the decoder's input.
    fn output(&self, input: &Tensor, target: &Tensor, pass: &Pass) -> Output {
        Output::Logits { logits: self.forward(input, target, pass.train), target: target.reshape([-1]) }
    }

    /// Runs the matmuls through [`fused::linear`]'s node on CUDA
    /// (`kernels = "fused"` in bf16).
    fn use_fused_kernels(&mut self, on: bool) {
        self.fused = on;
    }
}

/// The `t5` family.
pub struct T5Family;

impl Family for T5Family {
    fn kind(&self) -> ModelKind {
        ModelKind::T5
    }

    fn build(&self, p: &nn::Path, cfg: &ModelConfig) -> Box<dyn Network> {
        Box::new(T5::new(p, cfg.vocab, cfg.d_model, cfg.d_ff, cfg.n_head, cfg.n_layer, cfg.dropout))
    }

    fn bf16_images(&self) -> bool {
        false
    }

    fn fused_cross_entropy(&self) -> bool {
        true
    }

    /// Not yet checked under capture.
    fn graph_checked(&self) -> bool {
        false
    }
}

/// How the layers add a branch to the residual stream and normalise it.
#[derive(Clone, Copy)]
struct Norms {
    /// Through [`fused::add_rms_norm`]'s node (`kernels = "fused"` on CUDA).
    fused: bool,
}

impl Norms {
    /// `(x + f, rms_norm(x + f) * w)`, or `(x, rms_norm(x) * w)` without
    /// `f`: the residual stream (fp32) and its normalised rows (bf16 from
    /// the fused node; fp32 from libtorch's operations, as T5 computes its
    /// layer norm).
    fn add(self, x: &Tensor, f: Option<&Tensor>, w: &Tensor) -> (Tensor, Tensor) {
        if self.fused {
            return fused::add_rms_norm(x, f, w);
        }
        let x = match f {
            Some(f) => x + f,
            None => x.shallow_clone(),
        };
        let y = rms_norm(&x, w);
        (x, y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use harness_kernels::torch_ext;

    #[test]
    fn buckets_are_t5s() {
        // Bidirectional, 32 buckets, max distance 128: distances 0..7 exact,
        // keys after the query in the upper half, log-spaced beyond 8.
        let b = |rel| relative_bucket(rel, true, 32, 128);
        assert_eq!([b(0), b(-1), b(-7), b(1), b(7)], [0, 1, 7, 17, 23]);
        assert_eq!(b(-8), 8);
        assert_eq!(b(-127), 15);
        assert_eq!(b(-1000), 15);
        assert_eq!(b(1000), 31);
        // Log spacing: 8 + floor(ln(n / 8) / ln(16) * 8).
        for n in [8i64, 11, 16, 23, 32, 45, 64, 90, 127] {
            let want = 8 + (((n as f64 / 8.0).ln() / 16f64.ln()) * 8.0) as i64;
            assert_eq!(b(-n), want.min(15), "distance {n}");
        }
        // Causal: keys after the query are bucket 0 (they are masked anyway),
        // 16 exact distances, then log-spaced up to bucket 31.
        let c = |rel| relative_bucket(rel, false, 32, 128);
        assert_eq!([c(0), c(3), c(-1), c(-15), c(-16), c(-127), c(-500)], [0, 0, 1, 15, 16, 31, 31]);
    }

    #[test]
    fn the_decoder_sees_no_later_target() {
        // Changing target token j changes no logit before position j + 1.
        let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(1);
        let vs = nn::VarStore::new(Device::Cpu);
        let m = T5::new(&vs.root(), 20, 16, 32, 2, 2, 0.0);
        let src = Tensor::randint(20, [1, 6], (Kind::Int64, Device::Cpu));
        let tgt = Tensor::randint(20, [1, 5], (Kind::Int64, Device::Cpu));
        let a = tch::no_grad(|| m.forward(&src, &tgt, false));
        let other = tgt.copy();
        let _ = other.narrow(1, 3, 1).fill_(0);
        let _ = other.narrow(1, 4, 1).fill_(1);
        let b2 = tch::no_grad(|| m.forward(&src, &other, false));
        // Target 3 is the decoder's input at position 4 only.
        assert!(a.narrow(0, 0, 4).allclose(&b2.narrow(0, 0, 4), 1e-6, 1e-6, false));
        assert!(!a.narrow(0, 4, 1).allclose(&b2.narrow(0, 4, 1), 1e-6, 1e-6, false));
        // Every source token reaches every target position.
        let src2 = src.copy();
        let _ = src2.narrow(1, 5, 1).fill_(19);
        let _ = src2.narrow(1, 0, 1).fill_(18);
        let c = tch::no_grad(|| m.forward(&src2, &tgt, false));
        assert!(!a.narrow(0, 0, 1).allclose(&c.narrow(0, 0, 1), 1e-6, 1e-6, false));
    }

    #[test]
    fn t5_small_has_its_published_size() {
        // t5-small: 60,506,624 parameters (32,128 vocabulary, d 512, d_ff
        // 2048, 8 heads, 6 + 6 layers), as the released checkpoint counts
        // them (the shared embedding once, one bias table per stack).
        // Its initialisation draws from the global generator, which tests
        // beside this one seed and draw from under this lock.
        let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        let vs = nn::VarStore::new(Device::Cpu);
        let _m = T5::new(&vs.root(), 32128, 512, 2048, 8, 6, 0.0);
        let n: i64 = vs.trainable_variables().iter().map(|t| t.numel() as i64).sum();
        assert_eq!(n, 60_506_624);
    }
}
