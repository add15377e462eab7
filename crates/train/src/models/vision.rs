//! The `vision` model family: ResNets (He et al. 2016; torchvision's v1.5,
//! the stride in the 3x3 convolution of a bottleneck) written with
//! `tch::nn`, for image classification.
//!
//! Depth picks the blocks (`suite::resnet_stages`: 10, 18, 34 basic
//! blocks, 50, 101 bottlenecks) and width the channels of the first stage
//! (doubled at each of the four stages). Images up to
//! [`SMALL_IMAGE`] pixels get the small-image stem (one 3x3 convolution at
//! full resolution, as CIFAR ResNets), larger ones ImageNet's (7x7 stride
//! 2 and a max-pool). Initialisation as torchvision: convolutions
//! N(0, 2 / fan_out), batch norm weight 1 and bias 0, the classifier
//! U(+-1/sqrt(fan_in)).
//!
//! Batch norm's running statistics are variables of the VarStore that need
//! no gradient: the training core keeps them apart from the parameters
//! (`Training::buffers`), out of the gradient buckets and the optimizer,
//! and in every rank's checkpoint state. In training mode each rank
//! normalises with its own micro-batch's statistics, as DDP without
//! SyncBatchNorm does.
//!
//! On CUDA the activations are channels-last (NHWC strides, what cuDNN's
//! fastest convolutions and batch norms read), as are the convolution
//! weights; on the CPU libtorch's default layout is kept.
//!
//! The ViT presets (`vit-b16`, `vit-tiny`) are Vision Transformers as
//! torchvision's `vit_b_16` (Dosovitskiy et al. 2021): a strided
//! convolution cuts the image into patches, a class token and learned
//! positions are added, pre-LayerNorm encoder blocks (GELU MLP,
//! non-causal attention through `scaled_dot_product_attention`), a final
//! LayerNorm, and a linear head on the class token. Initialisation: patch
//! convolution N(0, 1 / fan_in), positions N(0, 0.02), class token and
//! head zero (as torchvision), other linear layers N(0, 0.02) with zero
//! biases (nanoGPT's, as the other transformers here).

use tch::nn::{self, Module, ModuleT};
use tch::Tensor;

use super::family::{Family, Network, Output, Pass};
use super::fused;
use super::layers::{Branch, Norm};
use harness_format::suite::{resnet_stages, ModelConfig, ModelKind, SMALL_IMAGE};

/// A `vision` network: a ResNet, or a Vision Transformer for the ViT presets.
pub enum Vision {
    ResNet(ResNet),
    Vit(Vit),
}

impl Vision {
    /// The network of `cfg` under `p`.
    pub fn new(p: &nn::Path, cfg: &ModelConfig) -> Vision {
        match cfg.patch {
            Some(patch) => Vision::Vit(Vit::new(p, cfg, patch)),
            None => Vision::ResNet(ResNet::new(p, cfg)),
        }
    }

    /// `[n, classes]` logits of `[n, channels, side, side]` images.
    pub fn forward(&self, x: &Tensor, train: bool) -> Tensor {
        match self {
            Vision::ResNet(n) => n.forward(x, train),
            Vision::Vit(n) => n.forward(x),
        }
    }

    /// Whether it is a ViT (whose LayerNorms the fused kernels serve).
    pub fn is_transformer(&self) -> bool {
        matches!(self, Vision::Vit(_))
    }
}

impl Network for Vision {
    fn output(&self, input: &Tensor, target: &Tensor, pass: &Pass) -> Output {
        Output::Logits { logits: self.forward(input, pass.train), target: target.shallow_clone() }
    }

    /// A ViT's residual adds and LayerNorms through [`fused::add_norm`],
    /// its linear layers through [`fused::linear`], as the
    /// `gpt` family's; a ResNet's batch norms, with the ReLU and the
    /// residual add after them, through [`fused::batch_norm_act`] in
    /// training (bf16 on CUDA, `kernels = "fused"`).
    fn use_fused_kernels(&mut self, on: bool) {
        match self {
            Vision::Vit(n) => n.fused = on,
            Vision::ResNet(n) => n.fused = on,
        }
    }

    /// A ViT's.
    fn fused_norms(&self) -> bool {
        self.is_transformer()
    }
}

/// The `vision` family.
pub struct VisionFamily;

impl Family for VisionFamily {
    fn kind(&self) -> ModelKind {
        ModelKind::Vision
    }

    fn build(&self, p: &nn::Path, cfg: &ModelConfig) -> Box<dyn Network> {
        Box::new(Vision::new(p, cfg))
    }

    /// Its first layer (ResNet's stem, ViT's patches: convolutions) would
    /// cast them under bf16 autocast.
    fn bf16_images(&self) -> bool {
        true
    }

    /// Its logits go through libtorch's cross-entropy.
    fn fused_cross_entropy(&self) -> bool {
        false
    }

    fn graph_checked(&self) -> bool {
        true
    }
}

fn vit_linear(p: nn::Path, i: i64, o: i64, std: f64) -> nn::Linear {
    let cfg = nn::LinearConfig { ws_init: nn::Init::Randn { mean: 0.0, stdev: std }, bs_init: Some(nn::Init::Const(0.0)), bias: true };
    nn::linear(p, i, o, cfg)
}

/// One pre-LayerNorm encoder block of a ViT.
struct VitBlock {
    ln1: Norm,
    qkv: nn::Linear,
    proj: nn::Linear,
    ln2: Norm,
    fc1: nn::Linear,
    fc2: nn::Linear,
}

/// A Vision Transformer.
pub struct Vit {
    patch: nn::Conv2D,
    cls: Tensor,
    pos: Tensor,
    blocks: Vec<VitBlock>,
    ln: Norm,
    head: nn::Linear,
    heads: i64,
    width: i64,
    /// harness's fused kernels ([`Network::use_fused_kernels`]).
    fused: bool,
}

impl Vit {
    /// `cfg`'s layers, heads, width and MLP width; `patch`-pixel patches.
    pub fn new(p: &nn::Path, cfg: &ModelConfig, patch: i64) -> Vit {
        let [channels, side] = cfg.image.unwrap_or([3, 224]);
        let d = cfg.d_model;
        let tokens = (side / patch) * (side / patch) + 1;
        let conv = nn::ConvConfig {
            stride: patch,
            ws_init: nn::Init::Randn { mean: 0.0, stdev: (1.0 / (channels * patch * patch) as f64).sqrt() },
            bs_init: nn::Init::Const(0.0),
            ..Default::default()
        };
        let blocks = (0..cfg.n_layer)
            .map(|i| {
                let b = p / "layers" / i;
                VitBlock {
                    ln1: Norm::new(&b / "ln_1", d),
                    qkv: vit_linear(&b / "attn" / "in_proj", d, 3 * d, 0.02),
                    proj: vit_linear(&b / "attn" / "out_proj", d, d, 0.02),
                    ln2: Norm::new(&b / "ln_2", d),
                    fc1: vit_linear(&b / "mlp" / "linear_1", d, cfg.d_ff, 0.02),
                    fc2: vit_linear(&b / "mlp" / "linear_2", cfg.d_ff, d, 0.02),
                }
            })
            .collect();
        Vit {
            patch: nn::conv2d(p / "conv_proj", channels, d, patch, conv),
            cls: p.zeros("class_token", &[1, 1, d]),
            pos: p.var("pos_embedding", &[1, tokens, d], nn::Init::Randn { mean: 0.0, stdev: 0.02 }),
            blocks,
            ln: Norm::new(p / "ln", d),
            head: vit_linear(p / "head", d, cfg.vocab, 0.0),
            heads: cfg.n_head,
            width: d,
            fused: false,
        }
    }

    /// `l(h)` ([`fused::linear`]).
    fn linear(&self, l: &nn::Linear, h: &Tensor) -> Tensor {
        fused::linear(h, &l.ws, l.bs.as_ref(), self.fused)
    }

    /// `[n, classes]` logits of `[n, channels, side, side]` images. The
    /// residual stream takes each branch (attention, MLP) in the next
    /// LayerNorm's add, one kernel each way with the fused kernels, which
    /// also add the branch's projection bias there.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        let n = x.size()[0];
        let patches = self.patch.forward(x).flatten(2, -1).transpose(1, 2);
        let cls = self.cls.expand([n, 1, self.width], false).to_kind(patches.kind());
        let mut y = Tensor::cat(&[cls, patches], 1) + &self.pos;
        let (_, t, _) = y.size3().expect("tokens are [n, t, d]");
        let mut pending: Option<Branch> = None;
        for b in &self.blocks {
            let (x, h) = b.ln1.add_forward(&y, pending.as_ref(), self.fused);
            let a = super::layers::qkv_attention(&b.qkv, &h, self.fused, (n, t, self.heads), 0.0, false);
            let (x, h) = b.ln2.add_forward(&x, Some(&Branch::of(&b.proj, &a, self.fused, self.width)), self.fused);
            let m = self.linear(&b.fc1, &h).gelu("none");
            pending = Some(Branch::of(&b.fc2, &m, self.fused, self.width));
            y = x;
        }
        let (_, h) = self.ln.add_forward(&y, pending.as_ref(), self.fused);
        self.head.forward(&h.select(1, 0))
    }
}

pub use fused::{channels_last, is_channels_last};

/// A convolution without bias and its batch norm.
struct ConvBn {
    conv: nn::Conv2D,
    bn: nn::BatchNorm,
}

impl ConvBn {
    fn new(p: nn::Path, c_in: i64, c_out: i64, k: i64, stride: i64) -> ConvBn {
        // torchvision: kaiming_normal_(mode="fan_out", nonlinearity="relu").
        let std = (2.0 / (c_out * k * k) as f64).sqrt();
        let cfg = nn::ConvConfig {
            stride,
            padding: k / 2,
            bias: false,
            ws_init: nn::Init::Randn { mean: 0.0, stdev: std },
            ..Default::default()
        };
        let conv = nn::conv2d(&p / "conv", c_in, c_out, k, cfg);
        let bn_cfg = nn::BatchNormConfig { ws_init: nn::Init::Const(1.0), bs_init: nn::Init::Const(0.0), ..Default::default() };
        ConvBn { conv, bn: nn::batch_norm2d(&p / "bn", c_out, bn_cfg) }
    }

    /// `relu(bn(conv(x)) + res)`, the residual and the ReLU where asked
    /// ([`ConvBn::bn_act`]).
    fn forward(&self, x: &Tensor, train: bool, fused: bool, res: Option<&Tensor>, relu: bool) -> Tensor {
        self.bn_act(&self.conv.forward(x), train, fused, res, relu)
    }

    /// `relu(bn(z) + res)` of the convolution's output `z`: with `fused`
    /// in training where the kernels take `z`, one node
    /// ([`fused::batch_norm_act`]); else libtorch's batch norm, add and
    /// ReLU.
    fn bn_act(&self, z: &Tensor, train: bool, fused: bool, res: Option<&Tensor>, relu: bool) -> Tensor {
        if let (true, true, Some(w), Some(b)) = (fused && train, fused::batch_norm_cuda_fits(z), &self.bn.ws, &self.bn.bs) {
            let running = Some((&self.bn.running_mean, &self.bn.running_var));
            let bn = fused::BatchNormParams { w, b, running, momentum: BN_MOMENTUM, eps: BN_EPS };
            return fused::batch_norm_act(z, &bn, res, relu);
        }
        let mut y = self.bn.forward_t(z, train);
        if let Some(r) = res {
            y = &y + r;
        }
        if relu {
            y = y.relu();
        }
        y
    }
}

/// ImageNet's stem pooling: 3 x 3 windows, stride 2, padding 1.
const STEM_POOL: fused::Pool = fused::Pool { k: 3, stride: 2, pad: 1 };

/// Batch norm's momentum and epsilon (torch's and tch's defaults).
const BN_MOMENTUM: f64 = 0.1;
const BN_EPS: f64 = 1e-5;

/// A residual block: two 3x3 convolutions (basic) or 1x1, 3x3, 1x1
/// (bottleneck), and a 1x1 projection of the shortcut where the shape
/// changes.
struct Block {
    convs: Vec<ConvBn>,
    down: Option<ConvBn>,
}

impl Block {
    /// The convolutions with their batch norms and ReLUs, the last batch
    /// norm taking the shortcut's add and the block's ReLU.
    fn forward(&self, x: &Tensor, train: bool, fused: bool) -> Tensor {
        let (last, first) = self.convs.split_last().expect("a block has convolutions");
        let mut y = x.shallow_clone();
        for c in first {
            y = c.forward(&y, train, fused, None, true);
        }
        let z = last.conv.forward(&y);
        let shortcut = match &self.down {
            Some(d) => d.forward(x, train, fused, None, false),
            None => x.shallow_clone(),
        };
        last.bn_act(&z, train, fused, Some(&shortcut), true)
    }
}

/// A ResNet classifier.
pub struct ResNet {
    stem: ConvBn,
    /// ImageNet's stem: a 3x3 stride-2 max-pool after the stem.
    pool: bool,
    blocks: Vec<Block>,
    fc: nn::Linear,
    /// harness's fused kernels ([`Network::use_fused_kernels`]).
    fused: bool,
}

impl ResNet {
    /// Builds the network of `cfg` (depth `n_layer`, width `d_model`,
    /// `vocab` classes, `image` (channels, side)) under `p`.
    pub fn new(p: &nn::Path, cfg: &ModelConfig) -> ResNet {
        let (stages, bottleneck) = resnet_stages(cfg.n_layer).expect("a validated ResNet depth");
        let [channels, side] = cfg.image.unwrap_or([3, 224]);
        let width = cfg.d_model;
        let small = side <= SMALL_IMAGE;
        let stem = ConvBn::new(p / "stem", channels, width, if small { 3 } else { 7 }, if small { 1 } else { 2 });
        let expansion = if bottleneck { 4 } else { 1 };
        let mut blocks = Vec::new();
        let mut c_in = width;
        for (s, &n) in stages.iter().enumerate() {
            let planes = width << s;
            let c_out = planes * expansion;
            for b in 0..n {
                let stride = if s > 0 && b == 0 { 2 } else { 1 };
                let q = p / format!("layer{}", s + 1) / b;
                let convs = if bottleneck {
                    vec![
                        ConvBn::new(&q / "c1", c_in, planes, 1, 1),
                        ConvBn::new(&q / "c2", planes, planes, 3, stride),
                        ConvBn::new(&q / "c3", planes, c_out, 1, 1),
                    ]
                } else {
                    vec![ConvBn::new(&q / "c1", c_in, planes, 3, stride), ConvBn::new(&q / "c2", planes, planes, 3, 1)]
                };
                let down = (stride != 1 || c_in != c_out).then(|| ConvBn::new(&q / "down", c_in, c_out, 1, stride));
                blocks.push(Block { convs, down });
                c_in = c_out;
            }
        }
        let fc = nn::linear(p / "fc", c_in, cfg.vocab, Default::default());
        let net = ResNet { stem, pool: !small, blocks, fc, fused: false };
        if p.device().is_cuda() {
            net.weights_channels_last();
        }
        net
    }

    /// Every convolution weight into channels-last strides, in place (the
    /// VarStore's tensors are the same tensors).
    fn weights_channels_last(&self) {
        let convs =
            std::iter::once(&self.stem).chain(self.blocks.iter().flat_map(|b| b.convs.iter().chain(b.down.as_ref()))).map(|c| &c.conv.ws);
        tch::no_grad(|| {
            for w in convs {
                let cl = channels_last(w);
                w.shallow_clone().set_data(&cl);
            }
        });
    }

    /// `[n, classes]` logits of `[n, channels, side, side]` images.
    pub fn forward(&self, x: &Tensor, train: bool) -> Tensor {
        let x = if x.device().is_cuda() && !is_channels_last(x) { channels_last(x) } else { x.shallow_clone() };
        let mut y = self.stem.forward(&x, train, self.fused, None, true);
        if self.pool {
            y = if self.fused { fused::max_pool(&y, STEM_POOL) } else { fused::libtorch_max_pool(&y, STEM_POOL) };
        }
        for b in &self.blocks {
            y = b.forward(&y, train, self.fused);
        }
        let pooled = y.adaptive_avg_pool2d([1, 1]).flatten(1, -1);
        self.fc.forward(&pooled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use harness_format::suite::{resnet_macs, ModelKind, ModelSpec};
    use tch::{Device, Kind};

    fn config(preset: &str, classes: u32, image: [i64; 2]) -> ModelConfig {
        let spec = ModelSpec {
            kind: ModelKind::Vision,
            preset: Some(preset.into()),
            n_layer: None,
            n_head: None,
            d_model: None,
            d_ff: None,
            dropout: None,
        };
        let mut cfg = ModelConfig::resolve(&spec, classes, 1).unwrap();
        cfg.image = Some(image);
        cfg
    }

    fn count(vs: &nn::VarStore, trainable: bool) -> i64 {
        vs.variables().values().filter(|t| t.requires_grad() == trainable).map(|t| t.numel() as i64).sum()
    }

    #[test]
    fn resnets_have_torchvisions_parameter_counts_and_multiply_adds() {
        // Initialisation draws from libtorch's global generator: take turns
        // with the tests that seed it and compare what they draw.
        let _turn = harness_kernels::torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        // torchvision's resnet18 has 11,689,512 parameters, resnet50
        // 25,557,032; fvcore counts 1.814 and 4.089 GMACs in their
        // convolutions and classifier at 224 x 224, 1000 classes.
        for (preset, params, gmacs) in [("resnet18", 11_689_512, 1.814), ("resnet50", 25_557_032, 4.089)] {
            let cfg = config(preset, 1000, [3, 224]);
            let vs = nn::VarStore::new(Device::Cpu);
            let _net = ResNet::new(&vs.root(), &cfg);
            assert_eq!(count(&vs, true), params, "{preset}");
            let macs = resnet_macs(cfg.n_layer, cfg.d_model, 3, 224, 1000) / 1e9;
            assert!((macs - gmacs).abs() < 0.002, "{preset}: {macs} GMACs");
            // Running mean and variance of every batch norm, not trained.
            assert!(count(&vs, false) > 0);
        }
    }

    #[test]
    fn logits_have_one_row_per_image_and_batch_norm_statistics_move_only_in_training() {
        // Initialisation draws from libtorch's global generator: take turns
        // with the tests that seed it and compare what they draw.
        let _turn = harness_kernels::torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        let cfg = config("tiny", 10, [3, 32]);
        let vs = nn::VarStore::new(Device::Cpu);
        let net = ResNet::new(&vs.root(), &cfg);
        let x = Tensor::randn([4, 3, 32, 32], (Kind::Float, Device::Cpu));
        let stats = || {
            let mut v: Vec<(String, Tensor)> = vs.variables().into_iter().filter(|(_, t)| !t.requires_grad()).collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v.into_iter().map(|(_, t)| t.copy()).collect::<Vec<_>>()
        };
        let before = stats();
        let y = tch::no_grad(|| net.forward(&x, false));
        assert_eq!(y.size(), [4, 10]);
        assert!(before.iter().zip(stats()).all(|(a, b)| a.equal(&b)), "evaluation moved the running statistics");
        let _ = tch::no_grad(|| net.forward(&x, true));
        assert!(before.iter().zip(stats()).any(|(a, b)| !a.equal(&b)), "training left the running statistics");
    }

    #[test]
    fn vit_b16_has_torchvisions_parameter_count_and_tiny_vits_classify() {
        // Initialisation draws from libtorch's global generator: take turns
        // with the tests that seed it and compare what they draw.
        let _turn = harness_kernels::torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        // torchvision's vit_b_16: 86,567,656 parameters at 1000 classes.
        let vs = nn::VarStore::new(Device::Cpu);
        let _net = Vision::new(&vs.root(), &config("vit-b16", 1000, [3, 224]));
        assert_eq!(count(&vs, true), 86_567_656);
        // Training FLOPs of one image: the 12 blocks on 197 tokens, the
        // patch projection on 196, the head on the class token, attention
        // 12 x layers x width x tokens per token.
        let (d, f, t) = (768i64, 3072i64, 197i64);
        let block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (d * f + f) + (f * d + d);
        let macs = t * 12 * block + (t - 1) * (3 * 16 * 16 * d + d) + (d * 1000 + 1000);
        let expected = 6.0 * macs as f64 + 12.0 * (12 * d * t * t) as f64;
        let cfg = config("vit-b16", 1000, [3, 224]);
        assert_eq!(cfg.flops_per_token(86_567_656), expected);
        let vs = nn::VarStore::new(Device::Cpu);
        let cfg = config("vit-tiny", 10, [3, 32]);
        assert_eq!(cfg.patch, Some(4));
        let net = Vision::new(&vs.root(), &cfg);
        let x = Tensor::randn([3, 3, 32, 32], (Kind::Float, Device::Cpu));
        let y = net.forward(&x, true);
        assert_eq!(y.size(), [3, 10]);
        // The head starts at zero: uniform predictions, loss ln 10.
        let loss = y.cross_entropy_for_logits(&Tensor::from_slice(&[1i64, 2, 3]));
        assert!((loss.double_value(&[]) - 10f64.ln()).abs() < 1e-6);
        loss.backward();
        assert!(vs.trainable_variables().iter().all(|v| v.grad().defined()));
    }

    #[test]
    fn channels_last_keeps_values_and_sets_nhwc_strides() {
        // Initialisation draws from libtorch's global generator: take turns
        // with the tests that seed it and compare what they draw.
        let _turn = harness_kernels::torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        let x = Tensor::randn([2, 3, 5, 7], (Kind::Float, Device::Cpu));
        let y = channels_last(&x);
        assert!(y.equal(&x));
        assert!(is_channels_last(&y) && !is_channels_last(&x));
        assert_eq!(y.stride(), [105, 1, 21, 3]);
    }
}
