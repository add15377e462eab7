//! Measuring: per-phase latency histograms, CUDA-event timelines read one step
//! late, and memory figures.
//!
//! On CPU a phase is the monotonic time between two marks. On CUDA each mark
//! records an event on libtorch's stream (the legacy default stream, which
//! harness never changes); the events of step k are read after step k+1 has
//! been enqueued, so measuring never stalls the device.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// The phases of a training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Preparing and uploading the batch (host time).
    Data,
    Forward,
    Backward,
    /// Gradient reduction by the compressor, collectives included.
    Communicate,
    Optimizer,
    /// Batch-size and checkpoint policy hooks (host time).
    Strategy,
    /// The forward pass, backward pass and update replayed as one CUDA
    /// graph (device time), in place of those three phases.
    Graph,
}

impl Phase {
    /// Every phase, in step order.
    pub const ALL: [Phase; 7] =
        [Phase::Data, Phase::Forward, Phase::Backward, Phase::Communicate, Phase::Optimizer, Phase::Strategy, Phase::Graph];

    /// The phase's name in results.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Data => "data",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Communicate => "communicate",
            Phase::Optimizer => "optimizer",
            Phase::Strategy => "strategy",
            Phase::Graph => "graph",
        }
    }
}

/// The process's cycle-counter clock for timing short calls (plugin hooks):
/// the TSC where it is invariant, calibrated against the monotonic clock
/// once per process, else the monotonic clock itself. A timed empty region
/// reads 10 to 25 ns (`harness plugin bench` prints it); timed with
/// `Instant::now` through the vDSO, a native hook read 150 ns rather than 60
/// on the development VM, which matters when the call itself takes tens of
/// nanoseconds.
pub fn clock() -> &'static quanta::Clock {
    static CLOCK: std::sync::OnceLock<quanta::Clock> = std::sync::OnceLock::new();
    CLOCK.get_or_init(quanta::Clock::new)
}

/// A start mark of [`clock`], for [`record_since`].
#[inline]
pub fn mark() -> u64 {
    clock().raw()
}

/// Nanoseconds since `start` (a [`mark`]).
#[inline]
pub fn ns_since(start: u64) -> u64 {
    let c = clock();
    c.delta_as_nanos(start, c.raw())
}

/// Records the time since `start` (a [`mark`]), clamped into the histogram's
/// range, and returns it in nanoseconds.
#[inline]
pub fn record_since(h: &mut Histogram<u64>, start: u64) -> u64 {
    let ns = ns_since(start);
    h.saturating_record(ns.max(1));
    ns
}

pub use harness_format::histogram::{decode, encode, new_histogram, record, LatencySummary};

/// Device intervals of one step: (phase, start event, end event).
type Marks = Vec<(Phase, cuda::Event, cuda::Event)>;

/// Times the phases of steps into histograms, one value per phase per step
/// (the micro-batches of gradient accumulation are summed).
pub struct PhaseTimer {
    cuda: bool,
    /// The previous step's device intervals, read once this step is queued.
    pending: Marks,
    current: Marks,
    /// This step's host time per phase (for device phases: time to issue them).
    host: BTreeMap<Phase, Duration>,
    open: Option<(Phase, Instant, Option<cuda::Event>)>,
    /// The open phase as a range of the trace, when one is recorded.
    range: Option<harness_kernels::torch_ext::Range>,
    spare: Vec<cuda::Event>,
    pub histograms: BTreeMap<Phase, Histogram<u64>>,
    /// On CUDA: host time spent issuing each device phase. A host time close
    /// to the device time means the step is bound by kernel launches.
    pub host_histograms: BTreeMap<Phase, Histogram<u64>>,
    /// Whether the current step counts (false during warm-up).
    recording: bool,
    /// Whether `pending` belongs to a step that counts.
    pending_recording: bool,
}

impl PhaseTimer {
    /// A timer for CPU (`cuda == false`) or for the current CUDA context.
    pub fn new(cuda: bool) -> PhaseTimer {
        let histograms = Phase::ALL.iter().map(|p| (*p, new_histogram())).collect();
        let host_histograms = if cuda {
            Phase::ALL.iter().filter(|p| Self::on_device(**p)).map(|p| (*p, new_histogram())).collect()
        } else {
            BTreeMap::new()
        };
        PhaseTimer {
            cuda,
            pending: Vec::new(),
            current: Vec::new(),
            host: BTreeMap::new(),
            open: None,
            range: None,
            spare: Vec::new(),
            histograms,
            host_histograms,
            recording: false,
            pending_recording: false,
        }
    }

    fn event(&mut self) -> anyhow::Result<cuda::Event> {
        match self.spare.pop() {
            Some(e) => Ok(e),
            None => cuda::Event::new(),
        }
    }

    /// Starts a step; `recording` says whether its times go into histograms.
    pub fn begin_step(&mut self, recording: bool) {
        self.recording = recording;
    }

    /// Starts a phase. Host phases (data, strategy) always use the host clock.
    pub fn start(&mut self, phase: Phase) -> anyhow::Result<()> {
        let ev = if self.cuda && Self::on_device(phase) {
            let e = self.event()?;
            e.record()?;
            Some(e)
        } else {
            None
        };
        self.range = harness_kernels::torch_ext::Range::open(|| format!("harness: {}", phase.name()));
        self.open = Some((phase, Instant::now(), ev));
        Ok(())
    }

    fn on_device(phase: Phase) -> bool {
        !matches!(phase, Phase::Data | Phase::Strategy)
    }

    /// Ends the phase started last.
    pub fn stop(&mut self) -> anyhow::Result<()> {
        let Some((phase, t0, ev)) = self.open.take() else {
            return Ok(());
        };
        self.range = None;
        *self.host.entry(phase).or_default() += t0.elapsed();
        if let Some(start) = ev {
            let end = self.event()?;
            end.record()?;
            self.current.push((phase, start, end));
        }
        Ok(())
    }

    /// Ends a step: records its host times, and reads the previous step's
    /// device events (which completed before this step's work, all of it
    /// already enqueued).
    pub fn end_step(&mut self) -> anyhow::Result<()> {
        let host = std::mem::take(&mut self.host);
        if self.recording {
            for (phase, d) in host {
                // Device phases: the device time comes from events; the
                // host time goes to the host histograms.
                let hist = if self.cuda && Self::on_device(phase) { &mut self.host_histograms } else { &mut self.histograms };
                if let Some(h) = hist.get_mut(&phase) {
                    record(h, d);
                }
            }
        }
        self.flush()?;
        self.pending = std::mem::take(&mut self.current);
        self.pending_recording = self.recording;
        Ok(())
    }

    /// Reads the pending device events (also called at the end of training).
    pub fn flush(&mut self) -> anyhow::Result<()> {
        let marks = std::mem::take(&mut self.pending);
        // Per phase, sum the intervals of the step (several micro-batches).
        let mut sums: BTreeMap<Phase, f64> = BTreeMap::new();
        for (phase, s, e) in &marks {
            if self.pending_recording {
                e.synchronize()?;
                *sums.entry(*phase).or_default() += cuda::Event::elapsed_ms(s, e)? as f64;
            }
        }
        for (phase, ms) in sums {
            if let Some(h) = self.histograms.get_mut(&phase) {
                record(h, Duration::from_secs_f64(ms / 1e3));
            }
        }
        for (_, s, e) in marks {
            self.spare.push(s);
            self.spare.push(e);
        }
        Ok(())
    }
}

/// CUDA events through the driver API (cudarc), on libtorch's stream.
pub mod cuda {
    use cudarc::driver::{result, sys};

    /// A CUDA event, destroyed on drop.
    pub struct Event(sys::CUevent);

    impl Event {
        /// Creates an event in the current context.
        pub fn new() -> anyhow::Result<Event> {
            Ok(Event(result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)?))
        }

        /// Records the event on the legacy default stream, libtorch's
        /// default (harness never switches libtorch's current stream).
        pub fn record(&self) -> anyhow::Result<()> {
            // SAFETY: self.0 is a live event of the current context; the null
            // stream is always valid.
            unsafe { result::event::record(self.0, std::ptr::null_mut())? };
            Ok(())
        }

        /// Records the event on `stream`.
        ///
        /// # Safety
        /// `stream` must be a live stream of the current context (or null).
        pub unsafe fn record_on(&self, stream: sys::CUstream) -> anyhow::Result<()> {
            // SAFETY: live event; the caller passes a live stream of this context.
            unsafe { result::event::record(self.0, stream)? };
            Ok(())
        }

        /// Makes `stream` wait (on the device) until this event has completed.
        ///
        /// # Safety
        /// `stream` must be a live stream of the current context (or null).
        pub unsafe fn wait_on(&self, stream: sys::CUstream) -> anyhow::Result<()> {
            // SAFETY: live event and stream.
            unsafe { result::stream::wait_event(stream, self.0, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)? };
            Ok(())
        }

        /// True when the event has completed (does not wait).
        pub fn done(&self) -> bool {
            // SAFETY: live event.
            unsafe { result::event::query(self.0) }.is_ok()
        }

        /// Waits until the event has completed.
        pub fn synchronize(&self) -> anyhow::Result<()> {
            // SAFETY: live event.
            unsafe { result::event::synchronize(self.0)? };
            Ok(())
        }

        /// Milliseconds between two completed events.
        pub fn elapsed_ms(start: &Event, end: &Event) -> anyhow::Result<f32> {
            // SAFETY: both events are live and were recorded.
            Ok(unsafe { result::event::elapsed(start.0, end.0)? })
        }
    }

    impl Drop for Event {
        fn drop(&mut self) {
            // SAFETY: the event is owned and destroyed once.
            let _ = unsafe { result::event::destroy(self.0) };
        }
    }
}

/// The process's peak resident set size in bytes (VmHWM).
pub fn peak_rss_bytes() -> Option<u64> {
    proc_status_kb("VmHWM:").map(|kb| kb * 1024)
}

/// The process's resident set size now, in bytes (VmRSS).
pub fn rss_bytes() -> Option<u64> {
    proc_status_kb("VmRSS:").map(|kb| kb * 1024)
}

/// Resets the kernel's peak-RSS counter, so the next reading covers one entry.
pub fn reset_peak_rss() {
    // Linux >= 4.0: writing 5 to clear_refs resets VmHWM to the current RSS.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn proc_status_kb(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_round_trip_through_base64() {
        let mut h = new_histogram();
        for v in [1_000u64, 2_000, 3_000, 1_000_000, 5_000_000_000] {
            h.record(v).unwrap();
        }
        let back = decode(&encode(&h)).unwrap();
        assert_eq!(back.len(), h.len());
        assert_eq!(back.value_at_quantile(0.5), h.value_at_quantile(0.5));
        assert_eq!(back.max(), h.max());
    }

    #[test]
    fn host_phases_land_in_their_histograms() {
        let mut t = PhaseTimer::new(false);
        for step in 0..5 {
            t.begin_step(step >= 2);
            t.start(Phase::Forward).unwrap();
            std::thread::sleep(Duration::from_millis(2));
            t.stop().unwrap();
            t.end_step().unwrap();
        }
        t.flush().unwrap();
        let h = &t.histograms[&Phase::Forward];
        assert_eq!(h.len(), 3, "warm-up steps are not recorded");
        assert!(h.min() >= 2_000_000);
    }
}
