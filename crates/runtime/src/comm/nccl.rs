use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use tch::{Kind, Tensor};

use super::{nbytes, Capabilities, Collective, CommError, CommStats, Op};
use crate::measure::cuda::Event;

/// ncclUniqueId: 128 opaque bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId(pub [c_char; 128]);

type CommT = *mut c_void;

/// ncclRedOp_t: ncclSum, and ncclAvg (NCCL 2.10 and later), which
/// divides by the number of ranks inside the collective: no pass over
/// the buffers after it. With a power-of-two number of ranks the result
/// is the sum divided by it, bit for bit (scaling by a power of two is
/// exact); otherwise the two may differ in the last bit.
const RED_SUM: c_int = 0;
const RED_AVG: c_int = 4;

struct Lib {
    _lib: libloading::Library,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> c_int,
    init_rank: unsafe extern "C" fn(*mut CommT, c_int, UniqueId, c_int) -> c_int,
    all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, CommT, *mut c_void) -> c_int,
    all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, CommT, *mut c_void) -> c_int,
    reduce_scatter: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, CommT, *mut c_void) -> c_int,
    broadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, CommT, *mut c_void) -> c_int,
    group_start: unsafe extern "C" fn() -> c_int,
    group_end: unsafe extern "C" fn() -> c_int,
    destroy: unsafe extern "C" fn(CommT) -> c_int,
    error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    /// Symmetric memory (NCCL 2.27 and later), absent before.
    symmetric: Option<Symmetric>,
    /// ncclCommSplit (NCCL 2.18 and later): `check_call`'s own
    /// communicator, split at set-up; without it the check runs on the
    /// training one.
    comm_split: Option<unsafe extern "C" fn(CommT, c_int, c_int, *mut CommT, *mut c_void) -> c_int>,
}

/// ncclMemAlloc, ncclMemFree, ncclCommWindowRegister and
/// ncclCommWindowDeregister.
struct Symmetric {
    mem_alloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int,
    mem_free: unsafe extern "C" fn(*mut c_void) -> c_int,
    register: unsafe extern "C" fn(CommT, *mut c_void, usize, *mut WindowT, c_int) -> c_int,
    deregister: unsafe extern "C" fn(CommT, WindowT) -> c_int,
}

type WindowT = *mut c_void;

/// NCCL_WIN_COLL_SYMMETRIC: every rank passes the same offsets into the window.
const WIN_COLL_SYMMETRIC: c_int = 1;

fn lib() -> Result<&'static Lib, String> {
    static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        // SAFETY: loading NCCL runs its initialisers only; each symbol is
        // read with the C signature of nccl.h (NCCL 2.x).
        unsafe {
            let lib = libloading::Library::new("libnccl.so.2").map_err(|e| format!("cannot load libnccl.so.2: {e}"))?;
            macro_rules! sym {
                ($name:literal) => {
                    *lib.get($name).map_err(|e| format!("libnccl.so.2 lacks {}: {e}", String::from_utf8_lossy($name)))?
                };
            }
            let symmetric = (|| {
                Some(Symmetric {
                    mem_alloc: *lib.get(b"ncclMemAlloc").ok()?,
                    mem_free: *lib.get(b"ncclMemFree").ok()?,
                    register: *lib.get(b"ncclCommWindowRegister").ok()?,
                    deregister: *lib.get(b"ncclCommWindowDeregister").ok()?,
                })
            })();
            Ok(Lib {
                symmetric,
                comm_split: lib.get(b"ncclCommSplit").ok().map(|f| *f),
                get_unique_id: sym!(b"ncclGetUniqueId"),
                init_rank: sym!(b"ncclCommInitRank"),
                all_reduce: sym!(b"ncclAllReduce"),
                all_gather: sym!(b"ncclAllGather"),
                reduce_scatter: sym!(b"ncclReduceScatter"),
                broadcast: sym!(b"ncclBroadcast"),
                group_start: sym!(b"ncclGroupStart"),
                group_end: sym!(b"ncclGroupEnd"),
                destroy: sym!(b"ncclCommDestroy"),
                error_string: sym!(b"ncclGetErrorString"),
                _lib: lib,
            })
        }
    })
    .as_ref()
    .map_err(Clone::clone)
}

fn check(code: c_int, what: &str) -> anyhow::Result<()> {
    if code == 0 {
        return Ok(());
    }
    let l = lib().map_err(anyhow::Error::msg)?;
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string.
    let msg = unsafe { CStr::from_ptr((l.error_string)(code)) }.to_string_lossy().into_owned();
    anyhow::bail!("{what}: NCCL error {code}: {msg}")
}

/// Averages `t` over the ranks into `out` (this rank's chunk) on
/// `side`: NCCL's average, or with `scale` (see `NcclComm::sum_scale`)
/// the sum, multiplied by it behind the scatter, before anything queued
/// after it on `side` (the split average's gather).
///
/// # Safety
/// `t` and `out` are live device buffers of NCCL type `dt`, `t` the
/// ranks times `out`'s elements, kept by the caller until work queued
/// after this on `side` has run; `comm` and `side` are our live
/// communicator and stream.
unsafe fn reduce_scatter_avg(
    l: &Lib,
    comm: CommT,
    side: *mut c_void,
    t: &Tensor,
    out: &Tensor,
    dt: c_int,
    scale: Option<f32>,
) -> anyhow::Result<()> {
    let op = if scale.is_some() { RED_SUM } else { RED_AVG };
    // SAFETY: as the caller promises.
    check(unsafe { (l.reduce_scatter)(t.data_ptr(), out.data_ptr(), out.numel(), dt, op, comm, side) }, "reduce_scatter")?;
    match scale {
        Some(s) => harness_kernels::kernels::scale_on(side, out, s),
        None => Ok(()),
    }
}

/// A fresh unique id (rank 0 makes it and shares it through the rendezvous).
pub fn unique_id() -> anyhow::Result<UniqueId> {
    let l = lib().map_err(anyhow::Error::msg)?;
    let mut id = UniqueId([0; 128]);
    // SAFETY: writes 128 bytes into id.
    check(unsafe { (l.get_unique_id)(&mut id) }, "ncclGetUniqueId")?;
    Ok(id)
}

fn dtype(k: Kind) -> Option<c_int> {
    Some(match k {
        Kind::Float => 7,
        Kind::Half => 6,
        Kind::BFloat16 => 9,
        Kind::Double => 8,
        Kind::Int8 => 0,
        Kind::Uint8 => 1,
        Kind::Int => 2,
        Kind::Int64 => 4,
        _ => return None,
    })
}

/// One rank's NCCL communicator on the current CUDA device.
pub struct NcclComm {
    comm: CommT,
    rank: usize,
    n: usize,
    stats: CommStats,
    /// (kind, size, start, after NCCL, after link emulation) not yet read back.
    /// Without a link the middle event is the end one (None).
    pending: Vec<(Op, u64, Event, Option<Event>, Event)>,
    /// Events read back, for reuse: creating and destroying three events
    /// per collective cost 7% of the all-reduce bus bandwidth on H200s.
    spare: Vec<Event>,
    /// Emulated link, and the device word its clock stamps go to.
    link: Option<(super::Link, Tensor)>,
    /// The side stream of asynchronous all-reduces (non-blocking, so it
    /// does not synchronise with libtorch's legacy stream), once used.
    side: Option<cudarc::driver::sys::CUstream>,
    /// True when collectives were queued on `side` since the last wait.
    side_busy: bool,
    /// The buffers of `symmetric_zeros`, with their windows.
    windows: Vec<(*mut c_void, WindowT, usize)>,
    /// A reduce-scatter between windows sums (see `sum_scale`).
    sum_in_windows: bool,
    /// NCCL's zero-CTA policy (`NCCL_CTA_POLICY=2`, which NCCL reads when
    /// the communicator is made) on GPUs that all reach each other's
    /// memory: gathers between windows run on the copy engines.
    zero_cta: bool,
    device: tch::Device,
    /// `check_call`'s communicator and stream, split at set-up.
    checks: Option<Checks>,
}

/// The communicator (split from the training one), non-blocking stream and
/// device buffers of `check_call`: a check waits for the other ranks to
/// reach it, never for the work queued on the training stream.
struct Checks {
    comm: CommT,
    stream: cudarc::driver::sys::CUstream,
    /// This rank's signature (3 i64) and every rank's (3 x n), made with
    /// `empty` (no fill kernel queued on the training stream that could
    /// land after a gather).
    mine: Tensor,
    all: Tensor,
}

impl Checks {
    /// Split from the training communicator `comm` as it is made, by every
    /// rank together as the init before it, so that no plugin call waits
    /// in a split (a collective of its own); None on one rank or without
    /// ncclCommSplit.
    fn split(l: &Lib, comm: CommT, rank: usize, n: usize, device: tch::Device) -> anyhow::Result<Option<Checks>> {
        let Some(split) = l.comm_split.filter(|_| n > 1) else { return Ok(None) };
        let mut child: CommT = std::ptr::null_mut();
        // SAFETY: our live communicator; `child` receives the new one;
        // colour 0 and this rank's key keep every rank, in order; a null
        // configuration inherits the parent's.
        check(unsafe { split(comm, 0, rank as c_int, &mut child, std::ptr::null_mut()) }, "ncclCommSplit")?;
        let stream = cudarc::driver::result::stream::create(cudarc::driver::result::stream::StreamKind::NonBlocking)
            .map_err(|e| anyhow::anyhow!("the checks' stream: {e}"))?;
        let mine = Tensor::empty([3], (Kind::Int64, device));
        let all = Tensor::empty([3 * n as i64], (Kind::Int64, device));
        Ok(Some(Checks { comm: child, stream, mine, all }))
    }
}

// SAFETY: the stream handle is used by one thread at a time (the owner,
// or the autograd thread while the owner waits for backward).
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Joins the communicator `id` as `rank` of `n` (blocks until all join).
    /// With a `link`, every training collective is stretched on the device
    /// timeline to what the link's ring model predicts (see `kernels::spin_until`).
    /// `sum_in_windows` (`HARNESS_SYM_SCATTER`): an fp32 reduce-scatter
    /// between symmetric windows sums, and a kernel divides, see
    /// `sum_scale`.
    pub fn new(
        id: UniqueId,
        rank: usize,
        n: usize,
        link: Option<super::Link>,
        device: tch::Device,
        sum_in_windows: bool,
    ) -> anyhow::Result<NcclComm> {
        let l = lib().map_err(anyhow::Error::msg)?;
        let mut comm: CommT = std::ptr::null_mut();
        // SAFETY: comm receives a communicator handle; id is by value.
        check(unsafe { (l.init_rank)(&mut comm, n as c_int, id, rank as c_int) }, "ncclCommInitRank")?;
        let link = link.map(|k| (k, Tensor::zeros([1], (Kind::Int64, device))));
        let checks = Checks::split(l, comm, rank, n, device).inspect_err(|_| {
            // SAFETY: the communicator made above, not handed out, destroyed once.
            unsafe { (l.destroy)(comm) };
        })?;
        Ok(NcclComm {
            comm,
            rank,
            n,
            stats: CommStats::default(),
            pending: Vec::new(),
            spare: Vec::new(),
            link,
            side: None,
            side_busy: false,
            windows: Vec::new(),
            sum_in_windows,
            zero_cta: std::env::var("NCCL_CTA_POLICY").is_ok_and(|p| p.trim() == "2") && crate::device::peer_access_everywhere(),
            device,
            checks,
        })
    }

    /// An all-reduce on the legacy stream without events or accounting:
    /// for `harness bench allreduce --untimed`, to see what the timing
    /// around each collective costs.
    pub fn all_reduce_sum_untimed(&mut self, t: &mut Tensor) -> Result<(), CommError> {
        let dt = self.dtype_of(t, "all_reduce")?;
        let l = lib().map_err(|e| self.fail("all_reduce", e))?;
        let (p, count) = (t.data_ptr(), t.numel());
        // SAFETY: in place on t's device memory, `count` elements; legacy stream.
        check(unsafe { (l.all_reduce)(p, p, count, dt, RED_SUM, self.comm, std::ptr::null_mut()) }, "all_reduce")
            .map_err(|e| self.fail("all_reduce", e))
    }

    /// An error of collective `op` on this rank.
    fn fail(&self, op: &'static str, reason: impl ToString) -> CommError {
        CommError::Aborted { op, seq: self.stats.collectives, rank: self.rank, reason: reason.to_string() }
    }

    /// NCCL's type code for a tensor NCCL can use in place: dense (e.g.
    /// contiguous, or a channels-last convolution weight, whose layout
    /// every rank shares), on CUDA.
    fn dtype_of(&self, t: &Tensor, op: &'static str) -> Result<c_int, CommError> {
        if !harness_kernels::torch_ext::is_dense(t) || !t.device().is_cuda() {
            // Refused before NCCL sees it: the communicator stays usable.
            let reason = "NCCL needs a dense CUDA tensor (contiguous or channels-last)".to_owned();
            return Err(CommError::Invalid { op, seq: self.stats.collectives, rank: self.rank, reason });
        }
        dtype(t.kind()).ok_or_else(|| self.fail(op, format!("NCCL cannot move {:?}", t.kind())))
    }

    /// Each rank's share of `numel` elements, refused (before NCCL sees
    /// it) where they do not split evenly.
    fn chunk_of(&self, numel: usize, op: &'static str) -> Result<usize, CommError> {
        if numel % self.n != 0 {
            let reason = format!("{numel} elements do not split evenly over {} ranks", self.n);
            return Err(CommError::Invalid { op, seq: self.stats.collectives, rank: self.rank, reason });
        }
        Ok(numel / self.n)
    }

    /// Reads back the timings of finished collectives, oldest first (all
    /// of them with `wait`, else those done already), and keeps their
    /// events for reuse.
    fn harvest(&mut self, wait: bool) {
        let secs = |a: &Event, b: &Event| Event::elapsed_ms(a, b).ok().map(|ms| std::time::Duration::from_secs_f64(ms as f64 / 1e3));
        let ready = if wait { self.pending.len() } else { self.pending.iter().take_while(|p| p.4.done()).count() };
        for (op, bytes, s, m, e) in self.pending.drain(..ready).collect::<Vec<_>>() {
            if e.synchronize().is_ok() {
                let measured = secs(&s, m.as_ref().unwrap_or(&e));
                if let (Some(measured), Some(emulated)) = (measured, secs(&s, &e)) {
                    self.stats.time(op, bytes, measured, emulated);
                }
            }
            self.spare.extend([s, e]);
            self.spare.extend(m);
        }
    }

    /// An event recorded on `stream` (null: the legacy stream), reused
    /// from `spare` when one is there.
    fn mark(&mut self, stream: cudarc::driver::sys::CUstream, op: &'static str) -> Result<Event, CommError> {
        if self.spare.is_empty() {
            self.harvest(false);
        }
        let e = match self.spare.pop() {
            Some(e) => e,
            None => Event::new().map_err(|e| self.fail(op, e))?,
        };
        // SAFETY: null or our live side stream.
        unsafe { e.record_on(stream) }.map_err(|e| self.fail(op, e))?;
        Ok(e)
    }

    /// A zeroed buffer of NCCL's memory registered as a symmetric window
    /// (a collective call: every rank asks alike), freed with the
    /// communicator; None where NCCL has no symmetric memory or the
    /// device is not CUDA.
    fn symmetric_alloc(&mut self, numel: i64, kind: Kind, name: &'static str) -> Result<Option<Tensor>, CommError> {
        let l = lib().map_err(|e| self.fail(name, e))?;
        let (Some(sym), tch::Device::Cuda(_)) = (&l.symmetric, self.device) else { return Ok(None) };
        let bytes = numel.max(1) as usize * kind.elt_size_in_bytes();
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: p receives device memory of `bytes` bytes.
        check(unsafe { (sym.mem_alloc)(&mut p, bytes) }, "ncclMemAlloc").map_err(|e| self.fail(name, e))?;
        let mut w: WindowT = std::ptr::null_mut();
        // SAFETY: p is NCCL's memory of `bytes` bytes; every rank registers
        // its buffers in the same order (a collective call).
        if let Err(e) = check(unsafe { (sym.register)(self.comm, p, bytes, &mut w, WIN_COLL_SYMMETRIC) }, "ncclCommWindowRegister") {
            // SAFETY: p came from ncclMemAlloc and nothing else holds it.
            unsafe { (sym.mem_free)(p) };
            return Err(self.fail(name, e));
        }
        self.windows.push((p, w, bytes));
        // SAFETY: `numel` elements of `kind` at p on this rank's device,
        // alive until this communicator is dropped (see the trait).
        let t = unsafe { Tensor::f_from_blob(p as *const u8, &[numel], &[1], kind, self.device) }.map_err(|e| self.fail(name, e))?;
        let _ = tch::no_grad(|| t.shallow_clone().zero_());
        Ok(Some(t))
    }

    /// Whether `t`'s memory lies inside one of our symmetric windows
    /// (where NCCL runs a collective between windows as its
    /// symmetric-memory kernels).
    fn in_window(&self, t: &Tensor) -> bool {
        let (at, len) = (t.data_ptr() as usize, nbytes(t) as usize);
        self.windows.iter().any(|&(p, _, bytes)| at >= p as usize && at + len <= p as usize + bytes)
    }

    /// `HARNESS_SYM_SCATTER`: the factor that makes the sum of a
    /// reduce-scatter of `t` into `out` their average, where both lie in
    /// our symmetric windows (NCCL runs a sum between windows as its
    /// symmetric kernel, which loads the peers' chunks directly, and its
    /// average as the ring kernels); None: NCCL's average.
    fn sum_scale(&self, t: &Tensor, out: &Tensor) -> Option<f32> {
        let on = self.sum_in_windows && t.kind() == Kind::Float;
        (on && self.in_window(t) && self.in_window(out)).then(|| 1.0 / self.n as f32)
    }

    /// All-reduces `ts` in place with `red` as one NCCL group on the side
    /// stream (see [`NcclComm::on_side`]).
    fn side_all_reduce(&mut self, ts: &[Tensor], red: c_int) -> Result<(), CommError> {
        let name = "all_reduce";
        let types = ts.iter().map(|t| self.dtype_of(t, name)).collect::<Result<Vec<_>, _>>()?;
        let bytes = ts.iter().map(nbytes).sum();
        self.on_side(Op::AllReduce, bytes, name, |l, comm, side| {
            // SAFETY: NCCL's group calls take no arguments; every call in
            // between is queued and issued at ncclGroupEnd.
            check(unsafe { (l.group_start)() }, name)?;
            let mut issued = 0;
            for (t, &dt) in ts.iter().zip(&types) {
                let (p, count) = (t.data_ptr(), t.numel());
                // SAFETY: in place on t's device memory, `count` elements
                // of the given type, on our side stream; t outlives the
                // collective (the caller keeps it until after `wait_async`).
                issued = unsafe { (l.all_reduce)(p, p, count, dt, red, comm, side) };
                if issued != 0 {
                    break;
                }
            }
            // SAFETY: closes the group opened above, also after a failed call.
            let ended = unsafe { (l.group_end)() };
            check(if issued != 0 { issued } else { ended }, name)
        })
    }

    /// Issues a collective of `op` over `bytes` on the side stream, once
    /// the legacy stream has produced its input, between two timing
    /// events, and counts it.
    fn on_side(
        &mut self,
        op: Op,
        bytes: u64,
        name: &'static str,
        issue: impl FnOnce(&Lib, CommT, *mut c_void) -> anyhow::Result<()>,
    ) -> Result<(), CommError> {
        self.on_side_after(op, bytes, name, true, issue)
    }

    /// [`NcclComm::on_side`], with the wait for the legacy stream only
    /// when `wait`: a collective queued right behind another on the side
    /// stream is ordered after the same input already.
    fn on_side_after(
        &mut self,
        op: Op,
        bytes: u64,
        name: &'static str,
        wait: bool,
        issue: impl FnOnce(&Lib, CommT, *mut c_void) -> anyhow::Result<()>,
    ) -> Result<(), CommError> {
        let side = match self.side {
            Some(s) => s,
            None => {
                let s = cudarc::driver::result::stream::create(cudarc::driver::result::stream::StreamKind::NonBlocking)
                    .map_err(|e| self.fail(name, e))?;
                self.side = Some(s);
                s
            }
        };
        let l = lib().map_err(|e| self.fail(name, e))?;
        if wait {
            // The side stream waits for the gradients, queued on the legacy stream.
            let ready = self.mark(std::ptr::null_mut(), name)?;
            // SAFETY: `side` is our live stream.
            unsafe { ready.wait_on(side) }.map_err(|e| self.fail(name, e))?;
            // The wait took the event's state now: it can be recorded again.
            self.spare.push(ready);
        }
        let start = self.mark(side, name)?;
        issue(l, self.comm, side as *mut c_void).map_err(|e| self.fail(name, e))?;
        let end = self.mark(side, name)?;
        self.pending.push((op, bytes, start, None, end));
        self.stats.count(op, bytes, self.n);
        self.side_busy = true;
        Ok(())
    }

    /// Issues a training collective of `op` on a buffer of `bytes` (its
    /// nccl-tests size) between events, stretched to the link's time when
    /// a link is emulated, and counts it; the times are read back in `stats`.
    fn timed(&mut self, op: Op, bytes: u64, issue: impl FnOnce(&Lib, CommT) -> c_int) -> Result<(), CommError> {
        let name = op.name();
        let l = lib().map_err(|e| self.fail(name, e))?;
        let null = std::ptr::null_mut();
        let start = self.mark(null, name)?;
        // Flat, the link's time counts from the collective's start; with
        // ranks sharing nodes, the time between nodes comes after the
        // measured collective (see `Link::emulated`).
        let after = self.link.as_ref().is_some_and(|(l, _)| l.ranks_share_nodes(self.n));
        if let (Some((_, at)), false) = (&self.link, after) {
            harness_kernels::kernels::stamp(at).map_err(|e| self.fail(name, e))?;
        }
        check(issue(l, self.comm), name).map_err(|e| self.fail(name, e))?;
        let mid = if let Some((link, at)) = &self.link {
            let (link, at) = (*link, at.shallow_clone());
            let mid = self.mark(null, name)?;
            if after {
                harness_kernels::kernels::stamp(&at).map_err(|e| self.fail(name, e))?;
            }
            let wait = link.inter_node_time(op, bytes, self.n);
            harness_kernels::kernels::spin_until(&at, wait.as_nanos() as u64).map_err(|e| self.fail(name, e))?;
            Some(mid)
        } else {
            None
        };
        let end = self.mark(null, name)?;
        self.pending.push((op, bytes, start, mid, end));
        self.stats.count(op, bytes, self.n);
        Ok(())
    }
}

impl Collective for NcclComm {
    fn supports_async(&self) -> bool {
        // Link emulation stretches collectives on the legacy stream.
        self.link.is_none()
    }
    fn capabilities(&self) -> Capabilities {
        let symmetric_memory = self.device.is_cuda() && lib().is_ok_and(|l| l.symmetric.is_some());
        Capabilities { overlap: self.supports_async(), symmetric_memory, copy_engines: symmetric_memory && self.zero_cta }
    }
    fn all_reduce_sum_async(&mut self, t: &Tensor) -> Result<(), CommError> {
        self.side_all_reduce(std::slice::from_ref(t), RED_SUM)
    }
    fn all_reduce_avg_async(&mut self, ts: &[Tensor]) -> Result<(), CommError> {
        self.side_all_reduce(ts, RED_AVG)
    }
    fn reduce_scatter_avg_async(&mut self, t: &Tensor, out: &Tensor) -> Result<(), CommError> {
        let name = "reduce_scatter";
        let dt = self.dtype_of(t, name)?;
        let (numel, count) = (t.numel(), out.numel());
        if numel != count * self.n || out.kind() != t.kind() || !harness_kernels::torch_ext::is_dense(out) {
            let reason = format!("{numel} elements do not split over {} ranks into {count} of {:?}", self.n, out.kind());
            return Err(CommError::Invalid { op: name, seq: self.stats.collectives, rank: self.rank, reason });
        }
        let scale = self.sum_scale(t, out);
        self.on_side(Op::ReduceScatter, nbytes(t), name, |l, comm, side| {
            // SAFETY: n x `count` elements read from t and `count`
            // written to out, live device buffers of that type that the
            // caller keeps until after `wait_async`, on our side stream.
            unsafe { reduce_scatter_avg(l, comm, side, t, out, dt, scale) }
        })
    }
    fn symmetric_zeros(&mut self, numel: i64, kind: Kind) -> Result<Option<Tensor>, CommError> {
        self.symmetric_alloc(numel, kind, "symmetric_zeros")
    }
    fn all_reduce_split_avg_async(&mut self, t: &Tensor) -> Result<(), CommError> {
        let dt = self.dtype_of(t, "all_reduce")?;
        let count = self.chunk_of(t.numel(), "all_reduce")?;
        let base = t.data_ptr();
        // SAFETY: this rank's chunk lies inside t (rank < n).
        let mine = unsafe { (base as *mut u8).add(self.rank * count * t.kind().elt_size_in_bytes()) } as *mut c_void;
        let bytes = nbytes(t);
        let chunk = t.narrow(0, (self.rank * count) as i64, count as i64);
        let scale = self.sum_scale(t, &chunk);
        self.on_side(Op::ReduceScatter, bytes, "reduce_scatter", |l, comm, side| {
            // SAFETY: in place in t (NCCL's in-place reduce-scatter and
            // all-gather: `chunk` is this rank's, at its offset in t),
            // live device memory that the caller keeps until after
            // `wait_async`, on our side stream, the gather queued behind
            // the scatter.
            unsafe { reduce_scatter_avg(l, comm, side, t, &chunk, dt, scale) }
        })?;
        self.on_side_after(Op::AllGather, bytes, "all_gather", false, |l, comm, side| {
            // SAFETY: as above: this rank's chunk gathered into t, in
            // place, queued on the side stream behind the reduce-scatter.
            check(unsafe { (l.all_gather)(mine, base, count, dt, comm, side) }, "all_gather")
        })
    }
    fn wait_async(&mut self) -> Result<(), CommError> {
        if let (Some(side), true) = (self.side, self.side_busy) {
            // SAFETY: `side` is our live stream; null is the legacy stream.
            let done = Event::new().and_then(|e| unsafe { e.record_on(side) }.map(|_| e)).map_err(|e| self.fail("all_reduce", e))?;
            // SAFETY: null is the legacy default stream, always valid; `done` is a live event.
            unsafe { done.wait_on(std::ptr::null_mut()) }.map_err(|e| self.fail("all_reduce", e))?;
            self.side_busy = false;
        }
        Ok(())
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.n
    }
    fn all_reduce_sum(&mut self, t: &mut Tensor) -> Result<(), CommError> {
        let dt = self.dtype_of(t, "all_reduce")?;
        let (p, count) = (t.data_ptr(), t.numel());
        // SAFETY: in place on t's device memory (send = receive buffer),
        // `count` elements of the given type; the legacy default stream.
        self.timed(Op::AllReduce, nbytes(t), |l, comm| unsafe { (l.all_reduce)(p, p, count, dt, RED_SUM, comm, std::ptr::null_mut()) })
    }
    fn all_gather(&mut self, t: &Tensor) -> Result<Tensor, CommError> {
        let src = t.contiguous();
        let dt = self.dtype_of(&src, "all_gather")?;
        let count = src.numel();
        let out = Tensor::empty([(self.n * count) as i64], (src.kind(), src.device()));
        let (sp, rp) = (src.data_ptr(), out.data_ptr());
        // SAFETY: `count` elements are read from src and n x count written
        // to out, both live device buffers of that type; the legacy default
        // stream orders the kernels, and the caching allocator reuses src's
        // memory only for work queued after this.
        self.timed(Op::AllGather, nbytes(&out), |l, comm| unsafe { (l.all_gather)(sp, rp, count, dt, comm, std::ptr::null_mut()) })?;
        Ok(out)
    }
    fn all_gather_in_place(&mut self, flat: &Tensor) -> Result<(), CommError> {
        let dt = self.dtype_of(flat, "all_gather")?;
        if !flat.is_contiguous() || flat.dim() != 1 {
            let reason = "an in-place all-gather takes a contiguous 1-D buffer".to_owned();
            return Err(CommError::Invalid { op: "all_gather", seq: self.stats.collectives, rank: self.rank, reason });
        }
        let count = self.chunk_of(flat.numel(), "all_gather")?;
        let base = flat.data_ptr();
        // SAFETY: this rank's chunk, inside `flat`.
        let mine = unsafe { (base as *mut u8).add(self.rank * count * flat.kind().elt_size_in_bytes()) } as *mut c_void;
        // SAFETY: NCCL's in-place all-gather (the send buffer is this
        // rank's chunk of the receive buffer): n x `count` elements of
        // `flat`, a live device buffer of that type, on the legacy
        // default stream.
        self.timed(Op::AllGather, nbytes(flat), |l, comm| unsafe { (l.all_gather)(mine, base, count, dt, comm, std::ptr::null_mut()) })
    }
    fn all_gather_in_place_async(&mut self, flat: &Tensor) -> Result<Option<super::Gathered>, CommError> {
        if !self.supports_async() {
            self.all_gather_in_place(flat)?;
            return Ok(None);
        }
        let name = "all_gather";
        let dt = self.dtype_of(flat, name)?;
        if !flat.is_contiguous() || flat.dim() != 1 {
            let reason = "an in-place all-gather takes a contiguous 1-D buffer".to_owned();
            return Err(CommError::Invalid { op: name, seq: self.stats.collectives, rank: self.rank, reason });
        }
        let count = self.chunk_of(flat.numel(), name)?;
        let base = flat.data_ptr();
        // SAFETY: this rank's chunk, inside `flat`.
        let mine = unsafe { (base as *mut u8).add(self.rank * count * flat.kind().elt_size_in_bytes()) } as *mut c_void;
        self.on_side(Op::AllGather, nbytes(flat), name, |l, comm, side| {
            // SAFETY: NCCL's in-place all-gather into `flat`, a live
            // device buffer that the caller keeps (a parameter buffer)
            // and reads only after `Gathered::wait`, on our side stream
            // after the work queued on the legacy stream so far.
            check(unsafe { (l.all_gather)(mine, base, count, dt, comm, side) }, name)
        })?;
        let side = self.side.ok_or_else(|| self.fail(name, "no side stream after the all-gather"))?;
        let done = self.mark(side, name)?;
        let rank = self.rank;
        Ok(Some(super::Gathered::new(move || {
            // SAFETY: null is the legacy default stream; `done` is a live
            // event (destroyed after the wait is queued, which CUDA allows).
            unsafe { done.wait_on(std::ptr::null_mut()) }.map_err(|e| CommError::Aborted {
                op: "all_gather",
                seq: 0,
                rank,
                reason: e.to_string(),
            })
        })))
    }
    fn reduce_scatter_sum(&mut self, t: &Tensor) -> Result<Tensor, CommError> {
        let src = t.contiguous();
        let dt = self.dtype_of(&src, "reduce_scatter")?;
        let count = self.chunk_of(src.numel(), "reduce_scatter")?;
        let out = Tensor::empty([count as i64], (src.kind(), src.device()));
        let (sp, rp) = (src.data_ptr(), out.data_ptr());
        // SAFETY: n x `count` elements are read from src and `count` written
        // to out (ncclSum = 0), live device buffers of that type, on the
        // legacy default stream as in all_gather.
        self.timed(Op::ReduceScatter, nbytes(&src), |l, comm| unsafe {
            (l.reduce_scatter)(sp, rp, count, dt, 0, comm, std::ptr::null_mut())
        })?;
        Ok(out)
    }
    fn broadcast(&mut self, t: &mut Tensor, root: usize) -> Result<(), CommError> {
        let dt = self.dtype_of(t, "broadcast")?;
        let l = lib().map_err(|e| self.fail("broadcast", e))?;
        let (p, count) = (t.data_ptr(), t.numel());
        // SAFETY: in place on t's device memory; the legacy default stream.
        let code = unsafe { (l.broadcast)(p, p, count, dt, root as c_int, self.comm, std::ptr::null_mut()) };
        check(code, "broadcast").map_err(|e| self.fail("broadcast", e))
    }
    fn all_reduce_sum_control(&mut self, t: &mut Tensor) -> Result<(), CommError> {
        let dt = self.dtype_of(t, "all_reduce")?;
        let l = lib().map_err(|e| self.fail("all_reduce", e))?;
        let (p, count) = (t.data_ptr(), t.numel());
        // SAFETY: in place on t's device memory, `count` elements of the
        // given type; the legacy default stream, as all_reduce_sum.
        let code = unsafe { (l.all_reduce)(p, p, count, dt, RED_SUM, self.comm, std::ptr::null_mut()) };
        check(code, "all_reduce").map_err(|e| self.fail("all_reduce", e))
    }
    fn check_call(&mut self, call: &str, t: &Tensor) -> Result<(), CommError> {
        // Each rank's (call, elements, dtype), gathered outside the
        // accounting (a setup-sized collective) and read back: one small
        // synchronous collective per plugin collective. On its own
        // communicator and stream it waits for the other ranks only; on
        // the training one (NCCL before 2.18) it also waits for every
        // kernel queued before it.
        let code = call.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3)) as i64 & i64::MAX;
        let kind = dtype(t.kind()).unwrap_or(-1) as i64;
        let sig = [code, t.numel() as i64, kind];
        let l = lib().map_err(|e| self.fail("check", e))?;
        let got = match &self.checks {
            Some(c) => {
                let (comm, stream, mine, all) = (c.comm, c.stream, c.mine.data_ptr(), c.all.data_ptr());
                let mut got = vec![0i64; 3 * self.n];
                // SAFETY: `mine` and `all` are our live device buffers of 3
                // and 3 x n i64, used on our stream only; the copy from the
                // host's `sig` is staged before it returns (pageable
                // memory), the copy to `got` completes before it returns,
                // and the stream is drained before the buffers are used
                // again.
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(mine as u64, &sig, stream).map_err(|e| self.fail("check", e))?;
                    check((l.all_gather)(mine, all, 3, dtype(Kind::Int64).unwrap_or(0), comm, stream as *mut c_void), "check")
                        .map_err(|e| self.fail("check", e))?;
                    cudarc::driver::result::memcpy_dtoh_async(&mut got, all as u64, stream).map_err(|e| self.fail("check", e))?;
                    cudarc::driver::result::stream::synchronize(stream).map_err(|e| self.fail("check", e))?;
                }
                got
            }
            None => {
                let mine = Tensor::from_slice(&sig).to_device(t.device());
                let all = Tensor::zeros([3 * self.n as i64], (Kind::Int64, t.device()));
                let (sp, rp) = (mine.data_ptr(), all.data_ptr());
                // SAFETY: 3 i64 read from `mine`, 3 x n written to `all`, live
                // device buffers; the legacy default stream orders them.
                let rc = unsafe { (l.all_gather)(sp, rp, 3, dtype(Kind::Int64).unwrap_or(0), self.comm, std::ptr::null_mut()) };
                check(rc, "check").map_err(|e| self.fail("check", e))?;
                Vec::<i64>::try_from(&all.to_device(tch::Device::Cpu)).map_err(|e| self.fail("check", e))?
            }
        };
        if got.chunks(3).any(|c| c != &got[..3]) {
            let ranks: Vec<String> = got
                .chunks(3)
                .enumerate()
                .map(|(r, c)| format!("rank {r}: {} of {} elements", if c[0] == code { call } else { "another collective" }, c[1]))
                .collect();
            let reason = format!("the ranks called different collectives, sizes or dtypes ({})", ranks.join(", "));
            return Err(CommError::Invalid { op: "check", seq: self.stats.collectives, rank: self.rank, reason });
        }
        Ok(())
    }
    fn abort(&self, _reason: &str) {
        // Not ncclCommAbort: on the H200s it left the CUDA context with an
        // illegal-address error that later crashed libtorch. A rank that
        // fails stops issuing collectives; its peers' watchdogs end them.
    }
    fn stats(&mut self) -> &CommStats {
        self.harvest(true);
        &self.stats
    }
    fn reset_timings(&mut self) {
        // Pending device timings belong to warm-up too.
        for (_, _, s, m, e) in std::mem::take(&mut self.pending) {
            let _ = e.synchronize();
            self.spare.extend([s, e]);
            self.spare.extend(m);
        }
        self.stats.clear_timings();
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if let (Ok(Lib { symmetric: Some(sym), .. }), false) = (lib(), self.windows.is_empty()) {
            // Work on the buffers completes first.
            if let tch::Device::Cuda(i) = self.device {
                tch::Cuda::synchronize(i as i64);
            }
            for (p, w, _) in std::mem::take(&mut self.windows) {
                // SAFETY: our window and NCCL's memory, each released once.
                unsafe {
                    (sym.deregister)(self.comm, w);
                    (sym.mem_free)(p);
                }
            }
        }
        if let Ok(l) = lib() {
            if let Some(c) = self.checks.take() {
                // SAFETY: the checks' communicator and stream, idle (each
                // check drains its stream), destroyed once.
                unsafe {
                    (l.destroy)(c.comm);
                    let _ = cudarc::driver::result::stream::destroy(c.stream);
                }
            }
            // SAFETY: the communicator is owned and destroyed once.
            unsafe { (l.destroy)(self.comm) };
        }
        if let Some(s) = self.side.take() {
            // SAFETY: our stream, destroyed once; work on it completes first.
            let _ = unsafe { cudarc::driver::result::stream::destroy(s) };
        }
    }
}
