//! Collectives between ranks, run and accounted for by the host.
//!
//! [`SingleRank`] is the one-rank case. [`InProcessGroup`] makes ranks out of
//! threads of one process with a shared-memory collective: the CPU backend
//! for tests and the CPU suite, not a way to scale (a test and demo backend,
//! as DESIGN.md says). Every collective is timed into an HDR histogram and its
//! bytes on the wire are counted with the nccl-tests conventions (ring
//! all-reduce: each rank sends 2(n-1)/n of the buffer). A [`Link`] stretches
//! each collective to what an alpha-beta model of a ring over that link
//! predicts; both the measured and the emulated times are kept.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::measure;

/// A collective that failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommError {
    #[error("{op} #{seq} timed out after {timeout_s:.0} s on rank {rank}: rank(s) {missing:?} never joined")]
    Timeout { op: &'static str, seq: u64, rank: usize, missing: Vec<usize>, timeout_s: f64 },
    #[error("{op} #{seq} on rank {rank} was aborted: {reason}")]
    Aborted { op: &'static str, seq: u64, rank: usize, reason: String },
}

/// A link between ranks, for emulation: bandwidth and one-way latency.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    pub gbps: f64,
    #[serde(default)]
    pub latency_us: f64,
}

impl Link {
    /// Time of a ring all-reduce of `bytes` over `n` ranks on this link:
    /// 2(n-1) steps, each paying the latency and moving bytes/n.
    pub fn all_reduce_time(&self, bytes: u64, n: usize) -> Duration {
        if n < 2 {
            return Duration::ZERO;
        }
        let steps = 2.0 * (n - 1) as f64;
        let secs = steps * self.latency_us * 1e-6 + steps / n as f64 * bytes as f64 * 8.0 / (self.gbps * 1e9);
        Duration::from_secs_f64(secs)
    }
}

/// What a rank's collectives cost.
#[derive(Debug, Clone)]
pub struct CommStats {
    pub collectives: u64,
    /// Bytes this rank sent in training collectives (setup broadcasts excluded).
    pub bytes_sent: u64,
    /// Bytes of the buffers reduced (the nccl-tests "size").
    pub bytes_reduced: u64,
    /// Bytes reduced by the collectives in the timings (after warm-up).
    pub bytes_timed: u64,
    /// Measured time of each collective, ns.
    pub latency: Histogram<u64>,
    /// Time after link emulation, ns (equal to `latency` without a link).
    pub emulated: Histogram<u64>,
    pub measured_total: Duration,
    pub emulated_total: Duration,
}

impl Default for CommStats {
    fn default() -> Self {
        CommStats {
            collectives: 0,
            bytes_sent: 0,
            bytes_reduced: 0,
            bytes_timed: 0,
            latency: measure::new_histogram(),
            emulated: measure::new_histogram(),
            measured_total: Duration::ZERO,
            emulated_total: Duration::ZERO,
        }
    }
}

impl CommStats {
    fn clear_timings(&mut self) {
        self.latency.reset();
        self.emulated.reset();
        self.measured_total = Duration::ZERO;
        self.emulated_total = Duration::ZERO;
        self.bytes_timed = 0;
    }

    /// Algorithm bandwidth (bytes reduced / time) and bus bandwidth
    /// (algbw x 2(n-1)/n), in GB/s, over all all-reduces (nccl-tests).
    pub fn bandwidth_gbs(&self, n: usize, emulated: bool) -> Option<(f64, f64)> {
        let t = if emulated { self.emulated_total } else { self.measured_total }.as_secs_f64();
        if t <= 0.0 || self.bytes_timed == 0 {
            return None;
        }
        let alg = self.bytes_timed as f64 / t / 1e9;
        Some((alg, alg * 2.0 * (n as f64 - 1.0) / n as f64))
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
    /// Copies `root`'s `t` to every rank (setup; not counted as training bytes).
    fn broadcast(&mut self, t: &mut Tensor, root: usize) -> Result<(), CommError>;
    /// Gathers every rank's `t` (same shape on all ranks) into one new tensor of `world_size * t.numel()` elements, rank order, 1-D.
    fn all_gather(&mut self, t: &Tensor) -> Result<Tensor, CommError> {
        let _ = t;
        Err(CommError::Aborted { op: "all_gather", seq: 0, rank: self.rank(), reason: "not supported by this backend yet".into() })
    }
    /// Sums `t` (numel divisible by world_size) over ranks and returns this rank's 1-D chunk (numel / world_size elements, rank order).
    fn reduce_scatter_sum(&mut self, t: &Tensor) -> Result<Tensor, CommError> {
        let _ = t;
        Err(CommError::Aborted { op: "reduce_scatter", seq: 0, rank: self.rank(), reason: "not supported by this backend yet".into() })
    }
    /// Fails every other rank's pending and future collectives.
    fn abort(&self, reason: &str);
    /// What the collectives cost so far (device timings are read back here).
    fn stats(&mut self) -> &CommStats;
    /// Forgets the timings so far (not the counts or bytes): called when
    /// warm-up ends, so NCCL's lazy set-up stays out of the latencies.
    fn reset_timings(&mut self);
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
    fn broadcast(&mut self, _t: &mut Tensor, _root: usize) -> Result<(), CommError> {
        Ok(())
    }
    fn all_gather(&mut self, t: &Tensor) -> Result<Tensor, CommError> {
        Ok(t.reshape([-1]).copy())
    }
    fn reduce_scatter_sum(&mut self, t: &Tensor) -> Result<Tensor, CommError> {
        Ok(t.reshape([-1]).copy())
    }
    fn abort(&self, _reason: &str) {}
    fn stats(&mut self) -> &CommStats {
        &self.stats
    }
    fn reset_timings(&mut self) {}
}

#[derive(Default)]
struct State {
    /// Collectives completed by every rank.
    seq: u64,
    slots: Vec<Option<Tensor>>,
    arrived: usize,
    departed: usize,
    result: Option<Tensor>,
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
        let state = State { slots: (0..n).map(|_| None).collect(), ..Default::default() };
        Arc::new(InProcessGroup { n, timeout, state: Mutex::new(state), cv: Condvar::new() })
    }

    /// The handle of rank `rank`.
    pub fn rank(self: &Arc<Self>, rank: usize, link: Option<Link>) -> InProcessComm {
        InProcessComm { group: self.clone(), rank, link, stats: CommStats::default() }
    }

    /// Runs one collective: every rank deposits its tensor, the last one
    /// combines them with `combine`, every rank copies the result back.
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

    fn run<'a>(
        &'a self,
        op: &'static str,
        rank: usize,
        t: &mut Tensor,
        combine: &dyn Fn(&[Option<Tensor>]) -> Tensor,
    ) -> Result<(), CommError> {
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
        st.arrived += 1;
        if st.arrived == self.n {
            let r = combine(&st.slots);
            st.result = Some(r);
            st.scattering = true;
            self.cv.notify_all();
        } else {
            while !(st.scattering && st.seq == seq) {
                st = wait(st)?;
            }
        }
        let result = st.result.as_ref().map(Tensor::shallow_clone).expect("result set before scattering");
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
        drop(st);
        tch::no_grad(|| t.copy_(&result));
        Ok(())
    }

    fn abort(&self, reason: &str) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.aborted.get_or_insert_with(|| reason.to_owned());
        self.cv.notify_all();
    }
}

/// One rank's handle on an [`InProcessGroup`].
pub struct InProcessComm {
    group: Arc<InProcessGroup>,
    rank: usize,
    link: Option<Link>,
    stats: CommStats,
}

impl Collective for InProcessComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.n
    }

    fn all_reduce_sum(&mut self, t: &mut Tensor) -> Result<(), CommError> {
        let n = self.group.n;
        let bytes = (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        let t0 = Instant::now();
        self.group.run("all_reduce", self.rank, t, &|slots| {
            let mut acc = slots[0].as_ref().expect("every rank deposited").copy();
            for s in &slots[1..] {
                let _ = acc.g_add_(s.as_ref().expect("every rank deposited"));
            }
            acc
        })?;
        let measured = t0.elapsed();
        let target = self.link.map_or(measured, |l| l.all_reduce_time(bytes, n).max(measured));
        if target > measured {
            std::thread::sleep(target - measured);
        }
        let s = &mut self.stats;
        s.collectives += 1;
        s.bytes_reduced += bytes;
        s.bytes_timed += bytes;
        s.bytes_sent += 2 * (n as u64 - 1) * bytes / n as u64;
        measure::record(&mut s.latency, measured);
        measure::record(&mut s.emulated, target);
        s.measured_total += measured;
        s.emulated_total += target;
        Ok(())
    }

    fn broadcast(&mut self, t: &mut Tensor, root: usize) -> Result<(), CommError> {
        self.group.run("broadcast", self.rank, t, &|slots| slots[root].as_ref().expect("root deposited").copy())
    }

    fn abort(&self, reason: &str) {
        self.group.abort(&format!("rank {} failed: {reason}", self.rank));
    }

    fn stats(&mut self) -> &CommStats {
        &self.stats
    }

    fn reset_timings(&mut self) {
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
            assert_eq!(c.stats().bytes_reduced, 50 * 12);
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
        let l = Link { gbps: 10.0, latency_us: 5.0 };
        let t = l.all_reduce_time(100_000_000, 8).as_secs_f64();
        assert!((t - (14.0 * 5e-6 + 14.0 / 8.0 * 0.08)).abs() < 1e-9, "{t}");
        assert_eq!(l.all_reduce_time(1, 1), Duration::ZERO);
    }

    #[test]
    fn emulated_links_stretch_collectives() {
        let g = InProcessGroup::new(2, Duration::from_secs(10));
        let link = Link { gbps: 0.001, latency_us: 0.0 }; // 1 Mbps
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
}

/// NCCL through the `libnccl.so.2` that libtorch itself loaded (dlopen by
/// soname returns that library; loading another NCCL beside it fails with
/// "corrupted comm object", GPU.md). Collectives are issued on the legacy
/// default stream, libtorch's stream, so they are ordered with the step's
/// kernels without any synchronisation.
pub mod nccl {
    use std::ffi::{c_char, c_int, c_void, CStr};
    use std::sync::OnceLock;

    use tch::{Kind, Tensor};

    use super::{Collective, CommError, CommStats};
    use crate::measure::{self, cuda::Event};

    /// ncclUniqueId: 128 opaque bytes.
    #[repr(C)]
    #[derive(Clone, Copy)]
    pub struct UniqueId(pub [c_char; 128]);

    type CommT = *mut c_void;

    struct Lib {
        _lib: libloading::Library,
        get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> c_int,
        init_rank: unsafe extern "C" fn(*mut CommT, c_int, UniqueId, c_int) -> c_int,
        all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, CommT, *mut c_void) -> c_int,
        broadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, CommT, *mut c_void) -> c_int,
        destroy: unsafe extern "C" fn(CommT) -> c_int,
        error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    }

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
                Ok(Lib {
                    get_unique_id: sym!(b"ncclGetUniqueId"),
                    init_rank: sym!(b"ncclCommInitRank"),
                    all_reduce: sym!(b"ncclAllReduce"),
                    broadcast: sym!(b"ncclBroadcast"),
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
        /// (bytes, start, after NCCL, after link emulation) not yet read back.
        pending: Vec<(u64, Event, Event, Event)>,
        /// Emulated link, and the device word its clock stamps go to.
        link: Option<(super::Link, Tensor)>,
    }

    impl NcclComm {
        /// Joins the communicator `id` as `rank` of `n` (blocks until all join).
        /// With a `link`, every all-reduce is stretched on the device timeline
        /// to what the link's ring model predicts (see `kernels::spin_until`).
        pub fn new(id: UniqueId, rank: usize, n: usize, link: Option<super::Link>, device: tch::Device) -> anyhow::Result<NcclComm> {
            let l = lib().map_err(anyhow::Error::msg)?;
            let mut comm: CommT = std::ptr::null_mut();
            // SAFETY: comm receives a communicator handle; id is by value.
            check(unsafe { (l.init_rank)(&mut comm, n as c_int, id, rank as c_int) }, "ncclCommInitRank")?;
            let link = link.map(|k| (k, Tensor::zeros([1], (Kind::Int64, device))));
            Ok(NcclComm { comm, rank, n, stats: CommStats::default(), pending: Vec::new(), link })
        }

        fn op(
            &mut self,
            t: &Tensor,
            f: impl FnOnce(&Lib, *mut c_void, usize, c_int) -> c_int,
            what: &'static str,
        ) -> Result<(), CommError> {
            let fail = |reason: String| CommError::Aborted { op: what, seq: self.stats.collectives, rank: self.rank, reason };
            let l = lib().map_err(fail)?;
            if !t.is_contiguous() || !t.device().is_cuda() {
                return Err(fail("NCCL needs a contiguous CUDA tensor".into()));
            }
            let dt = dtype(t.kind()).ok_or_else(|| fail(format!("NCCL cannot reduce {:?}", t.kind())))?;
            let code = f(l, t.data_ptr(), t.numel(), dt);
            check(code, what).map_err(|e| fail(e.to_string()))
        }
    }

    impl Collective for NcclComm {
        fn rank(&self) -> usize {
            self.rank
        }
        fn world_size(&self) -> usize {
            self.n
        }
        fn all_reduce_sum(&mut self, t: &mut Tensor) -> Result<(), CommError> {
            let bytes = (t.numel() * t.kind().elt_size_in_bytes()) as u64;
            let rank = self.rank;
            let fail = move |e: anyhow::Error| CommError::Aborted { op: "all_reduce", seq: 0, rank, reason: e.to_string() };
            let event = || Event::new().and_then(|e| e.record().map(|_| e));
            let start = event().map_err(fail)?;
            if let Some((_, at)) = &self.link {
                crate::kernels::stamp(at).map_err(fail)?;
            }
            let comm = self.comm;
            // SAFETY: in place on t's device memory (send = receive buffer),
            // `count` elements of the given type; the legacy default stream.
            self.op(t, |l, p, count, dt| unsafe { (l.all_reduce)(p, p, count, dt, 0, comm, std::ptr::null_mut()) }, "all_reduce")?;
            let mid = event().map_err(fail)?;
            if let Some((link, at)) = &self.link {
                crate::kernels::spin_until(at, link.all_reduce_time(bytes, self.n).as_nanos() as u64).map_err(fail)?;
            }
            let end = event().map_err(fail)?;
            self.pending.push((bytes, start, mid, end));
            let n = self.n as u64;
            self.stats.collectives += 1;
            self.stats.bytes_reduced += bytes;
            self.stats.bytes_sent += 2 * (n - 1) * bytes / n;
            Ok(())
        }
        fn broadcast(&mut self, t: &mut Tensor, root: usize) -> Result<(), CommError> {
            let comm = self.comm;
            // SAFETY: in place on t's device memory; the legacy default stream.
            self.op(t, |l, p, count, dt| unsafe { (l.broadcast)(p, p, count, dt, root as c_int, comm, std::ptr::null_mut()) }, "broadcast")
        }
        fn abort(&self, _reason: &str) {
            // Not ncclCommAbort: on the H200s it left the CUDA context with an
            // illegal-address error that later crashed libtorch. A rank that
            // fails stops issuing collectives; its peers' watchdogs end them.
        }
        fn stats(&mut self) -> &CommStats {
            let secs = |a: &Event, b: &Event| Event::elapsed_ms(a, b).ok().map(|ms| std::time::Duration::from_secs_f64(ms as f64 / 1e3));
            for (bytes, s, m, e) in self.pending.drain(..) {
                if e.synchronize().is_err() {
                    continue;
                }
                let emulated = if self.link.is_some() { secs(&s, &e) } else { secs(&s, &m) };
                if let (Some(measured), Some(emulated)) = (secs(&s, &m), emulated) {
                    self.stats.bytes_timed += bytes;
                    measure::record(&mut self.stats.latency, measured);
                    measure::record(&mut self.stats.emulated, emulated);
                    self.stats.measured_total += measured;
                    self.stats.emulated_total += emulated;
                }
            }
            &self.stats
        }
        fn reset_timings(&mut self) {
            // Pending device timings belong to warm-up too.
            self.pending.clear();
            self.stats.clear_timings();
        }
    }

    impl Drop for NcclComm {
        fn drop(&mut self) {
            if let Ok(l) = lib() {
                // SAFETY: the communicator is owned and destroyed once.
                unsafe { (l.destroy)(self.comm) };
            }
        }
    }
}
