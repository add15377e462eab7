//! [`InProcessGroup`]: ranks as threads of one process, with a
//! shared-memory collective (the CPU backend for tests and the CPU suite).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tch::{Kind, Tensor};

use super::{Capabilities, Collective, CommError, CommStats, Gathered, Link, Op};
use harness_kernels::torch_ext::nbytes;

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
