//! Matrix multiplies through cuBLASLt with the activation in their
//! epilogues: the MLP of a GPT block or of an encoder layer (harness's
//! `train::models::fused::mlp`) without a pass of its own for the bias and
//! the GELU or ReLU, forward or backward.
//!
//! Forward, `m = gelu(h w^T + b)` in one matmul whose epilogue adds the bias,
//! keeps the pre-activation (the "aux" output, for the backward pass) and
//! writes the GELU (tanh approximation). Backward, the hidden layer's
//! gradient `dm = dout w2` comes out of its matmul already multiplied by
//! GELU's derivative at the kept pre-activation. ReLU's forward epilogue
//! is the same without the aux output; its derivative is applied by
//! [`crate::kernels::relu_backward`] (cuBLASLt's DRELU epilogue ran as a
//! separate kernel of its own, 0.40 ms per claims5 encoder layer at 64 x 512
//! tokens on an H100, slower than libtorch's separate ReLU backward). cuBLASLt takes the bias in
//! bf16 only with bf16 outputs (as autocast adds it), and its epilogue that
//! also sums the bias's gradient ran at a third of the speed of the plain
//! one on an H100: that sum is [`crate::kernels::column_sums_bf16`]'s.
//! Measured on an H100 for GPT-2 124M's MLP (16 x 1024 tokens): the forward
//! matmul with its epilogue 155 us against 115 us plus 71 us for the bias +
//! GELU kernel; the backward one 147 us against 115 us plus 106 us.
//!
//! Each problem's algorithm is the fastest of cuBLASLt's heuristic's
//! candidates, timed once outside a graph capture (the heuristic's first
//! during one). The calls use libtorch's cuBLASLt handle and workspace (its
//! libcublasLt, found by name when first used) and go to libtorch's current
//! stream, so a CUDA graph capture records them.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

use cudarc::cublaslt::sys;
use cudarc::driver::{result as drv, sys as dsys};
use tch::{Kind, Tensor};

/// Candidates timed per problem.
const CANDIDATES: usize = 8;

/// The epilogues harness uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Epilogue {
    /// `D = A B`.
    Plain,
    /// `D = A B + bias` (bias bf16, one per row of D).
    Bias,
    /// `D = gelu(A B + bias)`, `aux = A B + bias` (bias bf16).
    GeluAuxBias,
    /// `D = (A B) * gelu'(aux)`.
    DGelu,
    /// `D = relu(A B + bias)` (bias bf16).
    ReluBias,
}

impl Epilogue {
    fn sys(self) -> sys::cublasLtEpilogue_t {
        match self {
            Epilogue::Plain => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
            Epilogue::Bias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::GeluAuxBias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            Epilogue::DGelu => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DGELU,
            Epilogue::ReluBias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_RELU_BIAS,
        }
    }

    fn bias(self) -> bool {
        matches!(self, Epilogue::Bias | Epilogue::GeluAuxBias | Epilogue::ReluBias)
    }

    fn aux(self) -> bool {
        matches!(self, Epilogue::GeluAuxBias | Epilogue::DGelu)
    }
}

/// The activation of an MLP's hidden layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Act {
    /// GELU, tanh approximation (GPT-2's); the pre-activation is kept.
    Gelu,
    /// ReLU (`nn.TransformerEncoderLayer`'s); its output tells where the
    /// derivative is 1.
    Relu,
}

impl Act {
    fn forward(self) -> Epilogue {
        match self {
            Act::Gelu => Epilogue::GeluAuxBias,
            Act::Relu => Epilogue::ReluBias,
        }
    }
}

/// A column-major problem (cuBLASLt's view): `D [m, n] = op(A) op(B)`,
/// bf16 operands, fp32 accumulation, D in bf16 or (`f32_out`) fp32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Problem {
    m: u64,
    n: u64,
    k: u64,
    trans_a: bool,
    trans_b: bool,
    epilogue: Epilogue,
    f32_out: bool,
}

type Status = sys::cublasStatus_t;

/// The cuBLASLt entry points harness calls, from the copy of libcublasLt
/// that libtorch loaded (the process's global symbols): its handle belongs
/// to that copy, and a library of the same name found elsewhere on the
/// search path (another CUDA installation) would not take it.
struct Api {
    desc_create: unsafe extern "C" fn(*mut sys::cublasLtMatmulDesc_t, sys::cublasComputeType_t, sys::cudaDataType) -> Status,
    desc_destroy: unsafe extern "C" fn(sys::cublasLtMatmulDesc_t) -> Status,
    desc_set: unsafe extern "C" fn(sys::cublasLtMatmulDesc_t, sys::cublasLtMatmulDescAttributes_t, *const c_void, usize) -> Status,
    layout_create: unsafe extern "C" fn(*mut sys::cublasLtMatrixLayout_t, sys::cudaDataType, u64, u64, i64) -> Status,
    layout_destroy: unsafe extern "C" fn(sys::cublasLtMatrixLayout_t) -> Status,
    pref_create: unsafe extern "C" fn(*mut sys::cublasLtMatmulPreference_t) -> Status,
    pref_destroy: unsafe extern "C" fn(sys::cublasLtMatmulPreference_t) -> Status,
    pref_set:
        unsafe extern "C" fn(sys::cublasLtMatmulPreference_t, sys::cublasLtMatmulPreferenceAttributes_t, *const c_void, usize) -> Status,
    #[allow(clippy::type_complexity)]
    heuristic: unsafe extern "C" fn(
        sys::cublasLtHandle_t,
        sys::cublasLtMatmulDesc_t,
        sys::cublasLtMatrixLayout_t,
        sys::cublasLtMatrixLayout_t,
        sys::cublasLtMatrixLayout_t,
        sys::cublasLtMatrixLayout_t,
        sys::cublasLtMatmulPreference_t,
        i32,
        *mut sys::cublasLtMatmulHeuristicResult_t,
        *mut i32,
    ) -> Status,
    #[allow(clippy::type_complexity)]
    matmul: unsafe extern "C" fn(
        sys::cublasLtHandle_t,
        sys::cublasLtMatmulDesc_t,
        *const c_void,
        *const c_void,
        sys::cublasLtMatrixLayout_t,
        *const c_void,
        sys::cublasLtMatrixLayout_t,
        *const c_void,
        *const c_void,
        sys::cublasLtMatrixLayout_t,
        *mut c_void,
        sys::cublasLtMatrixLayout_t,
        *const sys::cublasLtMatmulAlgo_t,
        *mut c_void,
        usize,
        sys::cudaStream_t,
    ) -> Status,
}

fn api() -> Result<&'static Api, String> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(|| {
        let this = libloading::os::unix::Library::this();
        macro_rules! get {
            ($name:literal) => {
                // SAFETY: the symbol is cuBLASLt's function of that name,
                // whose C signature the field's type spells out; the
                // library stays loaded for the process (libtorch's).
                *unsafe { this.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("{} is not in the process (libtorch without cuBLASLt?): {e}", $name))?
            };
        }
        Ok(Api {
            desc_create: get!("cublasLtMatmulDescCreate"),
            desc_destroy: get!("cublasLtMatmulDescDestroy"),
            desc_set: get!("cublasLtMatmulDescSetAttribute"),
            layout_create: get!("cublasLtMatrixLayoutCreate"),
            layout_destroy: get!("cublasLtMatrixLayoutDestroy"),
            pref_create: get!("cublasLtMatmulPreferenceCreate"),
            pref_destroy: get!("cublasLtMatmulPreferenceDestroy"),
            pref_set: get!("cublasLtMatmulPreferenceSetAttribute"),
            heuristic: get!("cublasLtMatmulAlgoGetHeuristic"),
            matmul: get!("cublasLtMatmul"),
        })
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// A cuBLASLt status as a result.
fn ok(what: &str, s: Status) -> Result<(), String> {
    if s == Status::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(format!("cuBLASLt {what}: {s:?}"))
    }
}

/// The algorithm chosen for each problem seen (none where cuBLASLt has none
/// for it), and whether it was timed.
type Algos = HashMap<Problem, (Option<sys::cublasLtMatmulAlgo_t>, bool)>;

/// libtorch's cuBLASLt handle and workspace for the current thread and
/// stream, and the algorithms chosen so far.
struct Lt {
    api: &'static Api,
    handle: sys::cublasLtHandle_t,
    workspace: *mut c_void,
    bytes: usize,
    algos: &'static Mutex<Algos>,
}

/// libtorch's cuBLASLt with its handle and workspace for this thread's
/// stream.
fn library() -> Result<Lt, String> {
    static ALGOS: OnceLock<Mutex<Algos>> = OnceLock::new();
    let api = api()?;
    let (handle, workspace, bytes) = crate::torch_ext::cublaslt().map_err(|e| e.to_string())?;
    Ok(Lt { api, handle: handle as sys::cublasLtHandle_t, workspace, bytes, algos: ALGOS.get_or_init(Default::default) })
}

/// RAII holders of the per-call descriptors.
struct Desc(&'static Api, sys::cublasLtMatmulDesc_t);
impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by desc_create, destroyed once.
        let _ = unsafe { (self.0.desc_destroy)(self.1) };
    }
}
struct Layout(&'static Api, sys::cublasLtMatrixLayout_t);
impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created by layout_create, destroyed once.
        let _ = unsafe { (self.0.layout_destroy)(self.1) };
    }
}
struct Pref(&'static Api, sys::cublasLtMatmulPreference_t);
impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created by pref_create, destroyed once.
        let _ = unsafe { (self.0.pref_destroy)(self.1) };
    }
}

/// Sets a descriptor attribute from a plain value.
///
/// # Safety
/// `T` must be the attribute's type.
unsafe fn set<T>(d: &Desc, attr: sys::cublasLtMatmulDescAttributes_t, v: &T) -> Result<(), String> {
    // SAFETY: per the contract; the value outlives the call (copied by it).
    ok("attribute", unsafe { (d.0.desc_set)(d.1, attr, v as *const T as *const c_void, std::mem::size_of::<T>()) })
}

/// A layout of `rows x cols` (column-major, packed) of `ty`.
fn layout(api: &'static Api, ty: sys::cudaDataType, rows: u64, cols: u64) -> Result<Layout, String> {
    let mut l = std::ptr::null_mut();
    // SAFETY: l receives a new layout.
    ok("layout", unsafe { (api.layout_create)(&mut l, ty, rows, cols, rows as i64) })?;
    Ok(Layout(api, l))
}

/// The descriptors of `p` with its epilogue's pointers (the bf16 bias, or
/// null, and the aux matrix).
fn describe(api: &'static Api, p: &Problem, bias: *const c_void, aux: *const c_void) -> Result<(Desc, [Layout; 3]), String> {
    use sys::cublasLtMatmulDescAttributes_t as A;
    let mut d = std::ptr::null_mut();
    // SAFETY: d receives a new descriptor.
    ok("descriptor", unsafe { (api.desc_create)(&mut d, sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F) })?;
    let desc = Desc(api, d);
    let op = |t: bool| -> i32 { i32::from(t) }; // CUBLAS_OP_N = 0, CUBLAS_OP_T = 1
    let aux_ld = p.m as i64;
    // SAFETY: each value has its attribute's type (cublasOperation_t and
    // the epilogue enum are 32-bit, pointers are pointers, the leading
    // dimension int64).
    unsafe {
        set(&desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &op(p.trans_a))?;
        set(&desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &op(p.trans_b))?;
        set(&desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &p.epilogue.sys())?;
        if p.epilogue.bias() {
            set(&desc, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias)?;
        }
        if p.epilogue.aux() {
            set(&desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux)?;
            set(&desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld)?;
        }
    }
    let bf = sys::cudaDataType::CUDA_R_16BF;
    let out = if p.f32_out { sys::cudaDataType::CUDA_R_32F } else { bf };
    // Stored (column-major) shapes: op(A) is [m, k], op(B) [k, n].
    let (ar, ac) = if p.trans_a { (p.k, p.m) } else { (p.m, p.k) };
    let (br, bc) = if p.trans_b { (p.n, p.k) } else { (p.k, p.n) };
    Ok((desc, [layout(api, bf, ar, ac)?, layout(api, bf, br, bc)?, layout(api, out, p.m, p.n)?]))
}

/// cuBLASLt's heuristic's candidates for `p` (up to [`CANDIDATES`]).
fn candidates(l: &Lt, desc: &Desc, layouts: &[Layout; 3]) -> Result<Vec<sys::cublasLtMatmulAlgo_t>, String> {
    let mut pr = std::ptr::null_mut();
    // SAFETY: pr receives a new preference.
    ok("preference", unsafe { (l.api.pref_create)(&mut pr) })?;
    let pref = Pref(l.api, pr);
    let ws = l.bytes as u64;
    // SAFETY: zeroed heuristic results are valid plain data, overwritten
    // by the call for the first `count`.
    let mut results: [sys::cublasLtMatmulHeuristicResult_t; CANDIDATES] = unsafe { std::mem::zeroed() };
    let mut count = 0i32;
    // SAFETY: the attribute is a uint64; the descriptors are live; the
    // results array holds CANDIDATES entries.
    unsafe {
        ok(
            "preference",
            (l.api.pref_set)(
                pref.1,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                std::mem::size_of::<u64>(),
            ),
        )?;
        let [a, b, d] = layouts;
        // No algorithm comes back as an error or as none: both are none here.
        let _ = (l.api.heuristic)(l.handle, desc.1, a.1, b.1, d.1, d.1, pref.1, CANDIDATES as i32, results.as_mut_ptr(), &mut count);
    }
    Ok(results
        .iter()
        .take(count.max(0) as usize)
        .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
        .map(|r| r.algo)
        .collect())
}

/// Whether libtorch's current stream is being captured into a graph.
fn capturing(stream: dsys::CUstream) -> bool {
    let mut status = dsys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the stream is libtorch's live current stream.
    let r = unsafe { dsys::cuStreamIsCapturing(stream, &mut status) };
    r != dsys::CUresult::CUDA_SUCCESS || status != dsys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
}

/// Launches `p` with `algo` on `stream`: `D = A B + beta D`.
///
/// # Safety
/// The pointers must be live device memory of the sizes `layouts` describe
/// (and the epilogue's, set in `desc`).
unsafe fn launch(
    l: &Lt,
    desc: &Desc,
    layouts: &[Layout; 3],
    algo: &sys::cublasLtMatmulAlgo_t,
    (a, b, d): (*const c_void, *const c_void, *mut c_void),
    stream: dsys::CUstream,
    beta: f32,
) -> Result<(), String> {
    let alpha = 1f32;
    let [la, lb, ld] = layouts;
    // SAFETY: per the function's contract; alpha and beta are fp32 host
    // scalars (the default pointer mode) and the workspace is libtorch's
    // for this stream, of the bytes it gave.
    ok("matmul", unsafe {
        (l.api.matmul)(
            l.handle,
            desc.1,
            &alpha as *const f32 as *const c_void,
            a,
            la.1,
            b,
            lb.1,
            &beta as *const f32 as *const c_void,
            d,
            ld.1,
            d,
            ld.1,
            algo,
            l.workspace,
            l.bytes,
            stream as sys::cudaStream_t,
        )
    })
}

/// The fastest of `found` for the problem, each timed over a few runs into
/// the real outputs (which the caller's run then overwrites), on `stream`,
/// twice (the better of the two). The device is idle first: the timing
/// must not see other streams' kernels, such as the collectives that a
/// data-parallel backward pass overlaps (on 4 x H100 they had the 1.3B's
/// attention projections take algorithms 70% slower on a quiet GPU, 3.7 ms
/// a step in one traced run). Waiting for a collective cannot stall: every
/// rank started it before reaching the matmul that asks (the same model, in
/// the same order).
fn fastest(
    l: &Lt,
    desc: &Desc,
    layouts: &[Layout; 3],
    found: &[sys::cublasLtMatmulAlgo_t],
    ptrs: (*const c_void, *const c_void, *mut c_void),
    stream: dsys::CUstream,
) -> Option<sys::cublasLtMatmulAlgo_t> {
    let ev = || drv::event::create(dsys::CUevent_flags::CU_EVENT_DEFAULT).ok();
    let (Some(start), Some(end)) = (ev(), ev()) else { return found.first().copied() };
    let _ = drv::ctx::synchronize();
    let mut best: Option<(f32, sys::cublasLtMatmulAlgo_t)> = None;
    for algo in found.iter().chain(found) {
        // SAFETY: the caller's pointers and descriptors (see `launch`); the
        // events are live and recorded on the same stream.
        let time = unsafe {
            if launch(l, desc, layouts, algo, ptrs, stream, 0.0).is_err() {
                continue;
            }
            let _ = drv::event::record(start, stream);
            let ok = (0..3).all(|_| launch(l, desc, layouts, algo, ptrs, stream, 0.0).is_ok());
            let _ = drv::event::record(end, stream);
            let _ = drv::event::synchronize(end);
            if !ok {
                continue;
            }
            drv::event::elapsed(start, end).unwrap_or(f32::INFINITY)
        };
        if best.is_none_or(|(t, _)| time < t) {
            best = Some((time, *algo));
        }
    }
    // SAFETY: both events were created above and are not used again.
    unsafe {
        let _ = drv::event::destroy(start);
        let _ = drv::event::destroy(end);
    }
    best.map(|(_, a)| a)
}

/// Whether cuBLASLt (loaded on `device`) has an algorithm for the MLP's
/// epilogues for `act` at these sizes: `n` rows, `c` inputs, `f` hidden
/// units, `c2` outputs.
pub fn mlp_fits(act: Act, n: i64, c: i64, f: i64, c2: i64) -> bool {
    let Ok(l) = library() else { return false };
    let (n, c, f, c2) = (n as u64, c as u64, f as u64, c2 as u64);
    let problems = match act {
        Act::Gelu => vec![act_problem(act, n, c, f), dgelu_problem(n, c2, f)],
        Act::Relu => vec![act_problem(act, n, c, f)],
    };
    problems.iter().all(|p| {
        let mut cache = l.algos.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((a, _)) = cache.get(p) {
            return a.is_some();
        }
        let first = describe(l.api, p, std::ptr::null(), std::ptr::null()).and_then(|(desc, layouts)| candidates(&l, &desc, &layouts));
        let first = first.ok().and_then(|c| c.first().copied());
        cache.insert(*p, (first, false));
        first.is_some()
    })
}

/// Row-major `pre = h w^T + b`, `m = act(pre)` as column-major `D^T`:
/// `D [f, n] = op(A = w as [c, f] col-major, transposed) B (h as [c, n])`.
fn act_problem(act: Act, n: u64, c: u64, f: u64) -> Problem {
    Problem { epilogue: act.forward(), ..linear_problem(n, c, f, false) }
}

/// Row-major `y = x w^T (+ b)` (x `[n, k]`, w `[o, k]`): `D [o, n] = op(A =
/// w as [k, o] col-major, transposed) B (x as [k, n])`.
fn linear_problem(n: u64, k: u64, o: u64, bias: bool) -> Problem {
    let epilogue = if bias { Epilogue::Bias } else { Epilogue::Plain };
    Problem { m: o, n, k, trans_a: true, trans_b: false, epilogue, f32_out: false }
}

/// Row-major `dx = dy w` (dy `[n, o]`, w `[o, k]`): `D [k, n] = A (w as
/// [k, o] col-major) B (dy as [o, n])`.
fn input_grad_problem(n: u64, o: u64, k: u64) -> Problem {
    Problem { m: k, n, k: o, trans_a: false, trans_b: false, epilogue: Epilogue::Plain, f32_out: false }
}

/// Row-major `dw = dy^T x` in fp32 (dy `[n, o]`, x `[n, k]`): `D [k, o] = A
/// (x as [k, n] col-major) op(B = dy as [o, n], transposed)`.
fn weight_grad_problem(n: u64, o: u64, k: u64) -> Problem {
    Problem { m: k, n: o, k: n, trans_a: false, trans_b: true, epilogue: Epilogue::Plain, f32_out: true }
}

/// Row-major `dpre = (dout w2) * gelu'(pre)` (dout `[n, c2]`, w2 `[c2, f]`):
/// `D [f, n] = A (w2 as [f, c2] col-major) B (dout as [c2, n])`.
fn dgelu_problem(n: u64, c2: u64, f: u64) -> Problem {
    Problem { epilogue: Epilogue::DGelu, ..input_grad_problem(n, c2, f) }
}

/// Runs `p` on libtorch's current stream: `d = a b` (op's applied), or
/// with `add` `d += a b` (fp32 sums, one rounding). Its algorithm is the
/// fastest of cuBLASLt's candidates, timed into `d` (into a scratch copy
/// with `add`).
fn run(p: Problem, a: &Tensor, b: &Tensor, d: &Tensor, bias: Option<&Tensor>, aux: Option<&Tensor>, add: bool) -> anyhow::Result<()> {
    let l = library().map_err(anyhow::Error::msg)?;
    let ptr = |t: Option<&Tensor>| t.map_or(std::ptr::null_mut(), |t| t.data_ptr());
    let (desc, layouts) = describe(l.api, &p, ptr(bias), ptr(aux)).map_err(anyhow::Error::msg)?;
    let stream = crate::torch_ext::current_cuda_stream()? as dsys::CUstream;
    let ptrs = (a.data_ptr() as *const c_void, b.data_ptr() as *const c_void, d.data_ptr());
    let beta = if add { 1.0 } else { 0.0 };
    let algo = {
        let mut cache = l.algos.lock().unwrap_or_else(|e| e.into_inner());
        match cache.get(&p) {
            Some(&(a, true)) => a,
            Some(&(a, false)) if capturing(stream) => a,
            _ => {
                let found = candidates(&l, &desc, &layouts).map_err(anyhow::Error::msg)?;
                // The timing runs write their output: not into what `add` adds to.
                let scratch = add.then(|| d.empty_like());
                let timed = (ptrs.0, ptrs.1, scratch.as_ref().map_or(ptrs.2, |t| t.data_ptr()));
                let algo = if capturing(stream) { found.first().copied() } else { fastest(&l, &desc, &layouts, &found, timed, stream) };
                cache.insert(p, (algo, !capturing(stream)));
                algo
            }
        }
    };
    let algo = algo.ok_or_else(|| anyhow::anyhow!("cuBLASLt has no algorithm for {p:?}"))?;
    // SAFETY: the descriptors describe the tensors' checked shapes (bf16,
    // contiguous, column-major views of the row-major tensors); the bias
    // and aux pointers set in `desc` are `bias` and `aux`, live for the
    // call; the call goes to libtorch's current stream, whose caching
    // allocator keeps every tensor's memory from reuse until work queued
    // after it has run.
    unsafe { launch(&l, &desc, &layouts, &algo, ptrs, stream, beta) }.map_err(|e| anyhow::anyhow!("{p:?}: {e}"))
}

fn check_bf16(ts: &[&Tensor]) -> anyhow::Result<()> {
    for t in ts {
        anyhow::ensure!(
            t.kind() == Kind::BFloat16 && t.device().is_cuda() && t.is_contiguous() && (t.data_ptr() as usize) % 16 == 0,
            "cuBLASLt operands must be contiguous, 16-byte aligned bf16 CUDA tensors"
        );
    }
    Ok(())
}

/// `(pre, m)`: `m = act(pre)`, `pre = h w^T + bf16(b)` (bf16 `[n, f]`;
/// GELU's tanh approximation from the fp32 sum) for bf16 `h` `[n, c]` and
/// `w` `[f, c]` and the bias `b` `[f]` (rounded to bf16, as autocast adds
/// it). ReLU's derivative needs no more than `m`: its `pre` is `m` itself
/// (the same tensor).
pub fn act_forward(act: Act, h: &Tensor, w: &Tensor, b: &Tensor) -> anyhow::Result<(Tensor, Tensor)> {
    check_bf16(&[h, w])?;
    let ((n, c), (f, c1)) = (h.size2()?, w.size2()?);
    anyhow::ensure!(c == c1 && b.size() == [f], "{act:?} forward: h [{n}, {c}], w [{f}, {c1}], b {:?}", b.size());
    let m = Tensor::empty([n, f], (Kind::BFloat16, h.device()));
    let pre = match act {
        Act::Gelu => m.empty_like(),
        Act::Relu => m.shallow_clone(),
    };
    let b = b.to_kind(Kind::BFloat16).contiguous();
    let aux = (act == Act::Gelu).then_some(&pre);
    run(act_problem(act, n as u64, c as u64, f as u64), w, h, &m, Some(&b), aux, false)?;
    Ok((pre, m))
}

/// `dpre = (dout w2) * gelu'(pre)` (bf16 `[n, f]`) for bf16 `dout` `[n, c2]`,
/// `w2` `[c2, f]` and the kept `pre` `[n, f]`.
pub fn dgelu_backward(dout: &Tensor, w2: &Tensor, pre: &Tensor) -> anyhow::Result<Tensor> {
    check_bf16(&[dout, w2, pre])?;
    let ((n, c2), (c2w, f)) = (dout.size2()?, w2.size2()?);
    anyhow::ensure!(c2 == c2w && pre.size() == [n, f], "dgelu_backward: dout [{n}, {c2}], w2 [{c2w}, {f}], pre {:?}", pre.size());
    let dpre = pre.empty_like();
    run(dgelu_problem(n as u64, c2 as u64, f as u64), w2, dout, &dpre, None, Some(pre), false)?;
    Ok(dpre)
}

/// Whether the plain matmuls below run through cuBLASLt: libtorch's
/// library is there, and `HARNESS_LT_MATMULS=0` does not keep libtorch's
/// (a diagnostic).
pub fn matmuls_available() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| crate::options().lt_matmuls && api().is_ok())
}

/// `y = x w^T + bf16(b)` (bf16 `[n, o]`) for bf16 `x` `[n, k]` and `w` `[o,
/// k]`, the bias (if any, `[o]`) rounded to bf16 as autocast adds it.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> anyhow::Result<Tensor> {
    check_bf16(&[x, w])?;
    let ((n, k), (o, k1)) = (x.size2()?, w.size2()?);
    anyhow::ensure!(k == k1 && b.is_none_or(|b| b.size() == [o]), "linear: x [{n}, {k}], w [{o}, {k1}]");
    let y = Tensor::empty([n, o], (Kind::BFloat16, x.device()));
    let b = b.map(|b| b.to_kind(Kind::BFloat16).contiguous());
    run(linear_problem(n as u64, k as u64, o as u64, b.is_some()), w, x, &y, b.as_ref(), None, false)?;
    Ok(y)
}

/// `dx = dy w` (bf16 `[n, k]`) for bf16 `dy` `[n, o]` and `w` `[o, k]`.
pub fn input_grad(dy: &Tensor, w: &Tensor) -> anyhow::Result<Tensor> {
    check_bf16(&[dy, w])?;
    let ((n, o), (o1, k)) = (dy.size2()?, w.size2()?);
    anyhow::ensure!(o == o1, "input_grad: dy [{n}, {o}], w [{o1}, {k}]");
    let dx = Tensor::empty([n, k], (Kind::BFloat16, dy.device()));
    run(input_grad_problem(n as u64, o as u64, k as u64), w, dy, &dx, None, None, false)?;
    Ok(dx)
}

/// `dw = dy^T x` in fp32 (`[o, k]`: bf16 products, fp32 sums) for bf16 `dy`
/// `[n, o]` and `x` `[n, k]`.
pub fn weight_grad(dy: &Tensor, x: &Tensor) -> anyhow::Result<Tensor> {
    check_bf16(&[dy, x])?;
    let ((n, o), (n1, k)) = (dy.size2()?, x.size2()?);
    anyhow::ensure!(n == n1, "weight_grad: dy [{n}, {o}], x [{n1}, {k}]");
    let dw = Tensor::empty([o, k], (Kind::Float, dy.device()));
    run(weight_grad_problem(n as u64, o as u64, k as u64), x, dy, &dw, None, None, false)?;
    Ok(dw)
}

/// `into += dy^T x` (fp32 `[o, k]`, contiguous, 16-byte aligned): the
/// weight's gradient added into a gradient buffer by the matmul itself (its
/// epilogue reads `into`), the same sums as [`weight_grad`] followed by an
/// fp32 add, without the temporary or the pass of the add. With `add`
/// false, `into = dy^T x` (beta = 0: `into`'s old contents are not read,
/// for a buffer's first gradient of a step).
pub fn weight_grad_into(dy: &Tensor, x: &Tensor, into: &Tensor, add: bool) -> anyhow::Result<()> {
    check_bf16(&[dy, x])?;
    let ((n, o), (n1, k)) = (dy.size2()?, x.size2()?);
    anyhow::ensure!(n == n1, "weight_grad_into: dy [{n}, {o}], x [{n1}, {k}]");
    anyhow::ensure!(
        into.kind() == Kind::Float
            && into.size() == [o, k]
            && into.device() == dy.device()
            && into.is_contiguous()
            && (into.data_ptr() as usize) % 16 == 0,
        "weight_grad_into: the gradient must be a contiguous, 16-byte aligned fp32 [{o}, {k}] tensor on the operands' device"
    );
    run(weight_grad_problem(n as u64, o as u64, k as u64), x, dy, into, None, None, add)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_entry_points_come_from_libtorchs_cublaslt() {
        // Needs no GPU: the symbols of the libcublasLt that a CUDA build of
        // libtorch links. A CPU-only libtorch has none, and no fused MLP.
        if !crate::torch_ext::has_cuda_graphs() {
            eprintln!("skipped: this libtorch has no CUDA");
            return;
        }
        if let Err(e) = super::api() {
            panic!("{e}");
        }
    }
}
