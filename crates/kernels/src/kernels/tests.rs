use super::launch::ADAM_MAX;
use super::weights::first_blocks;
use super::*;
use crate::torch_ext::Lr;

/// Skips (with a message) where no GPU is usable.
fn cuda() -> bool {
    if crate::torch_ext::cuda_available() {
        true
    } else {
        eprintln!("skipped: no CUDA device (this test runs on the GPU machines)");
        false
    }
}

/// The replica check's kernel gives the shim's number bit for bit, for
/// every word width and for lengths around the rows of 1024 words, and a
/// sign flipped in one slice changes it.
#[test]
fn cuda_word_hashes_equal_the_shims_and_see_a_flipped_sign() {
    if !cuda() {
        return;
    }
    let dev = tch::Device::Cuda(0);
    let mut ts = Vec::new();
    for (i, n) in [1i64, 1023, 1024, 1025, 3 * 1024 + 7, 5_000_003].into_iter().enumerate() {
        let x = Tensor::randn([n], (Kind::Float, dev)) * 3.0;
        ts.push(x.to_kind([Kind::Float, Kind::BFloat16, Kind::Half, Kind::Float, Kind::BFloat16, Kind::Float][i]));
    }
    ts.push(Tensor::randint(1 << 40, [4099], (Kind::Int64, dev)) - (1i64 << 39));
    ts.push(Tensor::randint(256, [2051], (Kind::Int64, dev)).to_kind(Kind::Int8));
    let ours = Vec::<i64>::try_from(&word_hashes(&ts).unwrap()).unwrap();
    let shim = Vec::<i64>::try_from(&crate::torch_ext::param_hashes(&ts).unwrap()).unwrap();
    assert_eq!(ours, shim);
    let flipped = ts[5].copy();
    let _ = flipped.narrow(0, 1000, 4096).neg_();
    let again = Vec::<i64>::try_from(&word_hashes(&[ts[5].shallow_clone(), flipped]).unwrap()).unwrap();
    assert_eq!(again[0], ours[5]);
    assert_ne!(again[1], ours[5], "a sign flipped in a slice left the hash unchanged");
}

/// A captured graph replays libtorch's operations and harness's own
/// kernels on the inputs of each replay: the kernels launch on the
/// capture's stream (launched on the legacy stream, they would have run
/// once at capture and never again).
#[test]
fn cuda_graph_replays_libtorch_and_harness_kernels_on_new_inputs() {
    if !cuda() {
        return;
    }
    assert!(crate::torch_ext::has_cuda_graphs(), "this build's shim has no CUDA graphs");
    let _turn = crate::torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    let dev = tch::Device::Cuda(0);
    let x = Tensor::zeros([128, 256], (Kind::Float, dev));
    let w = Tensor::randn([256, 64], (Kind::Float, dev));
    let work = || -> anyhow::Result<Tensor> {
        let h = cast_bf16(&x.matmul(&w).relu())?;
        Ok(h.to_kind(Kind::Float).sum(Kind::Float))
    };
    let mut g = crate::torch_ext::CudaGraph::new().unwrap();
    let _ = g.on_side_stream(work).unwrap();
    let out = g.capture(work).unwrap();
    assert!(g.replay().is_ok());
    for k in 1..4 {
        x.shallow_clone().copy_(&Tensor::randn([128, 256], (Kind::Float, dev)));
        g.replay().unwrap();
        let want = work().unwrap().double_value(&[]);
        let got = out.double_value(&[]);
        assert!(got != 0.0 && (got - want).abs() <= 1e-3 * want.abs(), "replay {k}: {got} against eager {want}");
    }
}

#[test]
fn list_launches_give_each_tensor_its_blocks() {
    // The list kernels find a block's tensor by binary search over
    // first_block: each tensor's chunks in order, empty ones none, the
    // total closing the list.
    let (first, total) = first_blocks(&[2 * 8192 + 1, 5, 0, 8192], 8192).unwrap();
    assert_eq!((&first[..5], total), (&[0, 3, 4, 4, 5][..], 5));
    assert!(first_blocks(&vec![1; ADAM_MAX + 1], 8192).is_err(), "more tensors than one launch takes");
}

#[test]
fn kernel_source_compiles_for_hopper() {
    // NVRTC runs without a GPU; the CPU test environment has libnvrtc.
    let ptx = launch::compile(9, 0).unwrap();
    assert!(ptx.contains(".entry ce_bf16"), "{ptx}");
    let comm = launch::compile_program(launch::COMM_SOURCE, 9, 0, Vec::new()).unwrap();
    assert!(comm.contains(".entry scale_f32"), "{comm}");
    assert!(ptx.contains(".entry spin_until") && ptx.contains("globaltimer"), "{ptx}");
    for k in [
        "add_ln_fwd",
        "add_ln_fwd_f32",
        "add_ln_fwd_warp",
        "add_ln_fwd_warp_f32",
        "add_ln_bwd",
        "add_ln_bwd_f32",
        "add_ln_bwd_warp8",
        "add_ln_bwd_warp_f32_4",
        "add_rms_fwd",
        "add_rms_fwd_warp",
        "add_rms_bwd",
        "add_rms_bwd_warp8",
        "bias_gelu_fwd",
        "bias_gelu_bwd",
        "cast_bf16",
        "add_partials",
        "col_sums_bf16",
        "relu_bwd",
        "embed_fwd",
        "embed_bwd",
        "adamw",
        "adamw_steps",
        "cast_list",
        "bn_stats",
        "bn_stats_finish",
        "bn_apply",
        "bn_bwd_sums",
        "bn_bwd_apply",
        "max_pool_fwd",
        "max_pool_bwd",
    ] {
        assert!(ptx.contains(&format!(".entry {k}")), "{k} missing");
    }
    assert!(ptx.contains("tanh.approx.f32"), "Hopper gets the hardware tanh");
}

/// The reduce-scatter's division: each element times the factor, on
/// the vectorised path and the scalar one, nothing written past the end.
#[test]
fn cuda_scale_matches_libtorch() {
    if !cuda() {
        return;
    }
    let _turn = crate::torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    let dev = tch::Device::Cuda(0);
    let stream = crate::torch_ext::current_cuda_stream().unwrap();
    for c in [1i64 << 20, 1_000_003, 3] {
        let x = Tensor::randn([c + 4], (Kind::Float, dev));
        let want = x.narrow(0, 0, c) * 0.25;
        let tail = Vec::<f32>::try_from(&x.narrow(0, c, 4)).unwrap();
        scale_on(stream, &x.narrow(0, 0, c), 0.25).unwrap();
        assert!(x.narrow(0, 0, c).equal(&want), "{c} elements: not the product");
        assert_eq!(Vec::<f32>::try_from(&x.narrow(0, c, 4)).unwrap(), tail, "{c} elements: wrote past the end");
    }
}

#[test]
fn cuda_partial_sums_add_up() {
    if !cuda() {
        return;
    }
    let _turn = crate::torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    let dev = tch::Device::Cuda(0);
    // Fewer rows than a block's row strides and many more (the shapes
    // of GPT-2 124M's LayerNorm and GELU kernels), and a width that is
    // not a multiple of the 32 columns of a block.
    for (b, k, c) in [(1, 1, 8), (63, 3, 768), (64, 3, 768), (1320, 3, 768), (704, 1, 3072), (77, 2, 40)] {
        let part = Partials(Tensor::randn([b, k, c], (Kind::Float, dev)));
        let gs: Vec<Tensor> = (0..k).map(|_| Tensor::randn([c], (Kind::Float, dev))).collect();
        let sums = part.0.sum_dim_intlist(0, false, Kind::Float);
        let err = (part.sums().unwrap() - &sums).abs().max().double_value(&[]);
        assert!(err < 1e-4, "[{b}, {k}, {c}]: sums' max error {err}");
        let want: Vec<Tensor> = gs.iter().enumerate().map(|(i, g)| g + sums.get(i as i64)).collect();
        part.add_into(&gs.iter().collect::<Vec<_>>()).unwrap();
        for (i, (g, w)) in gs.iter().zip(&want).enumerate() {
            let err = (g - w).abs().max().double_value(&[]);
            assert!(err < 1e-4, "[{b}, {k}, {c}], gradient {i}: max error {err}");
        }
        // The first gradient written over a stale (NaN) buffer, the
        // others added, in the same launch.
        let stale: Vec<Tensor> =
            (0..k).map(|i| if i == 0 { Tensor::full([c], f64::NAN, (Kind::Float, dev)) } else { gs[i as usize].copy() }).collect();
        part.store_into(&stale.iter().collect::<Vec<_>>(), &[true, false, false]).unwrap();
        for (i, g) in stale.iter().enumerate() {
            let want = if i == 0 { sums.get(0) } else { &gs[i] + sums.get(i as i64) };
            let err = (g - &want).abs().max().double_value(&[]);
            assert!(err < 1e-4, "[{b}, {k}, {c}], gradient {i} stored: max error {err}");
        }
    }
}

#[test]
fn cuda_column_sums_match_libtorch() {
    if !cuda() {
        return;
    }
    let _turn = crate::torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    let dev = tch::Device::Cuda(0);
    // GPT-2 124M's attention projection, fewer rows than blocks, a
    // width that leaves threads idle.
    for (n, c) in [(16384, 2304), (3, 64), (1000, 8 * 130)] {
        let x = Tensor::randn([n, c], (Kind::Float, dev)).to_kind(Kind::BFloat16);
        let want = x.to_kind(Kind::Float).sum_dim_intlist(0, false, Kind::Float);
        let got = column_sums_bf16(&x).unwrap().sums().unwrap();
        let err = (got.get(0) - &want).abs().max().double_value(&[]);
        assert!(err < 1e-3 * (n as f64).sqrt(), "[{n}, {c}]: max error {err}");
    }
}

#[test]
fn cuda_adamw_matches_libtorchs_fused_adamw() {
    if !cuda() {
        return;
    }
    let _turn = crate::torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    let dev = tch::Device::Cuda(0);
    let f32s = (Kind::Float, dev);
    // Several blocks with a tail that is not a whole float4, small
    // tensors, a view that starts 4 bytes into its storage (the scalar
    // path), and more tensors than one launch takes.
    let mut params: Vec<Tensor> = vec![
        Tensor::randn([768, 2304], f32s),
        Tensor::randn([8193], f32s),
        Tensor::randn([3], f32s),
        Tensor::randn([5, 7], f32s),
        Tensor::randn([50_002], f32s).narrow(0, 1, 50_001),
    ];
    params.extend((0..50).map(|i| Tensor::randn([64 + i], f32s)));
    let zeros = |ps: &[Tensor]| ps.iter().map(|p| p.zeros_like()).collect::<Vec<_>>();
    let copies = |ps: &[Tensor]| ps.iter().map(|p| p.copy()).collect::<Vec<_>>();
    let (ours, theirs) = (copies(&params), copies(&params));
    let (m1, v1, m2, v2) = (zeros(&params), zeros(&params), zeros(&params), zeros(&params));
    let steps = || params.iter().map(|_| Tensor::zeros([], f32s)).collect::<Vec<_>>();
    let (s1, s2) = (steps(), steps());
    let lr_t = Tensor::full([], 3e-3, f32s);
    let scale = Tensor::full([], 2.5, f32s);
    for step in 0..4 {
        let grads: Vec<Tensor> = params.iter().map(|p| p.randn_like()).collect();
        // Host then device learning rate, a gradient scale, a skipped
        // update (found_inf = 1), then a taken one (0).
        let lr = if step == 0 { Lr::Host(1e-3) } else { Lr::Device(&lr_t) };
        let gs = (step == 1).then_some(&scale);
        let fi = match step {
            2 => Some(Tensor::ones([], f32s)),
            3 => Some(Tensor::zeros([], f32s)),
            _ => None,
        };
        let h = crate::torch_ext::AdamWStep { lr, beta1: 0.9, beta2: 0.95, weight_decay: 0.1, eps: 1e-8 };
        crate::torch_ext::fused_adamw(&theirs, &copies(&grads), &m2, &v2, &s2, h, fi.as_ref(), gs).unwrap();
        let lr = match lr {
            Lr::Host(lr) => (lr, None),
            Lr::Device(t) => (f64::NAN, Some(t)),
        };
        assert!(adamw(&ours, &grads, &m1, &v1, &s1, lr, (0.9, 0.95, 0.1, 1e-8), fi.as_ref(), gs).unwrap(), "the kernel took the tensors");
        for (i, (a, b)) in ours.iter().chain(&m1).chain(&v1).zip(theirs.iter().chain(&m2).chain(&v2)).enumerate() {
            let err = (a - b).abs().max().double_value(&[]) / b.abs().max().double_value(&[]).max(1e-30);
            assert!(err < 1e-6, "step {step}, tensor {i} (params, then m, then v): relative error {err}");
        }
        for (a, b) in s1.iter().zip(&s2) {
            assert_eq!(a.double_value(&[]), b.double_value(&[]), "step {step}: step counts differ");
        }
    }
    assert!(!ours[0].equal(&params[0]), "the parameters moved");
}

#[test]
fn cuda_fused_cross_entropy_matches_libtorch() {
    if !cuda() {
        return;
    }
    // The device's random stream is shared with the tests that run
    // beside this one and compare two draws of the same seed.
    let _turn = crate::torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    let dev = tch::Device::Cuda(0);
    // GPT-2's padded vocabulary; a row wider than a block's shared
    // memory holds on any GPU (read from memory again); a width not a
    // multiple of 8 (the scalar path).
    for (n, v) in [(64, 50304), (2, 131_080), (33, 1000), (7, 77)] {
        let logits = (Tensor::randn([n, v], (Kind::Float, dev)) * 3.0).to_kind(Kind::BFloat16);
        let target = Tensor::randint(v, [n], (Kind::Int64, dev));
        let (loss, grad) = cross_entropy_bf16(&logits, &target, 1.0, None, false).unwrap();
        // The same written over the logits themselves.
        let over = logits.copy();
        let (loss2, grad2) = cross_entropy_bf16(&over, &target, 1.0, None, true).unwrap();
        assert!(loss2.equal(&loss) && grad2.equal(&grad) && over.equal(&grad), "n={n} v={v}: in place, not the same");
        let x = logits.to_kind(Kind::Float).set_requires_grad(true);
        let want = x.cross_entropy_loss::<Tensor>(&target, None, tch::Reduction::Mean, -100, 0.0);
        want.backward();
        let dl = (loss.double_value(&[]) - want.double_value(&[])).abs();
        assert!(dl < 1e-4 * want.double_value(&[]).abs().max(1.0), "n={n} v={v}: loss {loss:?} vs {want:?}");
        let g = grad.to_kind(Kind::Float);
        let rel = (&g - x.grad()).norm().double_value(&[]) / x.grad().norm().double_value(&[]);
        assert!(rel < 1e-2, "n={n} v={v}: gradient relative error {rel}");
    }
}
