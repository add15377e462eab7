//! The fused layers against libtorch's layers under autograd (the
//! reference engine on the CPU; the CUDA kernels where a GPU is);
//! `buffers`: the gradient buffers' handle (`grad::GradBuffer`) and the source
//! check that keeps every layer behind it.

use tch::{Device, Kind, Tensor};

use harness_kernels::kernels::{self, Norm};
use harness_kernels::torch_ext;

use super::conv::{batch_norm_act_with, max_pool_cuda_fits};
use super::dense::{linear_with, qkv_with};
use super::embedding::embed_with;
use super::engine::Engine;
use super::ffn::mlp_with;
use super::norm::add_norm_with;
use super::*;

mod buffers;

type AddNormFn = fn(&Tensor, Option<&Tensor>, Option<&Tensor>, &Tensor, &Tensor) -> (Tensor, Tensor);

/// The plain composition `add_norm` replaces: `x + f + fb`, then
/// LayerNorm.
fn plain(x: &Tensor, f: Option<&Tensor>, fb: Option<&Tensor>, w: &Tensor, b: &Tensor) -> (Tensor, Tensor) {
    let xo = match (f, fb) {
        (Some(f), Some(fb)) => x + (f + fb),
        (Some(f), None) => x + f,
        _ => x.shallow_clone(),
    };
    let y = xo.layer_norm([w.size()[0]], Some(w), Some(b), EPS, false);
    (xo, y)
}

/// Gradients (x, w, b, then f and fb where used) of a loss using both
/// outputs of `op` on `[n, c]` rows; `buffers`: w, b and fb have zeroed
/// gradient buffers beforehand, as the data parallel code gives them
/// (the fused layer then adds into them itself).
fn grads(op: AddNormFn, residual: bool, bias: bool, buffers: bool, dev: Device, kind: Kind, (n, c): (i64, i64)) -> Vec<Tensor> {
    let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(11);
    let leaf = |t: Tensor| t.set_requires_grad(true);
    let x = leaf(Tensor::randn([n, c], (Kind::Float, dev)));
    let f = leaf(Tensor::randn([n, c], (Kind::Float, dev)).to_kind(kind));
    let fb = leaf(Tensor::randn([c], (Kind::Float, dev)) * 0.1);
    let w = leaf(Tensor::randn([c], (Kind::Float, dev)) * 0.1 + 1.0);
    let b = leaf(Tensor::randn([c], (Kind::Float, dev)) * 0.1);
    let (py, pr) = (Tensor::randn([n, c], (Kind::Float, dev)), Tensor::randn([n, c], (Kind::Float, dev)));
    let kept: Vec<Tensor> = [&w, &b, &fb].iter().filter(|_| buffers).map(|t| t.zeros_like()).collect();
    for (t, g) in [&w, &b, &fb].iter().zip(&kept) {
        torch_ext::set_grad(t, Some(g)).unwrap();
    }
    let (xo, y) = op(&x, residual.then_some(&f), bias.then_some(&fb), &w, &b);
    let loss = (y.to_kind(Kind::Float) * &py).sum(Kind::Float) + (xo * &pr).sum(Kind::Float);
    loss.backward();
    for (t, g) in [&w, &b, &fb].iter().zip(&kept) {
        assert_eq!(t.grad().data_ptr(), g.data_ptr(), "a gradient left its buffer");
    }
    let mut g = vec![x.grad(), w.grad(), b.grad()];
    if residual {
        g.push(f.grad());
    }
    if bias {
        g.push(fb.grad());
    }
    g
}

const CASES: [(bool, bool); 3] = [(true, true), (true, false), (false, false)];

/// The output and gradients (x, f, fb, w, b) of a loss over a post-norm
/// layer's `LayerNorm(x + f + fb)` on `[n, c]` rows, `f` in `kind`:
/// through [`post_norm`] (`fused`), or libtorch's add and LayerNorm.
/// `buffers`: fb, w and b have zeroed gradient buffers beforehand.
fn post_grads(fused: bool, buffers: bool, dev: Device, kind: Kind, (n, c): (i64, i64)) -> Vec<Tensor> {
    let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(13);
    let leaf = |t: Tensor| t.set_requires_grad(true);
    let x = leaf(Tensor::randn([n, c], (Kind::Float, dev)) * 2.0 + 0.5);
    let f = leaf(Tensor::randn([n, c], (Kind::Float, dev)).to_kind(kind));
    let fb = leaf(Tensor::randn([c], (Kind::Float, dev)) * 0.1);
    let w = leaf(Tensor::randn([c], (Kind::Float, dev)) * 0.1 + 1.0);
    let b = leaf(Tensor::randn([c], (Kind::Float, dev)) * 0.1);
    let p = Tensor::randn([n, c], (Kind::Float, dev));
    let kept: Vec<Tensor> = [&fb, &w, &b].iter().filter(|_| buffers).map(|t| t.zeros_like()).collect();
    for (t, g) in [&fb, &w, &b].iter().zip(&kept) {
        torch_ext::set_grad(t, Some(g)).unwrap();
    }
    let y = if fused { post_norm(&x, &f, Some(&fb), &w, &b) } else { (&x + &f + &fb).layer_norm([c], Some(&w), Some(&b), EPS, false) };
    assert_eq!(y.kind(), Kind::Float, "a post-norm layer's output is the fp32 stream");
    (&y * &p).sum(Kind::Float).backward();
    for (t, g) in [&fb, &w, &b].iter().zip(&kept) {
        assert_eq!(t.grad().data_ptr(), g.data_ptr(), "a gradient left its buffer");
    }
    assert_eq!(f.grad().kind(), kind, "the branch's gradient is not in its kind");
    vec![y.detach(), x.grad(), f.grad().to_kind(Kind::Float), fb.grad(), w.grad(), b.grad()]
}

#[test]
fn the_post_norm_node_matches_libtorchs_layers() {
    // fp32 on the CPU: the reference's maths against autograd's.
    for buffers in [false, true] {
        let want = post_grads(false, buffers, Device::Cpu, Kind::Float, (6, 16));
        let got = post_grads(true, buffers, Device::Cpu, Kind::Float, (6, 16));
        assert_close(&want, &got, max_error, 1e-4, &format!("buffers={buffers}"));
    }
}

#[test]
fn the_written_out_backward_pass_matches_autograd() {
    // fp32 on the CPU: the reference's maths against autograd's.
    for (residual, bias) in CASES {
        for buffers in [false, true] {
            let want = grads(plain, residual, bias, buffers, Device::Cpu, Kind::Float, (6, 16));
            let got = grads(add_norm, residual, bias, buffers, Device::Cpu, Kind::Float, (6, 16));
            assert_close(&want, &got, max_error, 1e-4, &format!("residual={residual} bias={bias} buffers={buffers}"));
        }
    }
}

/// The output, the sum and the gradients (x, w, then f where used) of a
/// loss over `(x + f, rms_norm(x + f) * w)` on `[n, c]` rows, `f` in
/// `kind`: through [`add_rms_norm_with`] on `engine`, or (None) T5's
/// plain composition in libtorch's operations under autograd. `buffer`:
/// w has a zeroed gradient buffer beforehand.
fn rms_grads(engine: Option<Engine>, residual: bool, buffer: bool, dev: Device, kind: Kind, (n, c): (i64, i64)) -> Vec<Tensor> {
    let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(17);
    let leaf = |t: Tensor| t.set_requires_grad(true);
    let x = leaf(Tensor::randn([n, c], (Kind::Float, dev)) * 3.0 + 0.5);
    let f = leaf(Tensor::randn([n, c], (Kind::Float, dev)).to_kind(kind));
    let w = leaf(Tensor::randn([c], (Kind::Float, dev)) * 0.1 + 1.0);
    let (py, pr) = (Tensor::randn([n, c], (Kind::Float, dev)), Tensor::randn([n, c], (Kind::Float, dev)));
    let kept = buffer.then(|| w.zeros_like());
    if let Some(g) = &kept {
        torch_ext::set_grad(&w, Some(g)).unwrap();
    }
    let f_in = residual.then_some(&f);
    let (xo, y) = match engine {
        Some(engine) => {
            let y_kind = if engine == Engine::Cuda { Kind::BFloat16 } else { f_in.map_or(Kind::Float, Tensor::kind) };
            add_norm_with(engine, Norm::Rms, &x, f_in, None, &w, None, y_kind)
        }
        None => {
            let xo = f_in.map_or_else(|| x.shallow_clone(), |f| &x + f);
            let x32 = xo.to_kind(Kind::Float);
            let y = &x32 * (x32.square().mean_dim(-1, true, Kind::Float) + RMS_EPS).rsqrt() * &w;
            (xo, y)
        }
    };
    let loss = (y.to_kind(Kind::Float) * &py).sum(Kind::Float) + (&xo * &pr).sum(Kind::Float);
    loss.backward();
    if let Some(g) = &kept {
        assert_eq!(w.grad().data_ptr(), g.data_ptr(), "a gradient left its buffer");
    }
    let mut g = vec![y.detach().to_kind(Kind::Float), xo.detach(), x.grad(), w.grad()];
    if residual {
        g.push(f.grad().to_kind(Kind::Float));
    }
    g
}

#[test]
fn the_rms_node_matches_t5s_layer_norm_under_autograd() {
    // fp32 on the CPU: the reference's written-out backward pass
    // against autograd's.
    for residual in [true, false] {
        for buffer in [false, true] {
            let want = rms_grads(None, residual, buffer, Device::Cpu, Kind::Float, (6, 16));
            let got = rms_grads(Some(Engine::Reference), residual, buffer, Device::Cpu, Kind::Float, (6, 16));
            assert_close(&want, &got, max_error, 1e-4, &format!("residual={residual} buffer={buffer}"));
        }
    }
    // Without the fused kernels t5 keeps its own composition; with them
    // on the CPU, the node's reference (rows in the branch's kind).
    // (No random numbers outside GLOBAL_RNG's lock: other tests seed it.)
    let (x, w) = (Tensor::arange(24, (Kind::Float, Device::Cpu)).view([3, 8]), Tensor::ones([8], (Kind::Float, Device::Cpu)));
    let (xo, y) = add_rms_norm(&x, None, &w);
    assert!(xo.equal(&x) && y.kind() == Kind::Float);
}

/// Batch norm in training (then the residual and ReLU where asked) on
/// `[n, c, h, w]` (channels-last on CUDA) in `kind`: the output, the
/// gradients of x, w, b (and the residual's), and the running mean and
/// variance after the step; through [`batch_norm_act_with`] on
/// `engine`, or (None) libtorch's batch norm, add and ReLU.
fn bn_grads(engine: Option<Engine>, relu: bool, residual: bool, dev: Device, kind: Kind, shape: [i64; 4]) -> Vec<Tensor> {
    let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(23);
    let c = shape[1];
    let layout = |t: Tensor| if dev.is_cuda() { channels_last(&t) } else { t };
    let x = layout((Tensor::randn(shape, (Kind::Float, dev)) * 2.0 + 0.7).to_kind(kind)).set_requires_grad(true);
    let r = layout(Tensor::randn(shape, (Kind::Float, dev)).to_kind(kind)).set_requires_grad(true);
    let w = (Tensor::randn([c], (Kind::Float, dev)) * 0.2 + 1.0).set_requires_grad(true);
    let b = (Tensor::randn([c], (Kind::Float, dev)) * 0.2).set_requires_grad(true);
    let (rm, rv) = (Tensor::randn([c], (Kind::Float, dev)) * 0.1, Tensor::ones([c], (Kind::Float, dev)));
    let p = Tensor::randn(shape, (Kind::Float, dev));
    let res = residual.then_some(&r);
    let y = match engine {
        Some(engine) => {
            let bn = BatchNormParams { w: &w, b: &b, running: Some((&rm, &rv)), momentum: 0.1, eps: 1e-5 };
            batch_norm_act_with(engine, &x, &bn, res, relu)
        }
        None => {
            let mut y = x.batch_norm(Some(&w), Some(&b), Some(&rm), Some(&rv), true, 0.1, 1e-5, false);
            if let Some(r) = res {
                y = &y + r;
            }
            if relu {
                y = y.relu();
            }
            y
        }
    };
    assert_eq!(y.kind(), kind, "the output is not in the input's kind");
    (y.to_kind(Kind::Float) * p).sum(Kind::Float).backward();
    let mut out = vec![y.detach().to_kind(Kind::Float), x.grad().to_kind(Kind::Float), w.grad(), b.grad()];
    if residual {
        out.push(r.grad().to_kind(Kind::Float));
    }
    out.extend([rm, rv]);
    out
}

#[test]
fn the_batch_norm_node_matches_libtorchs_layers() {
    // fp32 on the CPU: the reference's written-out backward pass
    // against autograd's, the running statistics as torch's.
    for (relu, residual) in [(true, true), (true, false), (false, false)] {
        let want = bn_grads(None, relu, residual, Device::Cpu, Kind::Float, [4, 16, 5, 3]);
        let got = bn_grads(Some(Engine::Reference), relu, residual, Device::Cpu, Kind::Float, [4, 16, 5, 3]);
        assert_close(&want, &got, max_error, 1e-4, &format!("relu={relu} residual={residual}"));
    }
}

#[test]
fn without_grad_mode_only_the_forward_pass_runs() {
    let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    let _g = tch::no_grad_guard();
    let x = Tensor::randn([3, 8], (Kind::Float, Device::Cpu));
    let f = Tensor::randn([3, 8], (Kind::Float, Device::Cpu));
    let (w, b) = (Tensor::ones([8], (Kind::Float, Device::Cpu)), Tensor::zeros([8], (Kind::Float, Device::Cpu)));
    let (xo, y) = add_norm(&x, Some(&f), None, &w, &b);
    let (pxo, py) = plain(&x, Some(&f), None, &w, &b);
    assert!(xo.allclose(&pxo, 0.0, 0.0, false));
    assert!(y.allclose(&py, 1e-5, 1e-5, false));
}

/// GELU's output and the gradients of x and b, through `bias_gelu` or
/// the plain composition; `buffer`: b has a zeroed gradient buffer
/// beforehand.
fn gelu_grads(fused: bool, buffer: bool, dev: Device, kind: Kind, (n, c): (i64, i64)) -> Vec<Tensor> {
    let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(5);
    let x = (Tensor::randn([n, c], (Kind::Float, dev)) * 2.0).to_kind(kind).set_requires_grad(true);
    let b = (Tensor::randn([c], (Kind::Float, dev)) * 0.5).set_requires_grad(true);
    if buffer {
        torch_ext::set_grad(&b, Some(&b.zeros_like())).unwrap();
    }
    let p = Tensor::randn([n, c], (Kind::Float, dev));
    let y = if fused { bias_gelu(&x, &b) } else { (&x + &b).gelu("tanh") };
    (y.to_kind(Kind::Float) * p).sum(Kind::Float).backward();
    vec![y.to_kind(Kind::Float), x.grad().to_kind(Kind::Float), b.grad()]
}

#[test]
fn bias_gelu_matches_the_plain_composition() {
    for buffer in [false, true] {
        let want = gelu_grads(false, buffer, Device::Cpu, Kind::Float, (5, 24));
        let got = gelu_grads(true, buffer, Device::Cpu, Kind::Float, (5, 24));
        assert_close(&want, &got, max_error, 1e-4, &format!("buffer={buffer}"));
    }
}

/// The largest absolute difference between `a` and `b`.
fn max_error(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// Asserts each of `got` within `tol` of the same place in `want` by
/// `error` ([`max_error`] or [`relative`]); `case` names the case.
fn assert_close(want: &[Tensor], got: &[Tensor], error: fn(&Tensor, &Tensor) -> f64, tol: f64, case: &str) {
    assert_eq!(want.len(), got.len(), "{case}: {} outputs and gradients against {}", got.len(), want.len());
    for (i, (a, b)) in want.iter().zip(got).enumerate() {
        let e = error(a, b);
        assert!(e < tol, "{case}, output/gradient {i}: error {e} (tolerance {tol})");
    }
}

fn relative(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_kind(Kind::Float), b.to_kind(Kind::Float));
    (&a - &b).norm().double_value(&[]) / a.norm().double_value(&[]).max(1e-6)
}

/// Gradients of `w` and `x` for `x @ w^T` in bf16 used twice (as two
/// micro-batches would), and how often the post-accumulate-grad hook
/// ran, with a zeroed `.grad` buffer set beforehand as the data
/// parallel code sets it; `engine`: through [`Linear`], else (None) a
/// plain cast and autograd's accumulation.
/// `tied`: `w` has a second, fp32 use in the same graph (as the tied
/// embedding's lookup).
fn hook_grads(engine: Option<Engine>, tied: bool, dev: Device) -> (Tensor, Tensor, i64) {
    unsafe extern "C" fn count(ctx: *mut std::ffi::c_void, _: i64) {
        // SAFETY: ctx is the AtomicI64 below, alive until the hook is removed.
        unsafe { &*(ctx as *const std::sync::atomic::AtomicI64) }.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
    let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(9);
    let w = Tensor::randn([24, 16], (Kind::Float, dev)).set_requires_grad(true);
    let x = Tensor::randn([5, 16], (Kind::Float, dev)).to_kind(Kind::BFloat16).set_requires_grad(true);
    let p = Tensor::randn([5, 24], (Kind::Float, dev));
    let buffer = Tensor::zeros([24 * 16 + 8], (Kind::Float, dev));
    torch_ext::set_grad(&w, Some(&buffer.narrow(0, 8, 24 * 16).view([24, 16]))).unwrap();
    let calls = std::sync::atomic::AtomicI64::new(0);
    let ctx = &calls as *const _ as *mut std::ffi::c_void;
    // SAFETY: `calls` outlives the hook, removed below.
    unsafe { torch_ext::set_grad_ready_hook(&w, Some(count), ctx, 0) }.unwrap();
    for _ in 0..2 {
        let y = match engine {
            Some(e) => linear_with(e, &x, &w, None, None),
            None => x.matmul(&w.to_kind(Kind::BFloat16).tr()),
        };
        let mut loss = (y.to_kind(Kind::Float) * &p).sum(Kind::Float);
        if tied {
            loss += (&w * 0.25).square().sum(Kind::Float);
        }
        loss.backward();
    }
    // SAFETY: removing the hook.
    unsafe { torch_ext::set_grad_ready_hook(&w, None, std::ptr::null_mut(), 0) }.unwrap();
    let g = w.grad();
    assert_eq!(g.data_ptr(), buffer.narrow(0, 8, 1).data_ptr(), "the gradient stays in its buffer");
    (g.copy(), x.grad().copy(), calls.load(std::sync::atomic::Ordering::SeqCst))
}

#[test]
fn the_linear_node_adds_into_the_buffer_and_signals_it_once() {
    for tied in [false, true] {
        let (gw, gx, calls) = hook_grads(None, tied, Device::Cpu);
        let (fw, fx, fcalls) = hook_grads(Some(Engine::Reference), tied, Device::Cpu);
        // The node sums the weight's gradient in fp32 where autocast
        // rounds it to bf16 first: the same within bf16's epsilon.
        let err = (&gw - &fw).abs().max().double_value(&[]) / gw.abs().max().double_value(&[]);
        assert!(err < 8e-3, "tied={tied}: the weight's gradient differs: relative error {err}");
        assert!(gx.equal(&fx), "tied={tied}: the input's gradient differs");
        assert_eq!((calls, fcalls), (2, 2), "tied={tied}: one hook call per backward pass");
    }
}

#[test]
fn the_linear_node_without_a_buffer_leaves_accumulation_to_autograd() {
    let w = Tensor::full([3, 4], 0.5, (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let x = Tensor::ones([2, 4], (Kind::BFloat16, Device::Cpu));
    linear_with(Engine::Reference, &x, &w, None, None).to_kind(Kind::Float).sum(Kind::Float).backward();
    assert!(w.grad().equal(&Tensor::full([3, 4], 2.0, (Kind::Float, Device::Cpu))));
}

/// The output and the gradients (x, w, then b) of a loss over a linear
/// layer of `n` rows, `i` to `o`: through [`Linear`] on `engine`, or
/// (None) as autocast computes it (bf16 casts, then libtorch's matmul
/// and autograd). `buffers`: w and b have zeroed gradient buffers, which
/// must then hold their gradients. `x` is bf16 (a pre-norm block's
/// LayerNorm output) or fp32 (a post-norm encoder's residual stream),
/// and its gradient comes back in its kind.
fn linear_grads(engine: Option<Engine>, bias: bool, buffers: bool, dev: Device, x_kind: Kind, (n, i, o): (i64, i64, i64)) -> Vec<Tensor> {
    let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(17);
    let x = Tensor::randn([2, n, i], (Kind::Float, dev)).to_kind(Kind::BFloat16).to_kind(x_kind).set_requires_grad(true);
    let w = (Tensor::randn([o, i], (Kind::Float, dev)) * 0.1).set_requires_grad(true);
    let b = (Tensor::randn([o], (Kind::Float, dev)) * 0.1).set_requires_grad(true);
    let p = Tensor::randn([2, n, o], (Kind::Float, dev));
    let kept: Vec<Tensor> = [&w, &b].iter().filter(|_| buffers).map(|t| t.zeros_like()).collect();
    for (t, g) in [&w, &b].iter().zip(&kept) {
        torch_ext::set_grad(t, Some(g)).unwrap();
    }
    let bias_in = bias.then_some(&b);
    let y = match engine {
        Some(e) => linear_with(e, &x, &w, bias_in, None),
        None => x.to_kind(Kind::BFloat16).linear(&w.to_kind(Kind::BFloat16), bias_in.map(|b| b.to_kind(Kind::BFloat16))),
    };
    assert_eq!((y.size(), y.kind()), (vec![2, n, o], Kind::BFloat16));
    (y.to_kind(Kind::Float) * p).sum(Kind::Float).backward();
    assert_eq!(x.grad().kind(), x_kind, "the input's gradient is not in the input's kind");
    for (t, g) in [&w, &b].iter().zip(&kept) {
        if t.grad().defined() {
            assert_eq!(t.grad().data_ptr(), g.data_ptr(), "a gradient left its buffer");
        }
    }
    let mut out = vec![y.to_kind(Kind::Float), x.grad().to_kind(Kind::Float), w.grad()];
    if bias {
        out.push(b.grad());
    }
    out
}

#[test]
fn the_linear_node_gives_autocasts_gradients() {
    // The input's gradient is the same bf16 matmul; the weight's is
    // summed in fp32 instead of rounded to bf16 (within bf16's epsilon).
    for x_kind in [Kind::BFloat16, Kind::Float] {
        for bias in [false, true] {
            for buffers in [false, true] {
                let want = linear_grads(None, bias, buffers, Device::Cpu, x_kind, (7, 24, 40));
                let got = linear_grads(Some(Engine::Reference), bias, buffers, Device::Cpu, x_kind, (7, 24, 40));
                let case = format!("{x_kind:?} input, bias={bias} buffers={buffers}");
                assert!(want[0].equal(&got[0]) && want[1].equal(&got[1]), "{case}: output or input gradient differs");
                for (k, (a, b)) in want.iter().zip(&got).enumerate().skip(2) {
                    let rel = relative(a, b);
                    assert!(rel < 8e-3, "{case}, gradient {k}: relative error {rel}");
                }
            }
        }
    }
}

/// The outputs and gradients (x, w, b) of a loss over a q, k, v
/// projection of `[2, t, c]` split into `heads` heads: through
/// [`QkvProj`] (`fused`), or through the linear node and autograd's
/// split, both on `engine`. `buffers`: w and b have zeroed gradient
/// buffers, which must then hold their gradients.
fn qkv_grads(fused: bool, engine: Engine, buffers: bool, dev: Device, x_kind: Kind, (t, c, heads): (i64, i64, i64)) -> Vec<Tensor> {
    let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(23);
    let x = Tensor::randn([2, t, c], (Kind::Float, dev)).to_kind(x_kind).set_requires_grad(true);
    let w = (Tensor::randn([3 * c, c], (Kind::Float, dev)) * 0.1).set_requires_grad(true);
    let b = (Tensor::randn([3 * c], (Kind::Float, dev)) * 0.1).set_requires_grad(true);
    let ps: Vec<Tensor> = (0..3).map(|_| Tensor::randn([2, heads, t, c / heads], (Kind::Float, dev))).collect();
    let kept: Vec<Tensor> = [&w, &b].iter().filter(|_| buffers).map(|t| t.zeros_like()).collect();
    for (t, g) in [&w, &b].iter().zip(&kept) {
        torch_ext::set_grad(t, Some(g)).unwrap();
    }
    let (q, k, v) = if fused {
        qkv_with(engine, &x, &w, Some(&b), (2, t, heads))
    } else {
        let y = linear_with(engine, &x, &w, Some(&b), None);
        let parts = y.view([2, t, 3, heads, c / heads]).unbind(2);
        (parts[0].transpose(1, 2), parts[1].transpose(1, 2), parts[2].transpose(1, 2))
    };
    // Only q and v reach the loss: k's gradient is none.
    let loss = (q.to_kind(Kind::Float) * &ps[0]).sum(Kind::Float) + (v.to_kind(Kind::Float) * &ps[2]).sum(Kind::Float);
    loss.backward();
    for (t, g) in [&w, &b].iter().zip(&kept) {
        assert_eq!(t.grad().data_ptr(), g.data_ptr(), "a gradient left its buffer");
    }
    assert_eq!(x.grad().kind(), x_kind, "the input's gradient is not in the input's kind");
    vec![q.to_kind(Kind::Float), k.to_kind(Kind::Float), v.to_kind(Kind::Float), x.grad().to_kind(Kind::Float), w.grad(), b.grad()]
}

#[test]
fn the_qkv_node_gives_the_linear_layers_and_splits_gradients() {
    // The same matmuls on the same packed gradient: equal, bit for bit.
    for x_kind in [Kind::BFloat16, Kind::Float] {
        for buffers in [false, true] {
            let want = qkv_grads(false, Engine::Reference, buffers, Device::Cpu, x_kind, (5, 24, 3));
            let got = qkv_grads(true, Engine::Reference, buffers, Device::Cpu, x_kind, (5, 24, 3));
            for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                assert!(a.equal(b), "{x_kind:?} input, buffers={buffers}: output or gradient {i} differs");
            }
        }
    }
}

/// The output and gradients (h, w1, b1, w2) of a loss over a GPT
/// block's (`act` GELU, `h` bf16) or an encoder layer's (ReLU, fp32)
/// MLP (`n` rows of `c`, `f` hidden units): through [`Mlp`] on `engine`,
/// or (None) as autocast computes the two layers and the activation in
/// libtorch. `buffers`: the parameters have zeroed gradient buffers,
/// which must then hold their gradients.
fn mlp_grads(engine: Option<Engine>, act: Act, buffers: bool, dev: Device, (n, c, f): (i64, i64, i64)) -> Vec<Tensor> {
    let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(29);
    let h_kind = if act == Act::Gelu { Kind::BFloat16 } else { Kind::Float };
    let h = Tensor::randn([2, n, c], (Kind::Float, dev)).to_kind(Kind::BFloat16).to_kind(h_kind).set_requires_grad(true);
    let w1 = (Tensor::randn([f, c], (Kind::Float, dev)) * 0.05).set_requires_grad(true);
    let b1 = (Tensor::randn([f], (Kind::Float, dev)) * 0.1).set_requires_grad(true);
    let w2 = (Tensor::randn([c, f], (Kind::Float, dev)) * 0.05).set_requires_grad(true);
    let p = Tensor::randn([2, n, c], (Kind::Float, dev));
    let params = [&w1, &b1, &w2];
    let kept: Vec<Tensor> = params.iter().filter(|_| buffers).map(|t| t.zeros_like()).collect();
    for (t, g) in params.iter().zip(&kept) {
        torch_ext::set_grad(t, Some(g)).unwrap();
    }
    let y = match engine {
        Some(e) => mlp_with(e, act, &h, &w1, &b1, &w2),
        None => {
            let bf = |t: &Tensor| t.to_kind(Kind::BFloat16);
            let pre = bf(&h).linear(&bf(&w1), Some(&bf(&b1)));
            let m = if act == Act::Gelu { pre.gelu("tanh") } else { pre.relu() };
            m.linear::<Tensor>(&bf(&w2), None)
        }
    };
    assert_eq!((y.size(), y.kind()), (vec![2, n, c], Kind::BFloat16));
    (y.to_kind(Kind::Float) * p).sum(Kind::Float).backward();
    for (t, g) in params.iter().zip(&kept) {
        assert_eq!(t.grad().data_ptr(), g.data_ptr(), "a gradient left its buffer");
    }
    assert_eq!(h.grad().kind(), h_kind, "the input's gradient is not in the input's kind");
    vec![y.to_kind(Kind::Float), h.grad().to_kind(Kind::Float), w1.grad(), b1.grad(), w2.grad()]
}

#[test]
fn the_mlp_node_gives_autocasts_gradients() {
    // The reference sums in fp32 where autocast rounds to bf16 between
    // steps (the bias added in bf16, the weights' gradients rounded):
    // the same within bf16's epsilon, relative to each tensor's size.
    for act in [Act::Gelu, Act::Relu] {
        for buffers in [false, true] {
            let want = mlp_grads(None, act, buffers, Device::Cpu, (9, 16, 64));
            let got = mlp_grads(Some(Engine::Reference), act, buffers, Device::Cpu, (9, 16, 64));
            assert_close(&want, &got, relative, 2e-2, &format!("{act:?} buffers={buffers}"));
        }
    }
}

/// The gradients (wte, wpe) of a loss over GPT-2's embeddings of `b x t`
/// tokens (`seq` positions, `v` words, `c` channels) and, with `tied`,
/// an output layer through the same table: through [`Embed`] and
/// [`tied_linear`]'s node on `engine`, or (None) as libtorch's
/// embeddings and autocast's linear layer compute them. `buffers`: the
/// tables have zeroed gradient buffers, which must then hold them.
fn embed_grads(
    engine: Option<Engine>,
    tied: bool,
    buffers: bool,
    dev: Device,
    (b, t, seq, v, c): (i64, i64, i64, i64, i64),
) -> Vec<Tensor> {
    let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(23);
    let wte = (Tensor::randn([v, c], (Kind::Float, dev)) * 0.1).set_requires_grad(true);
    let wpe = (Tensor::randn([seq, c], (Kind::Float, dev)) * 0.1).set_requires_grad(true);
    // Few words, so that tokens repeat within and across rows.
    let idx = Tensor::randint(v, [b, t], (Kind::Int64, dev));
    let p = Tensor::randn([b, t, c], (Kind::Float, dev));
    let q = Tensor::randn([b, t, v], (Kind::Float, dev));
    let kept: Vec<Tensor> = [&wte, &wpe].iter().filter(|_| buffers).map(|w| w.zeros_like()).collect();
    for (w, g) in [&wte, &wpe].iter().zip(&kept) {
        torch_ext::set_grad(w, Some(g)).unwrap();
    }
    let (x, head) = match engine {
        Some(e) => {
            let (x, tie) = embed_with(e, &idx, &wte, &wpe);
            let head = tied.then(|| linear_with(e, &x.to_kind(Kind::BFloat16), &wte, None, Some(tie)));
            (x, head)
        }
        None => {
            let pos = Tensor::arange(t, (Kind::Int64, dev));
            let x = Tensor::embedding(&wte, &idx, -1, false, false) + Tensor::embedding(&wpe, &pos, -1, false, false);
            let head = tied.then(|| x.to_kind(Kind::BFloat16).linear::<Tensor>(&wte.to_kind(Kind::BFloat16), None));
            (x, head)
        }
    };
    assert_eq!((x.size(), x.kind()), (vec![b, t, c], Kind::Float));
    let mut loss = (&x * &p).sum(Kind::Float);
    if let Some(h) = head {
        loss += (h.to_kind(Kind::Float) * &q).sum(Kind::Float);
    }
    loss.backward();
    for (w, g) in [&wte, &wpe].iter().zip(&kept) {
        assert_eq!(w.grad().data_ptr(), g.data_ptr(), "a gradient left its buffer");
    }
    vec![x.detach(), wte.grad(), wpe.grad()]
}

/// `embed_grads` through `engine` against libtorch, every case: tied or
/// not, gradient buffers or not, all positions or fewer.
fn check_embed(engine: Engine, dev: Device, shapes: &[(i64, i64, i64, i64, i64)]) {
    for &shape in shapes {
        for tied in [false, true] {
            for buffers in [false, true] {
                let want = embed_grads(None, tied, buffers, dev, shape);
                let got = embed_grads(Some(engine), tied, buffers, dev, shape);
                assert!(want[0].equal(&got[0]), "{shape:?}: the embeddings differ");
                for (k, (a, b)) in want.iter().zip(&got).enumerate().skip(1) {
                    // The output layer's part of the table's gradient is
                    // summed in fp32, autocast's rounded to bf16.
                    let rel = relative(a, b);
                    let tol = if tied && k == 1 { 8e-3 } else { 1e-5 };
                    assert!(rel < tol, "{shape:?} tied={tied} buffers={buffers}, gradient {k}: relative error {rel}");
                }
            }
        }
    }
}

#[test]
fn the_embedding_node_gives_libtorchs_gradients() {
    check_embed(Engine::Reference, Device::Cpu, &[(3, 8, 8, 11, 16), (2, 5, 8, 7, 12)]);
}

#[test]
fn cuda_max_pool_matches_libtorch() {
    if !harness_runtime::device::init_cuda() {
        eprintln!("skipped: no CUDA device (this test runs on the GPU machines)");
        return;
    }
    let dev = Device::Cuda(0);
    // ResNet's stem pooling at its size, odd sides, other windows; values
    // on a coarse grid so that windows hold ties (the first maximum in
    // row-major order wins, as libtorch's), and a NaN.
    let stem = Pool { k: 3, stride: 2, pad: 1 };
    let cases = [
        ([32, 64, 112, 112], stem),
        ([3, 8, 7, 9], stem),
        ([2, 16, 10, 11], Pool { k: 2, stride: 2, pad: 0 }),
        ([2, 24, 9, 8], Pool { k: 3, stride: 1, pad: 1 }),
        ([1, 8, 13, 13], Pool { k: 5, stride: 3, pad: 2 }),
    ];
    for (shape, pool) in cases {
        let (x, dy) = {
            let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
            let x = Tensor::randint(7, shape, (Kind::Float, dev)) - 3.0;
            let y_shape = [shape[0], shape[1], pool.out(shape[2]), pool.out(shape[3])];
            (x, Tensor::randn(y_shape, (Kind::Float, dev)).to_kind(Kind::BFloat16))
        };
        let x = channels_last(&x.to_kind(Kind::BFloat16));
        let _ = x.permute([0, 2, 3, 1]).view([-1]).get(5).fill_(f64::NAN);
        assert!(max_pool_cuda_fits(&x, pool), "{shape:?} {pool:?}: the kernels should take it");
        let run = |fused: bool| {
            let x = x.detach().set_requires_grad(true);
            let y = if fused { max_pool(&x, pool) } else { libtorch_max_pool(&x, pool) };
            (y.to_kind(Kind::Float) * dy.to_kind(Kind::Float)).sum(Kind::Float).backward();
            (y.detach(), x.grad())
        };
        let ((y, dx), (want_y, want_dx)) = (run(true), run(false));
        let case = format!("max pool {shape:?} {pool:?}");
        assert!(is_channels_last(&y) && y.size() == want_y.size(), "{case}: the output's shape or layout");
        assert!(
            y.isnan().equal(&want_y.isnan()) && y.nan_to_num(0.0, None, None).equal(&want_y.nan_to_num(0.0, None, None)),
            "{case}: outputs differ"
        );
        let err = relative(&want_dx, &dx);
        assert!(err < 1e-3, "{case}: the input's gradient differs ({err})");
    }
}

#[test]
fn cuda_weight_gradient_added_by_the_matmul() {
    if !harness_runtime::device::init_cuda() {
        eprintln!("skipped: no CUDA device (this test runs on the GPU machines)");
        return;
    }
    let dev = Device::Cuda(0);
    // A weight's gradient added into its buffer by the matmul itself
    // (its epilogue reads the buffer): the matmul's fp32 sums plus the
    // buffer, as the gradient out of the matmul followed by an fp32 add.
    for (n, o, k) in [(512, 2304, 768), (33, 8 * 130, 64)] {
        let (dy, x, into) = {
            let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
            let bf = |s: [i64; 2]| Tensor::randn(s, (Kind::Float, dev)).to_kind(Kind::BFloat16);
            (bf([n, o]), bf([n, k]), Tensor::randn([o, k], (Kind::Float, dev)))
        };
        let want = &into + harness_kernels::blaslt::weight_grad(&dy, &x).unwrap();
        let got = into.copy();
        harness_kernels::blaslt::weight_grad_into(&dy, &x, &got, true).unwrap();
        let err = (&want - &got).abs().max().double_value(&[]) / want.abs().max().double_value(&[]);
        assert!(err < 1e-6, "weight gradient added by the matmul [{n}, {o}, {k}]: relative error {err}");
        // A step's first write (beta = 0) never reads the buffer: NaNs
        // there are overwritten with the matmul's sums, bit for bit.
        let stale = Tensor::full([o, k], f64::NAN, (Kind::Float, dev));
        harness_kernels::blaslt::weight_grad_into(&dy, &x, &stale, false).unwrap();
        assert!(stale.equal(&harness_kernels::blaslt::weight_grad(&dy, &x).unwrap()), "the first write [{n}, {o}, {k}] differs");
    }
}

#[test]
fn cuda_kernels_match_the_reference() {
    if !harness_runtime::device::init_cuda() {
        eprintln!("skipped: no CUDA device (this test runs on the GPU machines)");
        return;
    }
    let dev = Device::Cuda(0);
    // A warp per row (768; 256 with several rows per warp) and a
    // block per row (16, 2048).
    for shape in [(6, 16), (300, 768), (5000, 256), (64, 2048)] {
        for (residual, bias) in CASES {
            for buffers in [false, true] {
                let want = grads(plain, residual, bias, buffers, dev, Kind::BFloat16, shape);
                let got = grads(add_norm, residual, bias, buffers, dev, Kind::BFloat16, shape);
                assert_close(&want, &got, relative, 2e-2, &format!("{shape:?} residual={residual} bias={bias} buffers={buffers}"));
            }
        }
    }
    // RMS normalisation (t5): T5-large's and T5-small's widths (a warp
    // per row), a block per row (2048) and a width of several rows per
    // warp, against the plain composition in fp32.
    for shape in [(300, 1024), (700, 512), (64, 2048), (5000, 256), (6, 16)] {
        for residual in [true, false] {
            for buffer in [false, true] {
                let want = rms_grads(None, residual, buffer, dev, Kind::BFloat16, shape);
                let got = rms_grads(Some(Engine::Cuda), residual, buffer, dev, Kind::BFloat16, shape);
                assert_close(&want, &got, relative, 1e-2, &format!("RMS {shape:?} residual={residual} buffer={buffer}"));
            }
        }
    }
    // Batch norm with its ReLU and residual (ResNet-50's widths and
    // positions per image, a 7 x 7 one of 2048 channels, and the
    // smallest width), channels-last bf16, against the reference's
    // maths on the same device (fp32, rounded to bf16 at the end, as
    // the kernels) and, more loosely, against libtorch's layers: their
    // bf16 rounding before the ReLU flips its mask where the input is
    // near 0, and the gradient differs there by the whole of dy.
    for shape in [[8, 64, 28, 28], [4, 256, 14, 14], [6, 2048, 7, 7], [3, 8, 5, 5], [2, 512, 7, 9]] {
        for (relu, residual) in [(true, true), (true, false), (false, false)] {
            let case = format!("batch norm {shape:?} relu={relu} residual={residual}");
            let got = bn_grads(Some(Engine::Cuda), relu, residual, dev, Kind::BFloat16, shape);
            let want = bn_grads(Some(Engine::Reference), relu, residual, dev, Kind::BFloat16, shape);
            assert_close(&want, &got, relative, 1e-2, &case);
            let libtorch = bn_grads(None, relu, residual, dev, Kind::BFloat16, shape);
            assert_close(&libtorch, &got, relative, 6e-2, &format!("{case}, against libtorch"));
        }
    }
    // A batch norm weight and bias inside a flat buffer (ZeRO), 4 bytes
    // off 16: the same results as aligned copies (the kernels load 8
    // channels at a time).
    {
        let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        let (m, c) = (512, 64);
        let x = Tensor::randn([m, c], (Kind::Float, dev)).to_kind(Kind::BFloat16);
        let dy = Tensor::randn([m, c], (Kind::Float, dev)).to_kind(Kind::BFloat16);
        let flat = Tensor::randn([1 + 2 * c], (Kind::Float, dev));
        let (w, b) = (flat.narrow(0, 1, c), flat.narrow(0, 1 + c, c));
        let run = |w: &Tensor, b: &Tensor| {
            let out = kernels::batch_norm(&x, w, b, None, None, 0.1, 1e-5, true).unwrap();
            let (dx, _, sums) = kernels::batch_norm_backward(&dy, out.relu_mask.as_ref(), &x, &out.mean, &out.rstd, w, false).unwrap();
            [out.y, dx, sums]
        };
        let (off, aligned) = (run(&w, &b), run(&w.copy(), &b.copy()));
        assert!(off.iter().zip(&aligned).all(|(a, b)| a.equal(b)), "batch norm: an unaligned weight changed the results");
        // The ReLU's mask: bit j of byte i where y's element 8 i + j is
        // above 0, bit for bit.
        let out = kernels::batch_norm(&x, &w, &b, None, None, 0.1, 1e-5, true).unwrap();
        let weights = Tensor::from_slice(&[1i64, 2, 4, 8, 16, 32, 64, 128]).to_device(dev);
        let want = (out.y.gt(0.0).to_kind(Kind::Int64).view([-1, 8]) * weights).sum_dim_intlist(1, false, Kind::Int64);
        let mask = out.relu_mask.expect("a mask with the ReLU").to_kind(Kind::Int64);
        assert!(mask.equal(&want), "batch norm: the ReLU's mask is not y > 0");
    }
    // Post-norm (fp32 rows out, fp32 gradients in): the claims5
    // encoder's width, a block per row (2048), several rows per warp.
    for shape in [(300, 512), (64, 2048), (5000, 256)] {
        for buffers in [false, true] {
            let want = post_grads(false, buffers, dev, Kind::BFloat16, shape);
            let got = post_grads(true, buffers, dev, Kind::BFloat16, shape);
            assert_close(&want, &got, relative, 1e-2, &format!("post-norm {shape:?} buffers={buffers}"));
        }
    }
    for tied in [false, true] {
        let (gw, gx, calls) = hook_grads(None, tied, dev);
        let (fw, fx, fcalls) = hook_grads(Some(Engine::Cuda), tied, dev);
        let err = (&gw - &fw).abs().max().double_value(&[]) / gw.abs().max().double_value(&[]);
        let errx = relative(&gx, &fx);
        assert!(err < 8e-3 && errx < 1e-2 && calls == fcalls, "linear on CUDA (tied={tied}): not autograd's gradients ({err}, {errx})");
    }
    for n in [8 * 1000, 8 * 1000 + 5, 3] {
        let w = {
            let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
            Tensor::randn([n], (Kind::Float, dev)) * 100.0
        };
        assert!(kernels::cast_bf16(&w).unwrap().equal(&w.to_kind(Kind::BFloat16)), "cast of {n}: not libtorch's rounding");
    }
    // The list cast: more tensors than one launch takes, sizes off the
    // chunk and the vector width, one view not 16-byte aligned.
    {
        let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        let mut ws: Vec<Tensor> = (0..60).map(|i| Tensor::randn([3 + 7 * i, 16400 + i], (Kind::Float, dev)) * 10.0).collect();
        ws.push(Tensor::randn([1001], (Kind::Float, dev)).narrow(0, 1, 1000));
        let casts = kernels::cast_bf16_list(&ws).unwrap();
        for (i, (w, c)) in ws.iter().zip(&casts).enumerate() {
            assert!(c.equal(&w.to_kind(Kind::BFloat16)), "list cast {i}: not libtorch's rounding");
        }
    }
    // GPT-2 124M's attention projection (with its bias) and a width not
    // a multiple of the column sums' blocks.
    // The claims5 encoder's feed-forward layer takes fp32 rows (its
    // post-norm residual stream).
    for (shape, x_kind) in [((512, 768, 2304), Kind::BFloat16), ((33, 64, 8 * 130), Kind::BFloat16), ((256, 512, 2048), Kind::Float)] {
        for (bias, buffers) in [(true, false), (true, true), (false, false)] {
            let want = linear_grads(None, bias, buffers, dev, x_kind, shape);
            let got = linear_grads(Some(Engine::Cuda), bias, buffers, dev, x_kind, shape);
            assert_close(&want, &got, relative, 1e-2, &format!("linear {shape:?} {x_kind:?} bias={bias} buffers={buffers}"));
        }
    }
    // The q, k, v node's packing kernel against the linear node and
    // autograd's split: GPT-2 124M's widths, and a width not a multiple
    // of the kernel's blocks (its bias sums in another order).
    // The claims5 encoder's projection takes fp32 rows.
    for (shape, x_kind) in [((256, 768, 12), Kind::BFloat16), ((33, 64 * 5, 5), Kind::BFloat16), ((128, 512, 8), Kind::Float)] {
        for buffers in [false, true] {
            let want = qkv_grads(false, Engine::Cuda, buffers, dev, x_kind, shape);
            let got = qkv_grads(true, Engine::Cuda, buffers, dev, x_kind, shape);
            assert_close(&want, &got, relative, 1e-5, &format!("qkv {shape:?} {x_kind:?} buffers={buffers}"));
        }
    }
    for shape in [(5, 24), (300, 3072), (64, 8192)] {
        for buffer in [false, true] {
            let want = gelu_grads(false, buffer, dev, Kind::BFloat16, shape);
            let got = gelu_grads(true, buffer, dev, Kind::BFloat16, shape);
            assert_close(&want, &got, relative, 2e-2, &format!("GELU {shape:?} buffer={buffer}"));
        }
    }
    // cuBLASLt's epilogues against the reference (GPT-2 124M's and the
    // claims5 encoder's widths, and small ones), where cuBLASLt has
    // algorithms for them.
    for (act, shape) in
        [(Act::Gelu, (512, 768, 3072)), (Act::Gelu, (40, 64, 256)), (Act::Relu, (512, 512, 2048)), (Act::Relu, (40, 64, 256))]
    {
        if !harness_kernels::blaslt::mlp_fits(act, 2 * shape.0, shape.1, shape.2, shape.1) {
            eprintln!("cuBLASLt has no {act:?} epilogues for {shape:?}: the fused MLP is not used there");
            continue;
        }
        for buffers in [false, true] {
            let want = mlp_grads(Some(Engine::Reference), act, buffers, dev, shape);
            let got = mlp_grads(Some(Engine::Cuda), act, buffers, dev, shape);
            assert_close(&want, &got, relative, 2e-2, &format!("{act:?} MLP {shape:?} buffers={buffers}"));
        }
    }
    // The epilogue's GELU is the tanh approximation (GPT-2's), not erf:
    // pre-activations near -2.5, where the two differ by more than
    // bf16's step at the output's size.
    {
        let (n, c, f) = (64i64, 64i64, 128i64);
        let h = Tensor::ones([n, c], (Kind::BFloat16, dev));
        let w = (Tensor::linspace(-2.0, -3.0, f, (Kind::Float, dev)) / c as f64).unsqueeze(1).expand([f, c], false).contiguous();
        let b = Tensor::zeros([f], (Kind::Float, dev));
        let (pre, m) = harness_kernels::blaslt::act_forward(Act::Gelu, &h, &w.to_kind(Kind::BFloat16), &b).unwrap();
        let x = pre.to_kind(Kind::Float);
        let m = m.to_kind(Kind::Float);
        let tanh = (&m - x.gelu("tanh")).abs().max().double_value(&[]);
        let erf = (&m - x.gelu("none")).abs().max().double_value(&[]);
        assert!(tanh < erf, "cuBLASLt's GELU is closer to erf ({erf}) than to tanh ({tanh})");
    }
    // GPT-2's widths, a row of 4 channels, and fewer positions than the
    // table: the kernels against libtorch (atomic adds in another order).
    check_embed(Engine::Cuda, dev, &[(4, 64, 64, 50, 768), (3, 5, 8, 7, 4), (2, 100, 128, 1000, 1600)]);
    // Tables that start off 16 bytes (as in a ZeRO flat buffer): the
    // node runs libtorch's maths instead of the vector kernels.
    {
        let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
        let flat = Tensor::randn([1 + 50 * 8 + 16 * 8], (Kind::Float, dev));
        let wte = flat.narrow(0, 1, 50 * 8).view([50, 8]).detach().set_requires_grad(true);
        let wpe = flat.narrow(0, 1 + 50 * 8, 16 * 8).view([16, 8]).detach().set_requires_grad(true);
        let idx = Tensor::randint(50, [2, 16], (Kind::Int64, dev));
        let (x, _) = embed_with(Engine::Cuda, &idx, &wte, &wpe);
        x.sum(Kind::Float).backward();
        let pos = Tensor::arange(16, (Kind::Int64, dev));
        let want = Tensor::embedding(&wte, &idx, -1, false, false) + Tensor::embedding(&wpe, &pos, -1, false, false);
        assert!(x.allclose(&want, 1e-6, 1e-6, false), "unaligned tables: wrong embeddings");
        let counts = Tensor::zeros([50], (Kind::Float, dev)).index_add(0, &idx.reshape([-1]), &Tensor::ones([32], (Kind::Float, dev)));
        assert!(
            wte.grad().sum_dim_intlist(1, false, Kind::Float).allclose(&(counts * 8.0), 1e-5, 1e-5, false),
            "unaligned tables: wrong gradient"
        );
    }
}
