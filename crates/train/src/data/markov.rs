//! The first-order Markov chain of the token data: a seeded chain whose
//! entropy rate is the best next-token loss, sampled from its stationary
//! distribution.

use rand::Rng;

use harness_format::suite::floor::{markov_entropy_rate, MarkovTransitions};

/// A first-order Markov chain over `vocab` tokens.
#[derive(Debug, Clone)]
pub struct MarkovChain {
    vocab: usize,
    k: usize,
    succ: Vec<u32>,
    /// Cumulative probabilities, `k` per state.
    cum: Vec<f64>,
    probs: Vec<f64>,
    stationary: Vec<f64>,
    stationary_cum: Vec<f64>,
}

impl MarkovChain {
    /// A seeded chain ([`MarkovTransitions`], which the data's recorded
    /// floor is worked out from): every state `s` has `s + 1 mod vocab`
    /// among its successors (so the chain is irreducible); state 0 also has
    /// itself when `branching > 1` (so it is aperiodic).
    pub fn new(vocab: usize, branching: usize, seed: u64) -> Self {
        let MarkovTransitions { vocab, branching: k, succ, probs, stationary } = MarkovTransitions::new(vocab, branching, seed);
        let mut cum = Vec::with_capacity(vocab * k);
        for s in 0..vocab {
            let mut acc = 0.0;
            for j in 0..k {
                acc += probs[s * k + j];
                cum.push(acc);
            }
        }
        let mut stationary_cum = Vec::with_capacity(vocab);
        let mut acc = 0.0;
        for p in &stationary {
            acc += p;
            stationary_cum.push(acc);
        }
        MarkovChain { vocab, k, succ, cum, probs, stationary, stationary_cum }
    }

    /// Vocabulary size.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The stationary distribution.
    pub fn stationary(&self) -> &[f64] {
        &self.stationary
    }

    /// Transition probability P(s -> t).
    pub fn prob(&self, s: usize, t: usize) -> f64 {
        (0..self.k).filter(|&j| self.succ[s * self.k + j] as usize == t).map(|j| self.probs[s * self.k + j]).sum()
    }

    /// Entropy rate in nats: the lowest expected next-token loss (the
    /// data's floor, [`harness_format::suite::DataSpec::loss_floor`]).
    pub fn entropy_rate(&self) -> f64 {
        markov_entropy_rate(self.k, &self.probs, &self.stationary)
    }

    fn draw(cum: &[f64], u: f64) -> usize {
        cum.partition_point(|&c| c <= u).min(cum.len() - 1)
    }

    /// Appends a stationary sequence of `len` tokens to `out`.
    pub fn sample_into(&self, rng: &mut impl Rng, len: usize, out: &mut Vec<i64>) {
        let mut s = Self::draw(&self.stationary_cum, rng.random::<f64>());
        for _ in 0..len {
            out.push(s as i64);
            let j = Self::draw(&self.cum[s * self.k..(s + 1) * self.k], rng.random::<f64>());
            s = self.succ[s * self.k + j] as usize;
        }
    }
}
