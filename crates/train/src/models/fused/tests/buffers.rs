//! The gradient buffers' handle ([`GradBuffer`]): a claim takes the stale
//! mark, every fused layer writes a stale buffer over and then adds, and no
//! code under `models/` reaches a buffer another way.

use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};

use harness_kernels::torch_ext;

use super::super::dense::linear_with;
use super::super::embedding::embed_with;
use super::super::engine::Engine;
use super::super::ffn::mlp_with;
use super::super::grad::GradBuffer;
use super::super::{add_norm, bias_gelu, Act};
use super::relative;

#[test]
fn a_claim_takes_the_stale_mark_once_and_claims_all_or_none() {
    let leaf = |shape: &[i64]| Tensor::zeros(shape, (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let (p, q) = (leaf(&[4]), leaf(&[2, 2]));
    let g = Tensor::full([4], f64::NAN, (Kind::Float, Device::Cpu));
    torch_ext::set_grad(&p, Some(&g)).unwrap();
    crate::stale::mark([&g]);
    assert!(GradBuffer::claim(&q).is_none(), "q has no gradient buffer");
    assert!(GradBuffer::claim_all(&[&p, &q]).is_none(), "q has no gradient buffer");
    let ones = Tensor::ones([4], (Kind::Float, Device::Cpu));
    let b = GradBuffer::claim(&p).expect("p's buffer");
    assert!(b.first(), "a claim that found no buffer for every parameter took p's mark");
    b.store(&ones).unwrap();
    let b = GradBuffer::claim_all(&[&p]).expect("p's buffer").pop().unwrap();
    assert!(!b.first(), "the mark is taken once");
    b.store(&ones).unwrap();
    assert!(g.equal(&Tensor::full([4], 2.0, (Kind::Float, Device::Cpu))), "written over, then added to");
}

/// The gradients of a small GPT-like chain through every fused node that
/// writes gradient buffers (the embedding and its tied output layer, the
/// residual add and LayerNorm twice with one weight, a linear layer with
/// and without its bias, the MLP, the bias and GELU) on `engine`, over two
/// backward passes (two micro-batches). Every parameter has a zeroed
/// gradient buffer, or (`stale`) one full of NaNs marked stale, as the data
/// parallel code leaves them.
fn chain_grads(e: Engine, dev: Device, stale: bool) -> Vec<Tensor> {
    let _turn = torch_ext::GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(37);
    let (b, t, seq, v, c, f) = (4, 20, 24, 50, 64, 256);
    let param = |shape: &[i64], scale: f64, shift: f64| (Tensor::randn(shape, (Kind::Float, dev)) * scale + shift).set_requires_grad(true);
    let (wte, wpe) = (param(&[v, c], 0.1, 0.0), param(&[seq, c], 0.1, 0.0));
    let (lw, lb, fb) = (param(&[c], 0.1, 1.0), param(&[c], 0.1, 0.0), param(&[c], 0.1, 0.0));
    let (wa, w1, b1, w2) = (param(&[c, c], 0.1, 0.0), param(&[f, c], 0.05, 0.0), param(&[f], 0.1, 0.0), param(&[c, f], 0.05, 0.0));
    let (wg, bg, wz, bz) = (param(&[c, c], 0.1, 0.0), param(&[c], 0.1, 0.0), param(&[c, c], 0.1, 0.0), param(&[c], 0.1, 0.0));
    let params = [&wte, &wpe, &lw, &lb, &fb, &wa, &w1, &b1, &w2, &wg, &bg, &wz, &bz];
    let idx = Tensor::randint(v, [b, t], (Kind::Int64, dev));
    let q = Tensor::randn([b, t, v], (Kind::Float, dev));
    let fill = if stale { f64::NAN } else { 0.0 };
    let buffers: Vec<Tensor> = params.iter().map(|p| p.full_like(fill)).collect();
    for (p, g) in params.iter().zip(&buffers) {
        torch_ext::set_grad(p, Some(g)).unwrap();
    }
    if stale {
        crate::stale::mark(buffers.iter());
    }
    // On CUDA the MLP node runs where cuBLASLt has its epilogues.
    let mlp_node = e == Engine::Reference || harness_kernels::blaslt::mlp_fits(Act::Gelu, b * t, c, f, c);
    for _ in 0..2 {
        let (x, tie) = embed_with(e, &idx, &wte, &wpe);
        let (x, h) = add_norm(&x, None, None, &lw, &lb);
        let (x, h) = add_norm(&x, Some(&linear_with(e, &h, &wa, None, None)), Some(&fb), &lw, &lb);
        let m = if mlp_node {
            mlp_with(e, Act::Gelu, &h, &w1, &b1, &w2)
        } else {
            linear_with(e, &bias_gelu(&linear_with(e, &h, &w1, None, None), &b1), &w2, None, None)
        };
        let z = linear_with(e, &bias_gelu(&linear_with(e, &m, &wg, None, None), &bg), &wz, Some(&bz), None);
        let logits = linear_with(e, &(x + z).to_kind(Kind::BFloat16), &wte, None, Some(tie));
        (logits.to_kind(Kind::Float) * &q).sum(Kind::Float).backward();
    }
    crate::stale::forget(buffers.iter());
    for (p, g) in params.iter().zip(&buffers) {
        assert_eq!(p.grad().data_ptr(), g.data_ptr(), "a gradient left its buffer");
    }
    buffers
}

/// [`chain_grads`] with stale buffers against zeroed ones: finite, and the
/// same within `tol` ([`relative`]; 0: equal, bit for bit).
fn check_chain(e: Engine, dev: Device, tol: f64) {
    let (want, got) = (chain_grads(e, dev, false), chain_grads(e, dev, true));
    for (i, (a, b)) in want.iter().zip(&got).enumerate() {
        let finite = |t: &Tensor| t.isfinite().to_kind(Kind::Int64).min().int64_value(&[]) == 1;
        assert!(finite(a) && finite(b), "{e:?}, parameter {i}: a gradient is not finite (a stale buffer added to?)");
        let same = if tol == 0.0 { a.equal(b) } else { relative(a, b) < tol };
        assert!(same, "{e:?}, parameter {i}: a stale buffer gives other gradients than a zeroed one");
    }
}

#[test]
fn every_fused_layer_writes_a_stale_buffer_over_then_adds() {
    check_chain(Engine::Reference, Device::Cpu, 0.0);
}

#[test]
fn cuda_fused_layers_write_a_stale_buffer_over_then_add() {
    if !harness_runtime::device::init_cuda() {
        eprintln!("skipped: no CUDA device (this test runs on the GPU machines)");
        return;
    }
    // The embedding's backward kernel adds its rows by atomic adds, in no
    // fixed order: the same within fp32's rounding.
    check_chain(Engine::Cuda, Device::Cuda(0), 1e-5);
}

/// `src` without its comment lines and its `#[cfg(test)]` items (each to
/// the end of its braces, or to its `;`). Braces in strings are counted
/// too: the check is for code written as the fused layers write it.
fn non_test_code(src: &str) -> String {
    let code: Vec<&str> = src.lines().filter(|l| !l.trim_start().starts_with("//")).collect();
    let code = code.join("\n");
    let mut out = String::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let item = &rest[at..];
        let (mut depth, mut end) = (0usize, item.len());
        for (i, ch) in item.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' if depth == 1 => {
                    end = i + 1;
                    break;
                }
                '}' => depth = depth.saturating_sub(1),
                ';' if depth == 0 => {
                    end = i + 1;
                    break;
                }
                _ => {}
            }
        }
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

/// The files of the modules that `src` (the file at `path`) declares as
/// `#[cfg(test)] mod name;`: `name.rs` and everything under `name/`.
fn test_modules(path: &Path, src: &str) -> Vec<PathBuf> {
    let dir = match path.file_name().and_then(|n| n.to_str()) {
        Some("mod.rs") => path.parent().expect("a folder").to_path_buf(),
        _ => path.with_extension(""),
    };
    let lines: Vec<&str> = src.lines().map(str::trim).collect();
    let declared = lines.windows(2).filter(|w| w[0] == "#[cfg(test)]").filter_map(|w| w[1].strip_prefix("mod ")?.strip_suffix(';'));
    declared.flat_map(|name| [dir.join(format!("{name}.rs")), dir.join(name)]).collect()
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
}

/// A fused layer that read `p.grad()` itself, or took a stale mark, could
/// write a stale buffer without writing over it: the gradients come out
/// wrong without an error. Outside test code, only the handle's module
/// (`fused/grad.rs`) does either.
#[test]
fn no_model_code_reaches_a_gradient_buffer_but_through_the_handle() {
    let sample = "fn a(p: &Tensor) { p.grad(); }\n#[cfg(test)]\nfn b(p: &Tensor) { if x { p.grad(); } }\n#[cfg(test)]\nmod c;\nfn d() {}\n";
    assert_eq!(non_test_code(sample), "fn a(p: &Tensor) { p.grad(); }\n\n\nfn d() {}", "the check's reading of test code");
    let models = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/models");
    let handle = models.join("fused/grad.rs");
    let mut files = Vec::new();
    rust_files(&models, &mut files);
    let read = |p: PathBuf| {
        let src = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()));
        (p, src)
    };
    let sources: Vec<(PathBuf, String)> = files.into_iter().map(read).collect();
    assert!(sources.iter().any(|(p, _)| *p == handle), "the handle's module moved: {}", handle.display());
    let tests: Vec<PathBuf> = sources.iter().flat_map(|(p, s)| test_modules(p, s)).collect();
    assert!(tests.iter().any(|t| t.ends_with("fused/tests")), "fused/mod.rs declares its tests as `#[cfg(test)] mod tests;`");
    let mut checked = 0;
    for (path, src) in &sources {
        if *path == handle || tests.iter().any(|t| path == t || path.starts_with(t)) {
            continue;
        }
        checked += 1;
        let code = non_test_code(src);
        for pattern in [".grad()", "::grad(", "stale::"] {
            assert!(
                !code.contains(pattern),
                "{}: `{pattern}` outside tests; a fused layer reaches a parameter's gradient buffer only through \
                 `fused::grad::GradBuffer::claim` (which takes the buffer's stale mark)",
                path.display()
            );
        }
    }
    assert!(checked >= 10, "only {checked} files checked under {}", models.display());
}
