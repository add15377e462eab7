use super::*;
use tch::Device;

#[test]
fn fused_adamw_matches_the_textbook_update() {
    let p = Tensor::from_slice(&[1.0f32, -2.0, 0.5]);
    let g = Tensor::from_slice(&[0.1f32, 0.2, -0.3]);
    let (m, v, s) = (p.zeros_like(), p.zeros_like(), Tensor::zeros([], (Kind::Float, Device::Cpu)));
    let h = AdamWStep { lr: Lr::Host(0.1), beta1: 0.9, beta2: 0.999, weight_decay: 0.01, eps: 1e-8 };
    let before: Vec<f32> = Vec::try_from(&p).unwrap();
    fused_adamw(&[p.shallow_clone()], &[g.shallow_clone()], &[m], &[v], &[s], h, None, None).unwrap();
    let after: Vec<f32> = Vec::try_from(&p).unwrap();
    let gs: Vec<f32> = Vec::try_from(&g).unwrap();
    for i in 0..3 {
        // First step: m_hat = g, v_hat = g^2, update = lr * g / (|g| + eps).
        let want = before[i] * (1.0 - 0.1 * 0.01) - 0.1 * gs[i] / (gs[i].abs() + 1e-8);
        assert!((after[i] - want).abs() < 1e-6, "{i}: {} vs {want}", after[i]);
    }
}

#[test]
fn a_gradient_scale_divides_the_gradients_as_the_kernel_reads_them() {
    // The same step from g / 4 and from g with a scale of 4.
    let run = |g: Tensor, scale: Option<&Tensor>| {
        let p = Tensor::from_slice(&[1.0f32, -2.0, 0.5, 3.0]);
        let (m, v, s) = (p.zeros_like(), p.zeros_like(), Tensor::zeros([], (Kind::Float, Device::Cpu)));
        let h = AdamWStep { lr: Lr::Host(0.1), beta1: 0.9, beta2: 0.999, weight_decay: 0.01, eps: 1e-3 };
        fused_adamw(&[p.shallow_clone()], &[g.shallow_clone()], &[m.shallow_clone()], &[v], &[s], h, None, scale).unwrap();
        (p, m, g)
    };
    let g = Tensor::from_slice(&[0.4f32, 0.8, -1.2, 2.0]);
    let (want_p, want_m, _) = run(&g / 4.0, None);
    let (p, m, g_after) = run(g.copy(), Some(&Tensor::from_slice(&[4.0f32]).squeeze()));
    assert!(p.allclose(&want_p, 1e-6, 1e-7, false) && m.allclose(&want_m, 1e-6, 1e-7, false), "{p} vs {want_p}");
    assert!(g_after.allclose(&(g / 4.0), 1e-6, 0.0, false), "the scaled gradient is written back");
    let bad = Tensor::from_slice(&[1.0f64]);
    let p = Tensor::from_slice(&[1.0f32]);
    let h = AdamWStep { lr: Lr::Host(0.1), beta1: 0.9, beta2: 0.999, weight_decay: 0.0, eps: 1e-8 };
    let e = fused_adamw(
        &[p.shallow_clone()],
        &[p.ones_like()],
        &[p.zeros_like()],
        &[p.zeros_like()],
        &[p.zeros_like().squeeze()],
        h,
        None,
        Some(&bad),
    );
    assert!(e.is_err(), "a double scale is refused");
}

#[test]
fn cpu_all_finite_finds_every_non_finite_value_in_every_float_kind() {
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
        // Past one 4096-element chunk, large finite values included.
        let clean = Tensor::linspace(-6e4, 6e4, 10_000, (Kind::Float, Device::Cpu)).to_kind(kind);
        assert_eq!(cpu_all_finite(&clean), Some(true), "{kind:?}");
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            for at in [0, 4095, 4096, 9_999] {
                let t = clean.copy();
                let _ = t.get(at).fill_(bad);
                assert_eq!(cpu_all_finite(&t), Some(false), "{kind:?} {bad} at {at}");
            }
        }
    }
    assert_eq!(cpu_all_finite(&Tensor::from_slice(&[f32::MAX, f32::MIN, 0.0, -0.0])), Some(true));
    assert_eq!(cpu_all_finite(&Tensor::zeros([0], (Kind::Float, Device::Cpu))), Some(true));
    // What it cannot read directly is left to the caller.
    let m = Tensor::ones([4, 4], (Kind::Float, Device::Cpu));
    assert_eq!(cpu_all_finite(&m.tr()), None);
    assert_eq!(cpu_all_finite(&Tensor::ones([4], (Kind::Double, Device::Cpu))), None);
}

#[test]
fn clip_grad_norm_scales_to_the_limit() {
    let a = Tensor::from_slice(&[3.0f32]);
    let b = Tensor::from_slice(&[4.0f32]);
    let n = clip_grad_norm(&[a.shallow_clone(), b.shallow_clone()], Some(1.0)).unwrap();
    assert!((n.double_value(&[]) - 5.0).abs() < 1e-6);
    assert!((a.double_value(&[0]) - 0.6).abs() < 1e-5);
    assert!((b.double_value(&[0]) - 0.8).abs() < 1e-5);
}

#[test]
fn errors_from_libtorch_are_reported_not_thrown() {
    // An integer gradient: libtorch's norm throws; we get an Err.
    let e = clip_grad_norm(&[Tensor::from_slice(&[1i64, 2])], Some(1.0)).unwrap_err();
    assert!(e.0.contains("norm"), "{e}");
}

#[test]
fn seeded_random_repeats_and_leaves_the_global_stream_alone() {
    let _turn = GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(7);
    let before = Tensor::rand([4], (Kind::Float, Device::Cpu));
    tch::manual_seed(7);
    let a = rand_seeded(RandKind::Uniform, &[1000], 42, Device::Cpu).unwrap();
    let b = rand_seeded(RandKind::Uniform, &[1000], 42, Device::Cpu).unwrap();
    let after = Tensor::rand([4], (Kind::Float, Device::Cpu));
    assert!(a.equal(&b));
    assert!(!a.equal(&rand_seeded(RandKind::Uniform, &[1000], 43, Device::Cpu).unwrap()));
    assert!(before.equal(&after), "the global generator moved");
    let p = rand_seeded(RandKind::Permutation, &[50], 1, Device::Cpu).unwrap();
    let sorted = p.sort(0, false).0;
    assert!(sorted.equal(&Tensor::arange(50, (Kind::Int64, Device::Cpu))));
    let n = rand_seeded(RandKind::Normal, &[20000], 3, Device::Cpu).unwrap();
    assert!(n.mean(Kind::Float).double_value(&[]).abs() < 0.05);
}

#[test]
fn backward_accumulates_into_a_gradient_set_as_a_view() {
    // Two parameters whose gradients are views of one flat buffer.
    let flat = Tensor::zeros([5], (Kind::Float, Device::Cpu));
    let a = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
    let b = Tensor::from_slice(&[3.0f32, 4.0, 5.0]).view([3, 1]).set_requires_grad(true);
    set_grad(&a, Some(&flat.narrow(0, 0, 2))).unwrap();
    set_grad(&b, Some(&flat.narrow(0, 2, 3).view([3, 1]))).unwrap();
    // Two backward passes (gradient accumulation): d/da sum(a^2) = 2a, d/db sum(3b) = 3.
    for _ in 0..2 {
        ((&a * &a).sum(Kind::Float) + (&b * 3.0).sum(Kind::Float)).backward();
    }
    assert_eq!(Vec::<f32>::try_from(&flat).unwrap(), [4.0, 8.0, 6.0, 6.0, 6.0]);
    // The gradients are still the views, not copies.
    let g = grads(&[a.shallow_clone(), b.shallow_clone()]).unwrap();
    assert_eq!(g[0].data_ptr(), flat.data_ptr());
    assert_eq!(g[1].size(), [3, 1]);
    // None resets; a wrong shape is refused.
    set_grad(&a, None).unwrap();
    assert!(!grads(&[a.shallow_clone()]).unwrap()[0].defined());
    let e = set_grad(&a, Some(&flat)).unwrap_err();
    assert!(e.0.contains("gradient of shape [5] for a parameter of shape [2]"), "{e}");
}

#[test]
fn grad_ready_hooks_fire_once_per_accumulation() {
    unsafe extern "C" fn count(ctx: *mut c_void, idx: i64) {
        // SAFETY: ctx is the Vec below, alive while the hook is set.
        let v = unsafe { &mut *(ctx as *mut Vec<i64>) };
        v.push(idx);
    }
    let mut seen: Vec<i64> = Vec::new();
    let a = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
    let b = Tensor::from_slice(&[3.0f32]).set_requires_grad(true);
    let ctx = &mut seen as *mut Vec<i64> as *mut c_void;
    // SAFETY: `seen` outlives the hooks, removed below.
    unsafe {
        set_grad_ready_hook(&a, Some(count), ctx, 7).unwrap();
        set_grad_ready_hook(&b, Some(count), ctx, 9).unwrap();
    }
    ((&a * &a).sum(Kind::Float) + (&b * &a.sum(Kind::Float))).sum(Kind::Float).backward();
    let mut got = seen.clone();
    got.sort();
    assert_eq!(got, vec![7, 9]);
    // SAFETY: removing the hooks.
    unsafe {
        set_grad_ready_hook(&a, None, std::ptr::null_mut(), 0).unwrap();
        set_grad_ready_hook(&b, None, std::ptr::null_mut(), 0).unwrap();
    }
    (&a * 2.0).sum(Kind::Float).backward();
    assert_eq!(seen.len(), 2, "a removed hook fired");
}

#[test]
fn arrival_hooks_fire_before_autograd_accumulates() {
    struct Seen {
        a: Tensor,
        at_arrival: Vec<(i64, Vec<f32>)>,
    }
    unsafe extern "C" fn look(ctx: *mut c_void, idx: i64) {
        // SAFETY: ctx is the Seen below, alive while the hook is set.
        let s = unsafe { &mut *(ctx as *mut Seen) };
        let g = s.a.grad();
        let now = if g.defined() { Vec::<f32>::try_from(&g).unwrap() } else { vec![] };
        s.at_arrival.push((idx, now));
    }
    let a = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
    let mut seen = Seen { a: a.shallow_clone(), at_arrival: vec![] };
    // SAFETY: `seen` outlives the hook, removed below.
    let handle = unsafe { set_grad_arrival_hook(&a, look, &mut seen as *mut Seen as *mut c_void, 4).unwrap() };
    (&a * 3.0).sum(Kind::Float).backward();
    (&a * 3.0).sum(Kind::Float).backward();
    // Once per backward pass, each time before that pass's gradient was added.
    assert_eq!(seen.at_arrival, vec![(4, vec![]), (4, vec![3.0, 3.0])]);
    assert_eq!(Vec::<f32>::try_from(&a.grad()).unwrap(), vec![6.0, 6.0]);
    remove_hook(&a, handle).unwrap();
    (&a * 3.0).sum(Kind::Float).backward();
    assert_eq!(seen.at_arrival.len(), 2, "a removed hook fired");
}

/// A two-layer block with dropout: x -> dropout(gelu(x W1)) W2 + x.
fn block(w1: &Tensor, w2: &Tensor) -> impl Fn(&Tensor) -> Tensor + Send + 'static {
    let (w1, w2) = (w1.shallow_clone(), w2.shallow_clone());
    move |x: &Tensor| x.matmul(&w1).gelu("tanh").dropout(0.3, true).matmul(&w2) + x
}

/// Gradients of (w1, w2, x) of `sum(f(f(x))^2)`, the first application
/// through `recompute` or directly.
fn grads_of(again: bool, calls: &std::sync::Arc<std::sync::atomic::AtomicU32>) -> Vec<Tensor> {
    let _turn = GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(5);
    let w1 = Tensor::randn([6, 12], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let w2 = Tensor::randn([12, 6], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let x = Tensor::randn([4, 6], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let f = block(&w1, &w2);
    let counted = {
        let (f, calls) = (block(&w1, &w2), calls.clone());
        move |x: &Tensor| {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            f(x)
        }
    };
    let h = if again { recompute(&x, true, counted).unwrap() } else { counted(&x) };
    // The random draws after the recomputed block are those of a plain run.
    let y = f(&h);
    y.square().sum(Kind::Float).backward();
    vec![w1.grad(), w2.grad(), x.grad()]
}

#[test]
fn recomputation_runs_the_block_again_and_gives_the_same_gradients_bit_for_bit() {
    use std::sync::{atomic::AtomicU32, atomic::Ordering, Arc};
    let (plain_calls, again_calls) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let plain = grads_of(false, &plain_calls);
    let again = grads_of(true, &again_calls);
    assert_eq!(plain_calls.load(Ordering::SeqCst), 1);
    assert_eq!(again_calls.load(Ordering::SeqCst), 2, "the backward pass did not run the block again");
    for (i, (a, b)) in plain.iter().zip(&again).enumerate() {
        assert!(a.defined() && b.defined(), "gradient {i} missing");
        assert!(a.equal(b), "gradient {i} differs: {a} vs {b}");
    }
}

#[test]
fn recomputation_keeps_the_autocast_of_the_forward_pass_and_reports_failures() {
    let w = Tensor::randn([8, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let x = Tensor::randn([2, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let grad = |again: bool| {
        grads_to_none(std::slice::from_ref(&w)).unwrap();
        set_autocast(AutocastDevice::Cpu, Some(Kind::BFloat16)).unwrap();
        let wc = w.shallow_clone();
        let f = move |x: &Tensor| x.matmul(&wc).relu();
        let y = if again { recompute(&x, false, f).unwrap() } else { f(&x) };
        set_autocast(AutocastDevice::Cpu, None).unwrap();
        assert_eq!(y.kind(), Kind::BFloat16);
        // The backward pass runs with autocast off: the recomputation
        // must turn it back on, or its gradients come out in fp32 maths.
        y.to_kind(Kind::Float).sum(Kind::Float).backward();
        w.grad().copy()
    };
    let (plain, again) = (grad(false), grad(true));
    assert!(plain.equal(&again), "bf16 gradients differ: {plain} vs {again}");
    // A block that fails in the backward pass fails the backward pass
    // with its message.
    let fired = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let f = {
        let fired = fired.clone();
        let wc = w.shallow_clone();
        move |x: &Tensor| {
            if fired.swap(true, std::sync::atomic::Ordering::SeqCst) {
                panic!("CUDA out of memory (emulated)");
            }
            x.matmul(&wc)
        }
    };
    let y = recompute(&x, false, f).unwrap();
    let e = backward_with_grad(&y, &y.ones_like()).unwrap_err();
    assert!(e.0.contains("out of memory (emulated)"), "{e}");
}

#[test]
fn dense_tensors_are_contiguous_or_permuted_but_never_strided_or_overlapping() {
    let x = Tensor::arange(2 * 3 * 4 * 5, (Kind::Float, Device::Cpu)).view([2, 3, 4, 5]);
    assert!(is_dense(&x));
    // channels-last: NHWC in memory, NCHW in shape.
    let cl = x.permute([0, 2, 3, 1]).contiguous().permute([0, 3, 1, 2]);
    assert!(!cl.is_contiguous() && is_dense(&cl));
    assert!(is_dense(&x.transpose(1, 2)));
    assert!(!is_dense(&x.narrow(3, 0, 4)), "a slice leaves gaps");
    assert!(!is_dense(&x.select(1, 0).unsqueeze(1).expand([2, 3, 4, 5], false)), "expanded: elements overlap");
    assert!(is_dense(&Tensor::zeros([1, 7, 1], (Kind::Float, Device::Cpu))));
}

#[test]
fn adamw_refuses_mismatched_shapes() {
    let p = Tensor::from_slice(&[1.0f32, 2.0]);
    let g = Tensor::from_slice(&[1.0f32]);
    let (m, v, s) = (p.zeros_like(), p.zeros_like(), Tensor::zeros([], (Kind::Float, Device::Cpu)));
    let h = AdamWStep { lr: Lr::Host(0.1), beta1: 0.9, beta2: 0.999, weight_decay: 0.0, eps: 1e-8 };
    assert!(fused_adamw(&[p], &[g], &[m], &[v], &[s], h, None, None).is_err());
}
