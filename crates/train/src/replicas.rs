//! Replica consistency: data-parallel training assumes every rank holds the
//! same parameters. A compressor that returns different values on different
//! ranks (or a bug in a collective) lets the replicas drift apart silently;
//! each would train its own model and the entry would still look fine.
//!
//! Every `every` steps and after the last one, each rank takes a fingerprint
//! of its parameters (a 64-bit hash of each parameter's bytes, computed on
//! its device: `torch_ext::param_hashes`), rank 0's fingerprint is broadcast
//! (a setup-sized collective, not counted as the strategy's bytes), and
//! every rank compares its own with it: replicas of a correct data-parallel
//! run are bit-identical, so their hashes are equal, and a replica that
//! differs in any bit (a sign flipped in one slice of a bucket, which
//! leaves every norm unchanged) has another hash but for a chance of about
//! 2^-32. A rank whose fingerprint differs fails the entry, naming itself
//! and the first parameter that differs.

use anyhow::Result;
use tch::{Device, Kind, Tensor};

use crate::training::Pending;
use harness_kernels::torch_ext;
use harness_runtime::comm::Collective;

/// Steps between checks when the suite does not say.
pub const DEFAULT_EVERY: u64 = harness_format::switches::Switches::DEFAULT.replica_check_every;

/// Replicas that no longer agree.
#[derive(Debug, thiserror::Error)]
#[error(
    "the replicas diverged: after step {step}, rank {rank}'s parameter `{param}` differs from rank 0's (the hash of its bytes is \
     {theirs:016x}, rank 0's {ours:016x}); data-parallel replicas must stay identical (the compressor `{strategy}` returned \
     different results on different ranks?)"
)]
pub struct Diverged {
    pub step: u64,
    pub rank: usize,
    pub param: String,
    /// Rank 0's hash of the parameter's bytes.
    pub ours: u64,
    /// This rank's.
    pub theirs: u64,
    pub strategy: String,
}

/// When and how replicas are compared.
pub struct ReplicaCheck {
    every: u64,
    /// The steps of warm-up: a check also runs after the last of them.
    warmup: u64,
    /// Also on a single rank (to measure what the fingerprint costs).
    forced: bool,
    /// A comparison started by [`ReplicaCheck::start`], its verdict not read yet.
    in_flight: Option<InFlight>,
}

/// A comparison on its way: the hashes stay on the device and whether any
/// differs comes to the host behind an event, read by [`ReplicaCheck::settle`].
struct InFlight {
    done: u64,
    rank: usize,
    strategy: String,
    /// The parameters' names, for a verdict that fails.
    names: Vec<String>,
    ours: Tensor,
    reference: Tensor,
    differ: Pending,
}

impl ReplicaCheck {
    /// Checks every `every` steps and after the `warmup` steps of warm-up
    /// (0: only after the last step) with more than one rank; `forced`
    /// takes the fingerprint on one rank too.
    pub fn new(every: u64, warmup: u64, forced: bool) -> ReplicaCheck {
        ReplicaCheck { every, warmup, forced, in_flight: None }
    }

    /// Whether the check runs after `done` steps: every `every` steps, and
    /// once after warm-up, so that what the first check costs once (its
    /// kernel's first launch loads it: step 50 took 67 to 126 ms instead of
    /// 31 on 4 H200s, and GPT-2 124M's 4-GPU throughput over 50 measured
    /// steps read 0.6 to 0.9% low) falls in warm-up rather than in the
    /// measured steps.
    pub fn due(&self, done: u64, world: usize) -> bool {
        (world > 1 || self.forced) && self.every > 0 && (done % self.every == 0 || done == self.warmup)
    }

    /// Compares this rank's parameters with rank 0's, and waits for the
    /// verdict (after the last step).
    pub fn check(&mut self, params: &[Tensor], names: &[String], comm: &mut dyn Collective, done: u64, strategy: &str) -> Result<()> {
        self.start(params, names, comm, done, strategy)?;
        self.settle()
    }

    /// Starts comparing this rank's parameters with rank 0's (the verdict
    /// of a comparison still in flight is read first). The hashes and the
    /// broadcast are queued on the device and the verdict comes to the host
    /// behind an event: [`ReplicaCheck::settle`] reads it a step later, so
    /// the check does not stop the host until the device has drained its
    /// queue. (On 4 H200s this lag alone did not measurably change GPT-2
    /// 124M's throughput; what the check cost was its first launch, see
    /// [`ReplicaCheck::due`].)
    pub fn start(&mut self, params: &[Tensor], names: &[String], comm: &mut dyn Collective, done: u64, strategy: &str) -> Result<()> {
        if comm.world_size() == 1 && !self.forced {
            return Ok(());
        }
        self.settle()?;
        let ours = hashes(params)?;
        let (reference, differ) = if comm.world_size() == 1 {
            // Nothing to compare with: the fingerprint is taken (and read)
            // so that its cost shows.
            (ours.shallow_clone(), ours.f_sum(Kind::Int64)?.f_mul_scalar(0)?)
        } else {
            let mut reference = ours.copy();
            comm.broadcast(&mut reference, 0)?;
            let differ = ours.f_ne_tensor(&reference)?.f_any()?;
            (reference, differ)
        };
        let differ = Pending::start(done, 0.0, &differ.f_to_kind(Kind::Float)?)?;
        let (rank, strategy, names) = (comm.rank(), strategy.to_owned(), names.to_vec());
        self.in_flight = Some(InFlight { done, rank, strategy, names, ours, reference, differ });
        Ok(())
    }

    /// Reads the verdict of the comparison in flight, if there is one
    /// (waiting for it): an error naming the first parameter that differs.
    pub fn settle(&mut self) -> Result<()> {
        let Some(f) = self.in_flight.take() else { return Ok(()) };
        if f.differ.read()? == 0.0 {
            return Ok(());
        }
        Err(diverged(&f.ours, &f.reference, &f.names, f.done, f.rank, &f.strategy)?.into())
    }
}

/// The hashes of `params`' bytes: on a GPU one kernel per parameter
/// (`kernels::word_hashes`; the shim's ATen path launches about eight per
/// parameter, which made a check of GPT-2 124M cost about 6 ms on an H200),
/// else the shim's. Both give the same number, so ranks agree whichever
/// path each takes.
fn hashes(params: &[Tensor]) -> Result<Tensor> {
    if params.first().is_some_and(|p| p.device().is_cuda()) && harness_kernels::kernels::available() {
        return harness_kernels::kernels::word_hashes(params);
    }
    Ok(torch_ext::param_hashes(params)?)
}

/// What differs between this rank's hashes `mine` and rank 0's `reference`.
fn diverged(mine: &Tensor, reference: &Tensor, names: &[String], step: u64, rank: usize, strategy: &str) -> Result<Diverged> {
    let (a, b) = (Vec::<i64>::try_from(&mine.to_device(Device::Cpu))?, Vec::<i64>::try_from(&reference.to_device(Device::Cpu))?);
    let i = a.iter().zip(&b).position(|(x, y)| x != y).unwrap_or(0);
    Ok(Diverged {
        step,
        rank,
        param: names.get(i).cloned().unwrap_or_default(),
        ours: b.get(i).copied().unwrap_or(0) as u64,
        theirs: a.get(i).copied().unwrap_or(0) as u64,
        strategy: strategy.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use harness_runtime::comm::InProcessGroup;
    use std::time::Duration;

    /// A replica's parameters: a weight and a bias of mixed signs.
    fn params() -> Vec<Tensor> {
        let w = Tensor::linspace(-1.0, 1.0, 4096, (Kind::Float, Device::Cpu)).reshape([64, 64]);
        let b = Tensor::from_slice(&[0.5f32, -0.25, 0.75, -1.5, 2.0, -0.125]);
        vec![w, b]
    }

    /// Rank 1 negates a slice of the bias that holds as many positive as
    /// negative values: every norm stays bit-identical (what the check
    /// compared before), the hashes of the bytes do not, and the check
    /// names rank 1 and the bias.
    #[test]
    fn a_sign_flipped_slice_is_caught_and_named() {
        let (mine, flipped) = (params(), params());
        let _ = flipped[1].narrow(0, 1, 4).f_neg_().unwrap();
        for (a, b) in mine.iter().zip(&flipped) {
            assert_eq!(a.norm().double_value(&[]).to_bits(), b.norm().double_value(&[]).to_bits());
        }
        let (h0, h1) = (torch_ext::param_hashes(&mine).unwrap(), torch_ext::param_hashes(&flipped).unwrap());
        let (h0, h1) = (Vec::<i64>::try_from(&h0).unwrap(), Vec::<i64>::try_from(&h1).unwrap());
        assert_eq!(h0[0], h1[0]);
        assert_ne!(h0[1], h1[1]);
        // Equal bytes, equal hashes; a permutation of the words is seen too.
        assert_eq!(h0, Vec::<i64>::try_from(&torch_ext::param_hashes(&params()).unwrap()).unwrap());
        let swapped = params();
        swapped[0].narrow(0, 0, 2).copy_(&params()[0].narrow(0, 0, 2).flip([0]));
        assert_ne!(Vec::<i64>::try_from(&torch_ext::param_hashes(&swapped).unwrap()).unwrap()[0], h0[0]);

        // Two thread ranks, rank 1 with the flipped slice.
        let e = rank_one_fails(|r, c, names| {
            let p = params();
            if r == 1 {
                let _ = p[1].narrow(0, 1, 4).f_neg_().unwrap();
            }
            ReplicaCheck::new(1, 0, false).check(&p, names, c, 7, "flipper")
        });
        assert!(e.contains("after step 7, rank 1's parameter `b` differs from rank 0's") && e.contains("`flipper`"), "{e}");
    }

    /// Runs `f(rank, collective, names)` on two thread ranks (parameters
    /// `w` and `b`): rank 0 must succeed; returns rank 1's error.
    fn rank_one_fails(
        f: impl Fn(usize, &mut harness_runtime::comm::InProcessComm, &[String]) -> Result<()> + Send + Sync + 'static,
    ) -> String {
        let names = vec!["w".to_owned(), "b".to_owned()];
        let g = InProcessGroup::new(2, Duration::from_secs(10));
        let f = std::sync::Arc::new(f);
        let ranks: Vec<_> = (0..2)
            .map(|r| {
                let (g, names, f) = (g.clone(), names.clone(), f.clone());
                std::thread::spawn(move || f(r, &mut g.rank(r, None), &names).map_err(|e| e.to_string()))
            })
            .collect();
        let results: Vec<Result<(), String>> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(results[0].is_ok(), "{:?}", results[0]);
        results[1].clone().expect_err("rank 1 diverged")
    }

    /// A check started during training returns at once, on the diverged
    /// rank too, and its verdict comes with the next `settle`, naming the
    /// step it was taken after.
    #[test]
    fn a_started_check_fails_at_its_settle_naming_its_step() {
        let e = rank_one_fails(|r, c, names| {
            let p = params();
            let mut check = ReplicaCheck::new(2, 0, false);
            check.start(&p, names, c, 2, "flipper")?;
            check.settle()?;
            if r == 1 {
                let _ = p[0].narrow(0, 3, 1).f_neg_().unwrap();
            }
            // Returns at once on the diverged rank too; the verdict comes with the settle.
            check.start(&p, names, c, 4, "flipper")?;
            check.settle()
        });
        assert!(e.contains("after step 4, rank 1's parameter `w` differs from rank 0's"), "{e}");
    }

    /// Every `every` steps and once after warm-up, with several ranks (or
    /// forced); `every = 0` leaves only the check after the last step.
    #[test]
    fn checks_fall_every_n_steps_and_after_warm_up() {
        let due = |c: &ReplicaCheck, world| (1..=60).filter(|&d| c.due(d, world)).collect::<Vec<_>>();
        assert_eq!(due(&ReplicaCheck::new(25, 10, false), 4), [10, 25, 50]);
        assert_eq!(due(&ReplicaCheck::new(25, 0, false), 2), [25, 50]);
        assert!(due(&ReplicaCheck::new(25, 10, false), 1).is_empty());
        assert_eq!(due(&ReplicaCheck::new(25, 10, true), 1), [10, 25, 50]);
        assert!(due(&ReplicaCheck::new(0, 10, false), 4).is_empty());
    }

    /// Tensors of more than one chunk of rows, with a tail, and of every
    /// element width: one flipped bit anywhere changes the hash.
    #[test]
    fn one_bit_anywhere_changes_the_hash() {
        for kind in [Kind::Float, Kind::BFloat16, Kind::Double, Kind::Uint8] {
            let n = 4096 * 1024 + 1024 + 7;
            let t = Tensor::arange(n, (Kind::Int64, Device::Cpu)).remainder(251).to_kind(kind);
            let h = |t: &Tensor| Vec::<i64>::try_from(&torch_ext::param_hashes(&[t.shallow_clone()]).unwrap()).unwrap()[0];
            let base = h(&t);
            for at in [0, 4096 * 1024 - 1, 4096 * 1024 + 3, n - 1] {
                let u = t.copy();
                let bytes = u.view_dtype(Kind::Uint8);
                let i = at * kind.elt_size_in_bytes() as i64;
                let _ = bytes.narrow(0, i, 1).f_bitwise_xor_(1).unwrap();
                assert_ne!(h(&u), base, "{kind:?}, element {at}");
            }
        }
    }
}
