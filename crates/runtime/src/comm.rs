//! Collectives between ranks, run and accounted for by the host.
//!
//! [`SingleRank`] is the one-rank case. [`InProcessGroup`] makes ranks out of
//! threads of one process with a shared-memory collective: the CPU backend
//! for tests and the CPU suite (a test and demo backend,
//! not a scale path). Every collective is timed into an HDR histogram and its
//! bytes on the wire are counted with the nccl-tests conventions, per kind of
//! collective ([`Op`]): the "size" of an all-reduce is the reduced buffer, of
//! an all-gather the gathered buffer, of a reduce-scatter the buffer before
//! scattering; in a ring each rank sends 2(n-1)/n of it for an all-reduce and
//! (n-1)/n for the other two. A [`Link`] stretches each collective to what an
//! alpha-beta model of a ring over that link predicts; both the measured and
//! the emulated times are kept. A link with `nodes` emulates a cluster of
//! that many nodes of world/nodes ranks each: only the traffic between nodes
//! crosses the link ([`Link::emulated`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use tch::{Kind, Tensor};

use crate::measure;
use harness_kernels::torch_ext::nbytes;

/// The words of [`CommError::Aborted`]'s message that say another rank
/// ended the collective.
pub const ABORTED_BY_PEER: &str = " was aborted: ";

/// A collective that failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommError {
    #[error("{op} #{seq} timed out after {timeout_s:.0} s on rank {rank}: rank(s) {missing:?} never joined")]
    Timeout { op: &'static str, seq: u64, rank: usize, missing: Vec<usize>, timeout_s: f64 },
    #[error("{op} #{seq} on rank {rank} was aborted: {reason}")]
    Aborted { op: &'static str, seq: u64, rank: usize, reason: String },
    /// The ranks' tensors do not fit the collective (sizes differ between
    /// ranks, or a reduce-scatter's size is not a multiple of the ranks).
    #[error("{op} #{seq} on rank {rank} cannot run: {reason}")]
    Invalid { op: &'static str, seq: u64, rank: usize, reason: String },
}

pub use harness_format::link::{Link, Op};

/// What one kind of collective cost a rank.
#[derive(Debug, Clone)]
pub struct OpStats {
    /// Collectives of this kind issued.
    pub collectives: u64,
    /// Sum of their nccl-tests sizes: the buffer reduced (all-reduce),
    /// gathered (all-gather) or reduced before scattering (reduce-scatter).
    pub bytes: u64,
    /// Bytes this rank sent for them (ring accounting, see [`Op::bytes_sent`]).
    pub bytes_sent: u64,
    /// Sizes of the collectives in the timings (after warm-up).
    pub bytes_timed: u64,
    /// Measured time of each, ns.
    pub latency: Histogram<u64>,
    /// Time after link emulation, ns (equal to `latency` without a link).
    pub emulated: Histogram<u64>,
    pub measured_total: Duration,
    pub emulated_total: Duration,
}

impl Default for OpStats {
    fn default() -> Self {
        OpStats {
            collectives: 0,
            bytes: 0,
            bytes_sent: 0,
            bytes_timed: 0,
            latency: measure::new_histogram(),
            emulated: measure::new_histogram(),
            measured_total: Duration::ZERO,
            emulated_total: Duration::ZERO,
        }
    }
}

/// What a rank's collectives cost: totals over every training collective,
/// and the same per kind in `ops`.
#[derive(Debug, Clone)]
pub struct CommStats {
    pub collectives: u64,
    /// Bytes this rank sent in training collectives (setup broadcasts excluded).
    pub bytes_sent: u64,
    /// Measured time of each collective, ns.
    pub latency: Histogram<u64>,
    /// Time after link emulation, ns (equal to `latency` without a link).
    pub emulated: Histogram<u64>,
    pub measured_total: Duration,
    pub emulated_total: Duration,
    /// The same figures per kind of collective (kinds never issued are absent).
    pub ops: BTreeMap<Op, OpStats>,
}

impl Default for CommStats {
    fn default() -> Self {
        CommStats {
            collectives: 0,
            bytes_sent: 0,
            latency: measure::new_histogram(),
            emulated: measure::new_histogram(),
            measured_total: Duration::ZERO,
            emulated_total: Duration::ZERO,
            ops: BTreeMap::new(),
        }
    }
}

impl CommStats {
    fn clear_timings(&mut self) {
        self.latency.reset();
        self.emulated.reset();
        self.measured_total = Duration::ZERO;
        self.emulated_total = Duration::ZERO;
        for s in self.ops.values_mut() {
            s.latency.reset();
            s.emulated.reset();
            s.measured_total = Duration::ZERO;
            s.emulated_total = Duration::ZERO;
            s.bytes_timed = 0;
        }
    }

    /// Counts a collective of `op` on a buffer of `bytes` (its nccl-tests size) over `n` ranks.
    fn count(&mut self, op: Op, bytes: u64, n: usize) {
        let sent = op.bytes_sent(bytes, n);
        self.collectives += 1;
        self.bytes_sent += sent;
        let s = self.ops.entry(op).or_default();
        s.collectives += 1;
        s.bytes += bytes;
        s.bytes_sent += sent;
    }

    /// Records the measured and emulated time of a counted collective.
    fn time(&mut self, op: Op, bytes: u64, measured: Duration, emulated: Duration) {
        measure::record(&mut self.latency, measured);
        measure::record(&mut self.emulated, emulated);
        self.measured_total += measured;
        self.emulated_total += emulated;
        let s = self.ops.entry(op).or_default();
        s.bytes_timed += bytes;
        measure::record(&mut s.latency, measured);
        measure::record(&mut s.emulated, emulated);
        s.measured_total += measured;
        s.emulated_total += emulated;
    }

    /// Algorithm bandwidth (size / time) and bus bandwidth (algbw x
    /// [`Op::bus_factor`]), in GB/s, over the timed collectives of `op`
    /// (nccl-tests' definitions); None when none was timed.
    pub fn op_bandwidth_gbs(&self, op: Op, n: usize, emulated: bool) -> Option<(f64, f64)> {
        let s = self.ops.get(&op)?;
        let t = if emulated { s.emulated_total } else { s.measured_total }.as_secs_f64();
        if t <= 0.0 || s.bytes_timed == 0 {
            return None;
        }
        let alg = s.bytes_timed as f64 / t / 1e9;
        Some((alg, alg * op.bus_factor(n)))
    }

    /// [`CommStats::op_bandwidth_gbs`] of the all-reduces (bus bandwidth
    /// algbw x 2(n-1)/n), the figure results call `busbw_gbs`.
    pub fn bandwidth_gbs(&self, n: usize, emulated: bool) -> Option<(f64, f64)> {
        self.op_bandwidth_gbs(Op::AllReduce, n, emulated)
    }
}

/// The collectives a rank can use.
pub trait Collective {
    /// This rank's index.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Sums `t` over ranks, in place.
    fn all_reduce_sum(&mut self, t: &mut Tensor) -> Result<(), CommError>;
    /// Gathers every rank's `t` (same shape on all ranks) into one new tensor of `world_size * t.numel()` elements, rank order, 1-D.
    fn all_gather(&mut self, t: &Tensor) -> Result<Tensor, CommError>;
    /// Sums `t` (numel divisible by world_size) over ranks and returns this rank's 1-D chunk (numel / world_size elements, rank order).
    fn reduce_scatter_sum(&mut self, t: &Tensor) -> Result<Tensor, CommError>;
    /// Gathers every rank's chunk of the contiguous 1-D `flat` (numel
    /// divisible by world_size; rank r's chunk is the r-th of world_size
    /// equal pieces) into the whole of `flat` on every rank, in place: what
    /// [`Collective::all_gather`] of the chunks gives, without a second
    /// buffer or a copy where the collective writes in place (NCCL).
    fn all_gather_in_place(&mut self, flat: &Tensor) -> Result<(), CommError> {
        let n = self.world_size() as i64;
        let chunk = flat.numel() as i64 / n;
        let full = self.all_gather(&flat.narrow(0, self.rank() as i64 * chunk, chunk))?;
        tch::no_grad(|| flat.shallow_clone().copy_(&full));
        Ok(())
    }
    /// Starts [`Collective::all_gather_in_place`] once the work queued so
    /// far has produced `flat`, without holding up the work queued after
    /// it: returns what makes later work wait for the gathered buffer, or
    /// None where the gather is done already (the default: it runs now).
    /// NCCL gathers on its side stream (on the copy engines for a buffer of
    /// [`Collective::symmetric_zeros`] under the zero CTA policy).
    fn all_gather_in_place_async(&mut self, flat: &Tensor) -> Result<Option<Gathered>, CommError> {
        self.all_gather_in_place(flat)?;
        Ok(None)
    }
    /// Copies `root`'s `t` to every rank (setup; not counted as training bytes).
    fn broadcast(&mut self, t: &mut Tensor, root: usize) -> Result<(), CommError>;
    /// Sums a small control value `t` (a gradient norm's square, a flag)
    /// over ranks, in place, outside the accounting: not training traffic,
    /// so that a few bytes a step do not count in the collectives' latencies
    /// and bus bandwidths. Ordered as [`Collective::all_reduce_sum`].
    fn all_reduce_sum_control(&mut self, t: &mut Tensor) -> Result<(), CommError> {
        self.all_reduce_sum(t)
    }
    /// True when [`Collective::all_reduce_sum_async`] runs collectives beside
    /// the computation (NCCL on a side stream).
    fn supports_async(&self) -> bool {
        false
    }
    /// What the collective can do, for the data-parallel plan: read before
    /// any buffer is laid out, the same on every rank.
    fn capabilities(&self) -> Capabilities {
        Capabilities { overlap: self.supports_async(), symmetric_memory: false, copy_engines: false }
    }
    /// Starts summing `t` over ranks, in place, once the work queued so far
    /// has produced it, without holding up the work queued after it; the
    /// result is there for work queued after [`Collective::wait_async`].
    /// May be called from another thread while the owner is blocked (the
    /// autograd engine's, during backward). Only where `supports_async`.
    fn all_reduce_sum_async(&mut self, t: &Tensor) -> Result<(), CommError> {
        let _ = t;
        Err(CommError::Aborted { op: "all_reduce", seq: 0, rank: self.rank(), reason: "no asynchronous collectives here".into() })
    }
    /// Starts averaging the tensors `ts` over ranks, each in place, as one
    /// collective (NCCL: one group of all-reduces with NCCL's average),
    /// with the same ordering as [`Collective::all_reduce_sum_async`]. The
    /// tensors must be dense and laid out alike on every rank. Only where
    /// `supports_async`.
    fn all_reduce_avg_async(&mut self, ts: &[Tensor]) -> Result<(), CommError> {
        let _ = ts;
        Err(CommError::Aborted { op: "all_reduce", seq: 0, rank: self.rank(), reason: "no asynchronous collectives here".into() })
    }
    /// Starts averaging `t` (numel divisible by world_size) over ranks into
    /// `out`, this rank's chunk (numel / world_size elements, rank order),
    /// with the same ordering as [`Collective::all_reduce_sum_async`]. Only
    /// where `supports_async`.
    fn reduce_scatter_avg_async(&mut self, t: &Tensor, out: &Tensor) -> Result<(), CommError> {
        let _ = (t, out);
        Err(CommError::Aborted { op: "reduce_scatter", seq: 0, rank: self.rank(), reason: "no asynchronous collectives here".into() })
    }
    /// A zeroed 1-D buffer of `numel` elements of `kind` in memory that
    /// every rank allocates alike (NCCL: `ncclMemAlloc`, registered as a
    /// symmetric window), for [`Collective::all_reduce_split_avg_async`];
    /// every rank must ask for the same buffers in the same order. None
    /// where there is no such memory (the caller keeps its own buffers).
    /// The buffer lives as long as the collective, which frees it.
    fn symmetric_zeros(&mut self, numel: i64, kind: Kind) -> Result<Option<Tensor>, CommError> {
        let _ = (numel, kind);
        Ok(None)
    }
    /// Starts averaging `t` (numel divisible by world_size) over ranks, in
    /// place, as a reduce-scatter (averaging) and an all-gather, with the
    /// same ordering as [`Collective::all_reduce_sum_async`]. In a buffer of
    /// [`Collective::symmetric_zeros`] NCCL runs the all-gather on the copy
    /// engines when its CTA policy is zero (`NCCL_CTA_POLICY=2`), leaving
    /// the SMs to the computation. Only where `supports_async`.
    fn all_reduce_split_avg_async(&mut self, t: &Tensor) -> Result<(), CommError> {
        let _ = t;
        Err(CommError::Aborted { op: "all_reduce", seq: 0, rank: self.rank(), reason: "no asynchronous collectives here".into() })
    }
    /// Makes work queued from now on wait for every asynchronous collective.
    fn wait_async(&mut self) -> Result<(), CommError> {
        Ok(())
    }
    /// Before a collective that a plugin asked for: checks that every rank
    /// is about to call the same one (`call`: the op and, for a broadcast,
    /// its root) on a tensor of the same size and dtype, so that a plugin
    /// whose ranks disagree fails its entry with a message instead of
    /// hanging or corrupting the collective. Thread ranks check every
    /// collective as it runs, so this does nothing there.
    fn check_call(&mut self, call: &str, t: &Tensor) -> Result<(), CommError> {
        let _ = (call, t);
        Ok(())
    }
    /// Fails every other rank's pending and future collectives.
    fn abort(&self, reason: &str);
    /// What the collectives cost so far (device timings are read back here).
    fn stats(&mut self) -> &CommStats;
    /// Forgets the timings so far (not the counts or bytes): called when
    /// warm-up ends, so NCCL's lazy set-up stays out of the latencies.
    fn reset_timings(&mut self);
}

/// An asynchronous gather in flight ([`Collective::all_gather_in_place_async`]):
/// [`Gathered::wait`] makes the work queued after it wait for the buffer.
pub struct Gathered(Box<dyn FnOnce() -> Result<(), CommError>>);

impl Gathered {
    /// `wait` makes later work wait for the gather (it must not block the
    /// host where the device can wait instead).
    pub fn new(wait: impl FnOnce() -> Result<(), CommError> + 'static) -> Gathered {
        Gathered(Box::new(wait))
    }

    /// Makes the work queued from now on wait for the gathered buffer.
    pub fn wait(self) -> Result<(), CommError> {
        (self.0)()
    }
}

impl std::fmt::Debug for Gathered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Gathered")
    }
}

/// A collective lent beyond its borrow: to a plugin call in progress (the
/// host ops it calls), or to the autograd thread during a backward pass (the
/// overlapped all-reduce). Set only while the code that holds the `&mut`
/// waits for that call or pass, and cleared before its borrow ends.
#[derive(Clone, Copy)]
pub struct CommPtr(*mut (dyn Collective + 'static));

impl CommPtr {
    /// Erases the borrow's lifetime.
    ///
    /// # Safety
    /// The pointer must be cleared before the borrow of `comm` ends, and
    /// used meanwhile only while the lender does not touch `comm`.
    pub unsafe fn new(comm: &mut dyn Collective) -> CommPtr {
        // SAFETY: only the lifetime is erased; see the contract above.
        CommPtr(unsafe { std::mem::transmute::<*mut dyn Collective, *mut (dyn Collective + 'static)>(comm as *mut dyn Collective) })
    }

    /// The collective.
    ///
    /// # Safety
    /// Only within the lending described at [`CommPtr::new`]: the collective
    /// is alive and nothing else uses it meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn get<'a>(self) -> &'a mut dyn Collective {
        // SAFETY: per the contract, the pointee is alive and not aliased.
        unsafe { &mut *self.0 }
    }
}

// SAFETY: a CommPtr is dereferenced only under the contract of `new`: on
// the lender's thread during the lent call, or on the autograd thread while
// the lender is blocked in `backward`.
unsafe impl Send for CommPtr {}

/// True on every rank when `flag` is true on any rank (a barrier too).
pub fn any_rank(comm: &mut dyn Collective, flag: bool, device: tch::Device) -> Result<bool, CommError> {
    if comm.world_size() == 1 {
        return Ok(flag);
    }
    let mut t = Tensor::from_slice(&[flag as i32 as f32]).to_device(device);
    comm.all_reduce_sum(&mut t)?;
    Ok(t.double_value(&[0]) > 0.0)
}

/// True on every rank when `ok` is true on every rank (a barrier too).
pub fn ranks_agree(comm: &mut dyn Collective, ok: bool, device: tch::Device) -> Result<bool, CommError> {
    Ok(!any_rank(comm, !ok, device)?)
}

/// What a collective can do ([`Collective::capabilities`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capabilities {
    /// Collectives beside the computation ([`Collective::supports_async`]).
    pub overlap: bool,
    /// Buffers in memory that every rank allocates alike
    /// ([`Collective::symmetric_zeros`] gives them).
    pub symmetric_memory: bool,
    /// Gathers between such buffers run on the copy engines, leaving the SMs
    /// to the computation: NCCL's zero-CTA policy (`NCCL_CTA_POLICY=2` when
    /// the communicator was made, which harness sets for the ranks it
    /// starts) with GPUs that all reach each other's memory.
    pub copy_engines: bool,
}

/// One rank alone: collectives are the identity and move nothing.
#[derive(Debug, Default)]
pub struct SingleRank {
    stats: CommStats,
}

impl Collective for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&mut self, _t: &mut Tensor) -> Result<(), CommError> {
        Ok(())
    }
    fn all_gather(&mut self, t: &Tensor) -> Result<Tensor, CommError> {
        Ok(tch::no_grad(|| t.reshape([-1]).copy()))
    }
    fn reduce_scatter_sum(&mut self, t: &Tensor) -> Result<Tensor, CommError> {
        Ok(tch::no_grad(|| t.reshape([-1]).copy()))
    }
    fn broadcast(&mut self, _t: &mut Tensor, _root: usize) -> Result<(), CommError> {
        Ok(())
    }
    fn abort(&self, _reason: &str) {}
    fn stats(&mut self) -> &CommStats {
        &self.stats
    }
    fn reset_timings(&mut self) {}
}

/// What combining the deposited tensors gave: the shared result, or why the
/// tensors did not fit the collective.
type Combined = Result<Tensor, String>;

#[derive(Default)]
struct State {
    /// Collectives completed by every rank.
    seq: u64,
    slots: Vec<Option<Tensor>>,
    /// What each rank called (the op, and a broadcast's root).
    calls: Vec<String>,
    arrived: usize,
    departed: usize,
    result: Option<Combined>,
    /// True between the last arrival and the last departure.
    scattering: bool,
    aborted: Option<String>,
}

/// Ranks as threads of this process (CPU backend).
pub struct InProcessGroup {
    n: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

impl InProcessGroup {
    /// A group of `n` ranks whose collectives give up after `timeout`.
    pub fn new(n: usize, timeout: Duration) -> Arc<InProcessGroup> {
        let state = State { slots: (0..n).map(|_| None).collect(), calls: vec![String::new(); n], ..Default::default() };
        Arc::new(InProcessGroup { n, timeout, state: Mutex::new(state), cv: Condvar::new() })
    }

    /// The handle of rank `rank`.
    pub fn rank(self: &Arc<Self>, rank: usize, link: Option<Link>) -> InProcessComm {
        InProcessComm { group: self.clone(), rank, link, stats: CommStats::default(), late: Arc::default() }
    }

    /// Waits for a change of the state until `deadline`; fails on abort or
    /// when the deadline passes, naming the ranks that never arrived.
    fn wait<'a>(
        &'a self,
        st: MutexGuard<'a, State>,
        deadline: Instant,
        op: &'static str,
        seq: u64,
        rank: usize,
    ) -> Result<MutexGuard<'a, State>, CommError> {
        let left = deadline.saturating_duration_since(Instant::now());
        let (st, res) = self.cv.wait_timeout(st, left).unwrap_or_else(|e| e.into_inner());
        if let Some(reason) = &st.aborted {
            return Err(CommError::Aborted { op, seq, rank, reason: reason.clone() });
        }
        if res.timed_out() && Instant::now() >= deadline {
            let missing = st.slots.iter().enumerate().filter(|(_, s)| s.is_none()).map(|(i, _)| i).collect();
            return Err(CommError::Timeout { op, seq, rank, missing, timeout_s: self.timeout.as_secs_f64() });
        }
        Ok(st)
    }

    /// Runs one collective: every rank deposits its tensor, the last one
    /// combines them with `combine` (without autograd), and every rank gets
    /// the combined tensor back, shared: callers copy what they keep.
    fn run<'a>(
        &'a self,
        op: &'static str,
        call: String,
        rank: usize,
        t: &Tensor,
        combine: &dyn Fn(&[Option<Tensor>]) -> Combined,
    ) -> Result<Tensor, CommError> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let deadline = Instant::now() + self.timeout;
        if let Some(reason) = &st.aborted {
            return Err(CommError::Aborted { op, seq: st.seq, rank, reason: reason.clone() });
        }
        // The previous collective must be fully handed out first; this one's
        // number is known only then.
        while st.scattering {
            let seq = st.seq;
            st = self.wait(st, deadline, op, seq, rank)?;
        }
        let seq = st.seq;
        let wait = |st: MutexGuard<'a, State>| self.wait(st, deadline, op, seq, rank);
        st.slots[rank] = Some(t.shallow_clone());
        st.calls[rank] = call;
        st.arrived += 1;
        if st.arrived == self.n {
            let r = same_call(&st.calls, &st.slots).and_then(|()| tch::no_grad(|| combine(&st.slots)));
            st.result = Some(r);
            st.scattering = true;
            self.cv.notify_all();
        } else {
            while !(st.scattering && st.seq == seq) {
                st = wait(st)?;
            }
        }
        let result = match st.result.as_ref().expect("result set before scattering") {
            Ok(t) => Ok(t.shallow_clone()),
            Err(reason) => Err(CommError::Invalid { op, seq, rank, reason: reason.clone() }),
        };
        st.departed += 1;
        if st.departed == self.n {
            st.slots.iter_mut().for_each(|s| *s = None);
            st.arrived = 0;
            st.departed = 0;
            st.result = None;
            st.scattering = false;
            st.seq += 1;
            self.cv.notify_all();
        }
        result
    }

    fn abort(&self, reason: &str) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.aborted.get_or_insert_with(|| reason.to_owned());
        self.cv.notify_all();
    }
}

/// Every rank must call the same collective (the same op, a broadcast from
/// the same root) on tensors of the same dtype; else the collective fails on
/// every rank with a message naming what each rank called.
fn same_call(calls: &[String], slots: &[Option<Tensor>]) -> Result<(), String> {
    let kinds: Vec<Option<tch::Kind>> = slots.iter().map(|s| s.as_ref().map(|t| t.kind())).collect();
    let describe = || {
        calls.iter().zip(slots).enumerate().map(|(r, (c, t))| {
            let t = t.as_ref().map_or(String::new(), |t| format!(" of {} {:?}", t.numel(), t.kind()));
            format!("rank {r}: {c}{t}")
        })
    };
    if calls.iter().any(|c| c != &calls[0]) {
        return Err(format!("the ranks called different collectives ({})", describe().collect::<Vec<_>>().join(", ")));
    }
    if kinds.iter().any(|k| k != &kinds[0]) {
        return Err(format!("the ranks' tensors have different dtypes ({})", describe().collect::<Vec<_>>().join(", ")));
    }
    Ok(())
}

/// The deposited tensors, every rank's present; an error unless all have `numel` elements.
fn deposited(slots: &[Option<Tensor>]) -> Result<Vec<&Tensor>, String> {
    let ts: Vec<&Tensor> = slots.iter().map(|s| s.as_ref().expect("every rank deposited")).collect();
    let sizes: Vec<usize> = ts.iter().map(|t| t.numel()).collect();
    if sizes.iter().any(|&s| s != sizes[0]) {
        return Err(format!("the ranks' tensors differ in size: {sizes:?} elements"));
    }
    Ok(ts)
}

/// The elementwise sum of the deposited tensors, flattened, summed in rank order.
fn sum_slots(slots: &[Option<Tensor>]) -> Combined {
    let ts = deposited(slots)?;
    let mut acc = ts[0].reshape([-1]).copy();
    for t in &ts[1..] {
        let _ = acc.g_add_(&t.reshape([-1]));
    }
    Ok(acc)
}

/// One rank's handle on an [`InProcessGroup`].
pub struct InProcessComm {
    group: Arc<InProcessGroup>,
    rank: usize,
    link: Option<Link>,
    stats: CommStats,
    /// The times of gathers run at their waits ([`Gathered::wait`]): their
    /// bytes and how long they took, read into `stats` by `stats`.
    late: Arc<Mutex<Vec<(u64, Duration)>>>,
}

impl InProcessComm {
    /// Runs a training collective, stretches it to the link's time for a
    /// buffer of `bytes` (the op's nccl-tests size) and accounts for it.
    fn timed(&mut self, op: Op, t: &Tensor, bytes: u64, combine: &dyn Fn(&[Option<Tensor>]) -> Combined) -> Result<Tensor, CommError> {
        let n = self.group.n;
        let t0 = Instant::now();
        let result = self.group.run(op.name(), op.name().to_owned(), self.rank, t, combine)?;
        let measured = t0.elapsed();
        let target = self.link.map_or(measured, |l| l.emulated(op, bytes, n, measured));
        if target > measured {
            std::thread::sleep(target - measured);
        }
        self.stats.count(op, bytes, n);
        self.stats.time(op, bytes, measured, target);
        Ok(result)
    }
}

impl Collective for InProcessComm {
    fn rank(&self) -> usize {
        self.rank
    }

    /// Thread ranks have no device stream to run beside: an "asynchronous"
    /// all-reduce runs at once (so the overlap code path runs, and is
    /// tested, on CPU too).
    fn supports_async(&self) -> bool {
        true
    }

    /// Plain memory stands for symmetric memory (so that those paths run,
    /// and are tested, on CPU too); there are no copy engines.
    fn capabilities(&self) -> Capabilities {
        Capabilities { overlap: true, symmetric_memory: true, copy_engines: false }
    }

    fn all_reduce_sum_async(&mut self, t: &Tensor) -> Result<(), CommError> {
        self.all_reduce_sum(&mut t.shallow_clone())
    }

    /// One collective over the tensors laid end to end: the sum, then the
    /// division by the number of ranks (the arithmetic of a flat bucket's
    /// reduction, value for value).
    fn all_reduce_avg_async(&mut self, ts: &[Tensor]) -> Result<(), CommError> {
        let flat = Tensor::cat(&ts.iter().map(|t| t.reshape([-1])).collect::<Vec<_>>(), 0);
        let mut sum = flat.shallow_clone();
        self.all_reduce_sum(&mut sum)?;
        let avg = sum / self.group.n as f64;
        let mut at = 0;
        tch::no_grad(|| {
            for t in ts {
                let n = t.numel() as i64;
                t.shallow_clone().copy_(&avg.narrow(0, at, n).view_as(t));
                at += n;
            }
        });
        Ok(())
    }

    /// The reduce-scatter, then the division by the number of ranks (what
    /// the reduction after the backward pass computes, value for value).
    fn reduce_scatter_avg_async(&mut self, t: &Tensor, out: &Tensor) -> Result<(), CommError> {
        let chunk = self.reduce_scatter_sum(t)? / self.group.n as f64;
        tch::no_grad(|| out.shallow_clone().copy_(&chunk.view_as(out)));
        Ok(())
    }

    /// Deferred to [`Gathered::wait`], where every rank runs the gather:
    /// until then `flat` holds only this rank's chunk of the update, so a
    /// read that does not wait for the gather sees stale values (what the
    /// tests of the prefetch rely on). Every rank must wait for its gathers
    /// in the same order.
    fn all_gather_in_place_async(&mut self, flat: &Tensor) -> Result<Option<Gathered>, CommError> {
        if self.link.is_some() {
            // An emulated link stretches each collective as it runs.
            self.all_gather_in_place(flat)?;
            return Ok(None);
        }
        let (group, rank, flat, late) = (self.group.clone(), self.rank, flat.shallow_clone(), self.late.clone());
        // Counted here, as NCCL's is at its launch (the gather at the wait
        // runs on a handle of its own).
        self.stats.count(Op::AllGather, nbytes(&flat), self.group.n);
        Ok(Some(Gathered::new(move || {
            let mut at_wait = InProcessComm { group, rank, link: None, stats: CommStats::default(), late: Arc::default() };
            let t0 = Instant::now();
            at_wait.all_gather_in_place(&flat)?;
            late.lock().unwrap_or_else(|e| e.into_inner()).push((nbytes(&flat), t0.elapsed()));
            Ok(())
        })))
    }

    /// Plain zeros: thread ranks share one memory already, and the split
    /// path then runs (and is tested) on CPU too.
    fn symmetric_zeros(&mut self, numel: i64, kind: Kind) -> Result<Option<Tensor>, CommError> {
        Ok(Some(Tensor::zeros([numel], (kind, tch::Device::Cpu))))
    }

    /// The reduce-scatter divided by the number of ranks, then the
    /// all-gather of the chunks back into `t`.
    fn all_reduce_split_avg_async(&mut self, t: &Tensor) -> Result<(), CommError> {
        let chunk = self.reduce_scatter_sum(t)? / self.group.n as f64;
        let all = self.all_gather(&chunk)?;
        tch::no_grad(|| t.shallow_clone().copy_(&all.view_as(t)));
        Ok(())
    }

    fn world_size(&self) -> usize {
        self.group.n
    }

    fn all_reduce_sum(&mut self, t: &mut Tensor) -> Result<(), CommError> {
        let sum = self.timed(Op::AllReduce, t, nbytes(t), &sum_slots)?;
        tch::no_grad(|| t.copy_(&sum.view_as(t)));
        Ok(())
    }

    fn all_gather(&mut self, t: &Tensor) -> Result<Tensor, CommError> {
        let n = self.group.n as u64;
        let gathered = self.timed(Op::AllGather, t, n * nbytes(t), &|slots| {
            let ts = deposited(slots)?;
            let flat: Vec<Tensor> = ts.iter().map(|t| t.reshape([-1])).collect();
            Ok(Tensor::cat(&flat, 0))
        })?;
        Ok(tch::no_grad(|| gathered.copy()))
    }

    fn reduce_scatter_sum(&mut self, t: &Tensor) -> Result<Tensor, CommError> {
        let n = self.group.n;
        let sum = self.timed(Op::ReduceScatter, t, nbytes(t), &|slots| {
            let numel = slots[0].as_ref().map_or(0, |t| t.numel());
            if numel % n != 0 {
                return Err(format!("{numel} elements do not split evenly over {n} ranks"));
            }
            sum_slots(slots)
        })?;
        let chunk = (sum.numel() / n) as i64;
        Ok(tch::no_grad(|| sum.narrow(0, self.rank as i64 * chunk, chunk).copy()))
    }

    fn broadcast(&mut self, t: &mut Tensor, root: usize) -> Result<(), CommError> {
        let r = self.group.run("broadcast", format!("broadcast from rank {root}"), self.rank, t, &|slots| {
            let ts = deposited(slots)?;
            Ok(ts[root].copy())
        })?;
        tch::no_grad(|| t.copy_(&r));
        Ok(())
    }

    fn all_reduce_sum_control(&mut self, t: &mut Tensor) -> Result<(), CommError> {
        let sum = self.group.run("all_reduce", "a control all_reduce".to_owned(), self.rank, t, &sum_slots)?;
        tch::no_grad(|| t.copy_(&sum.view_as(t)));
        Ok(())
    }

    fn abort(&self, reason: &str) {
        self.group.abort(&format!("rank {} failed: {reason}", self.rank));
    }

    fn stats(&mut self) -> &CommStats {
        for (bytes, took) in std::mem::take(&mut *self.late.lock().unwrap_or_else(|e| e.into_inner())) {
            self.stats.time(Op::AllGather, bytes, took, took);
        }
        &self.stats
    }

    fn reset_timings(&mut self) {
        self.late.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.stats.clear_timings();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spawn<F>(n: usize, timeout: Duration, f: F) -> Vec<Result<Vec<f32>, CommError>>
    where
        F: Fn(&mut InProcessComm) -> Result<Vec<f32>, CommError> + Send + Sync + 'static,
    {
        let g = InProcessGroup::new(n, timeout);
        let f = Arc::new(f);
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let (g, f) = (g.clone(), f.clone());
                std::thread::spawn(move || f(&mut g.rank(r, None)))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn all_reduce_sums_over_ranks_many_times() {
        let out = spawn(4, Duration::from_secs(10), |c| {
            let mut last = Vec::new();
            for k in 0..50 {
                let mut t = Tensor::from_slice(&[c.rank() as f32, k as f32, 1.0]);
                c.all_reduce_sum(&mut t)?;
                last = Vec::<f32>::try_from(&t).unwrap();
                assert_eq!(last, vec![6.0, 4.0 * k as f32, 4.0], "rank {} round {k}", c.rank());
            }
            assert_eq!(c.stats().collectives, 50);
            // 12 bytes per reduce, 2 * 3/4 of it sent per rank.
            assert_eq!(c.stats().ops[&Op::AllReduce].bytes, 50 * 12);
            assert_eq!(c.stats().bytes_sent, 50 * (2 * 3 * 12 / 4));
            Ok(last)
        });
        assert!(out.iter().all(|r| r.is_ok()));
    }

    #[test]
    fn broadcast_copies_the_root() {
        let out = spawn(3, Duration::from_secs(10), |c| {
            let mut t = Tensor::from_slice(&[c.rank() as f32 + 10.0]);
            c.broadcast(&mut t, 1)?;
            Ok(Vec::<f32>::try_from(&t).unwrap())
        });
        for r in out {
            assert_eq!(r.unwrap(), vec![11.0]);
        }
    }

    #[test]
    fn a_missing_rank_times_out_with_its_number() {
        let out = spawn(3, Duration::from_millis(300), |c| {
            if c.rank() == 2 {
                return Ok(vec![]); // never joins
            }
            let mut t = Tensor::from_slice(&[1.0f32]);
            c.all_reduce_sum(&mut t).map(|_| vec![])
        });
        for r in &out[..2] {
            match r {
                Err(CommError::Timeout { missing, op, .. }) => {
                    assert_eq!(missing, &vec![2]);
                    assert_eq!(*op, "all_reduce");
                }
                other => panic!("expected a timeout, got {other:?}"),
            }
        }
    }

    #[test]
    fn abort_releases_waiting_ranks_at_once() {
        let t0 = Instant::now();
        let out = spawn(2, Duration::from_secs(30), |c| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(50));
                c.abort("out of memory");
                return Ok(vec![]);
            }
            let mut t = Tensor::from_slice(&[1.0f32]);
            c.all_reduce_sum(&mut t).map(|_| vec![])
        });
        assert!(t0.elapsed() < Duration::from_secs(5));
        let e = out[0].as_ref().unwrap_err().to_string();
        assert!(e.contains("rank 1 failed: out of memory"), "{e}");
    }

    #[test]
    fn link_model_matches_the_ring_formula() {
        // 10 Gbps, 5 us, 8 ranks, 100 MB: 14 x 5 us + 14/8 x 0.8 Gb / 10 Gbps.
        let l = Link::flat(10.0, 5.0);
        let t = l.all_reduce_time(100_000_000, 8).as_secs_f64();
        assert!((t - (14.0 * 5e-6 + 14.0 / 8.0 * 0.08)).abs() < 1e-9, "{t}");
        assert_eq!(l.all_reduce_time(1, 1), Duration::ZERO);
    }

    #[test]
    fn a_topology_stretches_only_the_traffic_between_nodes() {
        let measured = Duration::from_millis(3);
        let (bytes, n) = (100_000_000u64, 8);
        // 2 nodes x 4 ranks at 10 Gbps, 5 us: the node's link carries a ring
        // over 2 nodes of the whole buffer (2 steps of 1/2 of it), after
        // the measured phases within nodes.
        let two_by_four = Link { nodes: Some(2), ..Link::flat(10.0, 5.0) };
        assert_eq!(two_by_four.topology(n), (2, 4));
        let inter = two_by_four.inter_node_time(Op::AllReduce, bytes, n).as_secs_f64();
        assert!((inter - (2.0 * 5e-6 + 2.0 / 2.0 * 0.08)).abs() < 1e-9, "{inter}");
        assert_eq!(
            two_by_four.emulated(Op::AllReduce, bytes, n, measured),
            measured + two_by_four.inter_node_time(Op::AllReduce, bytes, n)
        );
        // Gathers and scatters cross between nodes once (1 step of 1/2).
        let ag = two_by_four.inter_node_time(Op::AllGather, bytes, n).as_secs_f64();
        assert!((ag - (5e-6 + 0.04)).abs() < 1e-9, "{ag}");
        // One rank per node is the flat link: the ring over all ranks, at
        // least the measured time.
        let flat = Link::flat(10.0, 5.0);
        let eight = Link { nodes: Some(8), ..flat };
        assert_eq!(eight.emulated(Op::AllReduce, bytes, n, measured), flat.emulated(Op::AllReduce, bytes, n, measured));
        assert_eq!(flat.emulated(Op::AllReduce, bytes, n, measured), flat.all_reduce_time(bytes, n));
        assert_eq!(flat.emulated(Op::AllReduce, 8, n, Duration::from_secs(1)), Duration::from_secs(1));
        // 2 x 1 on 2 ranks is the flat link on 2.
        let two = Link { nodes: Some(2), ..flat };
        assert_eq!(two.emulated(Op::AllReduce, bytes, 2, measured), flat.emulated(Op::AllReduce, bytes, 2, measured));
    }

    #[test]
    fn thread_ranks_on_a_topology_add_the_time_between_nodes_to_what_they_measured() {
        let g = InProcessGroup::new(4, Duration::from_secs(10));
        let link = Link { nodes: Some(2), ..Link::flat(0.001, 0.0) }; // 1 Mbps per node
        let hs: Vec<_> = (0..4)
            .map(|r| {
                let g = g.clone();
                std::thread::spawn(move || {
                    let mut c = g.rank(r, Some(link));
                    let mut t = Tensor::full([1000], r as f64, (tch::Kind::Float, tch::Device::Cpu));
                    c.all_reduce_sum(&mut t).unwrap();
                    // The maths is the flat all-reduce's.
                    assert_eq!(Vec::<f32>::try_from(&t).unwrap(), vec![6.0; 1000]);
                    c.stats().clone()
                })
            })
            .collect();
        for h in hs {
            let s = h.join().unwrap();
            // 4000 bytes over 2 nodes: 2 steps of 2000 bytes at 1 Mbps = 32 ms, on top.
            assert_eq!(s.emulated_total - s.measured_total, Duration::from_millis(32));
        }
    }

    #[test]
    fn emulated_links_stretch_collectives() {
        let g = InProcessGroup::new(2, Duration::from_secs(10));
        let link = Link::flat(0.001, 0.0); // 1 Mbps
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let g = g.clone();
                std::thread::spawn(move || {
                    let mut c = g.rank(r, Some(link));
                    let mut t = Tensor::zeros([1000], (tch::Kind::Float, tch::Device::Cpu));
                    c.all_reduce_sum(&mut t).unwrap();
                    c.stats().clone()
                })
            })
            .collect();
        for h in hs {
            let s = h.join().unwrap();
            // 4000 bytes, 2 x 1/2 of it over 1 Mbps = 32 ms.
            assert!(s.emulated_total >= Duration::from_millis(32), "{:?}", s.emulated_total);
            assert!(s.measured_total < s.emulated_total);
        }
    }

    /// Fills `result` with this rank's number, waits until every rank has
    /// done the same (an all-reduce is a barrier), then reads it back: a
    /// result shared between ranks would show another rank's number.
    fn result_is_private(c: &mut InProcessComm, result: &mut Tensor) -> Result<bool, CommError> {
        let _ = result.fill_(c.rank() as f64);
        c.all_reduce_sum(&mut Tensor::from_slice(&[0.0f32]))?;
        Ok(Vec::<f32>::try_from(&*result).unwrap().iter().all(|&x| x == c.rank() as f32))
    }

    #[test]
    fn all_gather_concatenates_ranks_in_order_many_times() {
        let out = spawn(3, Duration::from_secs(10), |c| {
            let r = c.rank() as f32;
            for k in 0..20 {
                // 2-D input: the result is 1-D, rank after rank.
                let t = Tensor::from_slice(&[r, r + 10.0, k as f32]).view([1, 3]);
                let mut g = c.all_gather(&t)?;
                assert_eq!(g.size(), [9]);
                let want = [0.0, 10.0, k as f32, 1.0, 11.0, k as f32, 2.0, 12.0, k as f32];
                assert_eq!(Vec::<f32>::try_from(&g).unwrap(), want, "rank {} round {k}", c.rank());
                assert!(result_is_private(c, &mut g)?, "rank {}: the gathered tensor is shared", c.rank());
            }
            let s = c.stats().ops[&Op::AllGather].clone();
            assert_eq!(s.collectives, 20);
            // The size is the gathered buffer, 3 x 12 bytes; a ring sends 2/3 of it.
            assert_eq!(s.bytes, 20 * 36);
            assert_eq!(s.bytes_sent, 20 * 24);
            // The barrier all-reduces are accounted for apart, and everything in the totals.
            assert_eq!(c.stats().ops[&Op::AllReduce].collectives, 20);
            assert_eq!(c.stats().collectives, 40);
            assert_eq!(c.stats().bytes_sent, 20 * 24 + 20 * (2 * 2 * 4 / 3));
            Ok(vec![])
        });
        for r in out {
            r.unwrap();
        }
    }

    #[test]
    fn reduce_scatter_returns_this_ranks_chunk_of_the_sum() {
        let out = spawn(3, Duration::from_secs(10), |c| {
            let mut last = Vec::new();
            for k in 0..20 {
                // Rank r holds (r + 1) x [0, 1, ..., 5] + k: the sum is 6 x [0..6] + 3k.
                let t = (Tensor::arange(6, (tch::Kind::Float, tch::Device::Cpu)) * (c.rank() as f64 + 1.0) + k as f64).view([2, 3]);
                let mut chunk = c.reduce_scatter_sum(&t)?;
                let i = 2.0 * c.rank() as f32;
                last = Vec::<f32>::try_from(&chunk).unwrap();
                assert_eq!(last, vec![6.0 * i + 3.0 * k as f32, 6.0 * (i + 1.0) + 3.0 * k as f32], "rank {} round {k}", c.rank());
                assert!(result_is_private(c, &mut chunk)?, "rank {}: the chunk is shared", c.rank());
            }
            let s = c.stats().ops[&Op::ReduceScatter].clone();
            // The size is the buffer before scattering, 24 bytes; a ring sends 2/3 of it.
            assert_eq!((s.collectives, s.bytes, s.bytes_sent), (20, 20 * 24, 20 * 16));
            Ok(last)
        });
        assert!(out.iter().all(|r| r.is_ok()));
    }

    #[test]
    fn tensors_that_do_not_fit_fail_on_every_rank_at_once() {
        let t0 = Instant::now();
        // Three elements over two ranks do not split.
        let out = spawn(2, Duration::from_secs(30), |c| c.reduce_scatter_sum(&Tensor::from_slice(&[1.0f32, 2.0, 3.0])).map(|_| vec![]));
        for r in &out {
            match r {
                Err(CommError::Invalid { op: "reduce_scatter", reason, .. }) => assert!(reason.contains("do not split evenly"), "{reason}"),
                other => panic!("expected an invalid reduce-scatter, got {other:?}"),
            }
        }
        // Ranks gathering different sizes.
        let out = spawn(2, Duration::from_secs(30), |c| {
            c.all_gather(&Tensor::zeros([c.rank() as i64 + 1], tch::kind::FLOAT_CPU)).map(|_| vec![])
        });
        for r in &out {
            match r {
                Err(CommError::Invalid { op: "all_gather", reason, .. }) => assert!(reason.contains("[1, 2]"), "{reason}"),
                other => panic!("expected an invalid all-gather, got {other:?}"),
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "the ranks waited for the timeout");
    }

    #[test]
    fn a_missing_rank_times_out_in_gathers_and_scatters_too() {
        for op in [Op::AllGather, Op::ReduceScatter] {
            let out = spawn(3, Duration::from_millis(300), move |c| {
                if c.rank() == 1 {
                    return Ok(vec![]); // never joins
                }
                let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
                match op {
                    Op::AllGather => c.all_gather(&t),
                    _ => c.reduce_scatter_sum(&t),
                }
                .map(|_| vec![])
            });
            for r in [&out[0], &out[2]] {
                match r {
                    Err(e @ CommError::Timeout { missing, op: name, .. }) => {
                        assert_eq!(missing, &vec![1]);
                        assert_eq!(*name, op.name());
                        assert!(e.to_string().contains("rank(s) [1] never joined"), "{e}");
                    }
                    other => panic!("{op:?}: expected a timeout, got {other:?}"),
                }
            }
        }
    }

    #[test]
    fn single_rank_gathers_and_scatters_are_copies() {
        let mut c = SingleRank::default();
        let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).view([2, 2]);
        for out in [c.all_gather(&t).unwrap(), c.reduce_scatter_sum(&t).unwrap()] {
            assert_eq!(out.size(), [4]);
            assert_eq!(Vec::<f32>::try_from(&out).unwrap(), [1.0, 2.0, 3.0, 4.0]);
            assert_ne!(out.data_ptr(), t.data_ptr());
        }
        assert_eq!(c.stats().collectives, 0);
    }

    #[test]
    fn ring_model_of_gathers_and_scatters_is_half_an_all_reduce() {
        // 10 Gbps, 5 us, 8 ranks, 100 MB gathered: 7 x 5 us + 7/8 x 0.8 Gb / 10 Gbps.
        let l = Link::flat(10.0, 5.0);
        let t = l.all_gather_time(100_000_000, 8).as_secs_f64();
        assert!((t - (7.0 * 5e-6 + 7.0 / 8.0 * 0.08)).abs() < 1e-9, "{t}");
        assert_eq!(l.reduce_scatter_time(100_000_000, 8), l.all_gather_time(100_000_000, 8));
        assert_eq!(l.time(Op::AllReduce, 100_000_000, 8), l.all_reduce_time(100_000_000, 8));
        assert_eq!(l.all_gather_time(1, 1), Duration::ZERO);
    }

    #[test]
    fn bus_bandwidth_is_per_kind_of_collective() {
        // 4 ranks; 1 GB all-reduced in 1 s and 2 GB gathered in 1 s.
        let mut s = CommStats::default();
        s.count(Op::AllReduce, 1_000_000_000, 4);
        s.time(Op::AllReduce, 1_000_000_000, Duration::from_secs(1), Duration::from_secs(2));
        s.count(Op::AllGather, 2_000_000_000, 4);
        s.time(Op::AllGather, 2_000_000_000, Duration::from_secs(1), Duration::from_secs(1));
        // all-reduce: algbw 1 GB/s, busbw x 2 x 3/4; emulated half that.
        assert_eq!(s.bandwidth_gbs(4, false), Some((1.0, 1.5)));
        assert_eq!(s.bandwidth_gbs(4, true), Some((0.5, 0.75)));
        // all-gather: algbw 2 GB/s, busbw x 3/4.
        assert_eq!(s.op_bandwidth_gbs(Op::AllGather, 4, false), Some((2.0, 1.5)));
        assert_eq!(s.op_bandwidth_gbs(Op::ReduceScatter, 4, false), None);
        // Bytes sent: 2 x 3/4 of 1 GB plus 3/4 of 2 GB.
        assert_eq!(s.bytes_sent, 1_500_000_000 + 1_500_000_000);
        assert_eq!((s.collectives, s.latency.len()), (2, 2));
        s.clear_timings();
        assert_eq!(s.bandwidth_gbs(4, false), None);
        assert_eq!(s.ops[&Op::AllGather].bytes, 2_000_000_000);
    }

    #[test]
    fn emulated_links_stretch_gathers_by_the_ring_model() {
        let g = InProcessGroup::new(2, Duration::from_secs(10));
        let link = Link::flat(0.001, 0.0); // 1 Mbps
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let g = g.clone();
                std::thread::spawn(move || {
                    let mut c = g.rank(r, Some(link));
                    // Line the threads up first, so the gather's measured time is short.
                    c.all_reduce_sum(&mut Tensor::from_slice(&[0.0f32])).unwrap();
                    let t = Tensor::zeros([1000], (tch::Kind::Float, tch::Device::Cpu));
                    let _ = c.all_gather(&t).unwrap();
                    c.stats().clone()
                })
            })
            .collect();
        for h in hs {
            let s = h.join().unwrap();
            // 8000 bytes gathered, 1/2 of it over 1 Mbps = 32 ms (an all-reduce model would say 64).
            let e = s.ops[&Op::AllGather].emulated_total;
            assert!(e >= Duration::from_millis(32) && e < Duration::from_millis(60), "{e:?}");
        }
    }
}

/// NCCL through the `libnccl.so.2` that libtorch itself loaded (dlopen by
/// soname returns that library; loading another NCCL beside it fails with
/// "corrupted comm object" when two NCCLs are in one process). Collectives are issued on the legacy
/// default stream, libtorch's stream, so they are ordered with the step's
/// kernels without any synchronisation.
pub mod nccl {
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
            // Each rank's (call, elements, dtype), gathered on the device
            // outside the accounting (a setup-sized collective), then read
            // back: one small synchronous collective per plugin collective.
            let code = call.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3)) as i64 & i64::MAX;
            let kind = dtype(t.kind()).unwrap_or(-1) as i64;
            let mine = Tensor::from_slice(&[code, t.numel() as i64, kind]).to_device(t.device());
            let all = Tensor::zeros([3 * self.n as i64], (tch::Kind::Int64, t.device()));
            let (sp, rp) = (mine.data_ptr(), all.data_ptr());
            let l = lib().map_err(|e| self.fail("check", e))?;
            // SAFETY: 3 i64 read from `mine`, 3 x n written to `all`, live
            // device buffers; the legacy default stream orders them.
            let rc = unsafe { (l.all_gather)(sp, rp, 3, dtype(tch::Kind::Int64).unwrap_or(0), self.comm, std::ptr::null_mut()) };
            check(rc, "check").map_err(|e| self.fail("check", e))?;
            let got = Vec::<i64>::try_from(&all.to_device(tch::Device::Cpu)).map_err(|e| self.fail("check", e))?;
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
                // SAFETY: the communicator is owned and destroyed once.
                unsafe { (l.destroy)(self.comm) };
            }
            if let Some(s) = self.side.take() {
                // SAFETY: our stream, destroyed once; work on it completes first.
                let _ = unsafe { cudarc::driver::result::stream::destroy(s) };
            }
        }
    }
}
