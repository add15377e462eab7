//! Sequence pairs whose best loss is known: the `pairs` data of the `t5`
//! family (teacher-forced sequence-to-sequence training).
//!
//! A [`Translation`] is a word-for-word translation with a fixed seeded
//! dictionary (a permutation of the words `2..vocab`): the source is `len`
//! uniform words followed by the end-of-sequence token (as T5's inputs end
//! with `</s>`; T5 has no absolute positions, and the end is what the
//! encoder's relative positions count from), and target token `j` is the
//! dictionary's word for source word `j`, except that with probability
//! `noise` it is replaced by a uniform draw from all `vocab - 2` words
//! (which may be the right one). Token 0 is the decoder's start token and
//! token 1 the end of the source; neither is a target.
//!
//! Given the whole source, the best prediction of target token `j` puts
//! `q = 1 - noise + noise / m` on the dictionary's word and `noise / m` on
//! each of the other `m - 1` words (`m = vocab - 2`), whatever the earlier
//! target tokens were; so the best reachable mean cross-entropy per target
//! token is the entropy of that distribution ([`Translation::floor`]), and
//! `noise = 1` gives uniformly random targets (`ln m`), as the random-token
//! T5 benchmarks train on.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The end-of-sequence token that closes every source.
pub const EOS: i64 = 1;
/// The first word: tokens below are the start and end tokens.
const FIRST_WORD: i64 = 2;

/// A seeded word-for-word translation task (see the module's documentation).
#[derive(Debug, Clone)]
pub struct Translation {
    vocab: usize,
    noise: f64,
    /// `dict[w]`: the translation of word `w` (entries below
    /// [`FIRST_WORD`] unused).
    dict: Vec<i64>,
}

impl Translation {
    /// The task over `vocab` tokens (at least 4: the start and end tokens
    /// and two words) with replacement probability `noise` in [0, 1].
    pub fn new(vocab: usize, noise: f64, seed: u64) -> Translation {
        assert!(vocab >= 4 && (0.0..=1.0).contains(&noise));
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut words: Vec<i64> = (FIRST_WORD..vocab as i64).collect();
        // Fisher-Yates.
        for i in (1..words.len()).rev() {
            let j = rng.random_range(0..=i);
            words.swap(i, j);
        }
        let mut dict = vec![0; FIRST_WORD as usize];
        dict.extend(words);
        Translation { vocab, noise, dict }
    }

    /// Words (`vocab - 2`).
    fn words(&self) -> usize {
        self.vocab - FIRST_WORD as usize
    }

    /// The translation of word `w`.
    pub fn translate(&self, w: i64) -> i64 {
        self.dict[w as usize]
    }

    /// One pair, appended to `src` (`len` words and [`EOS`]) and `tgt`
    /// (`len` words).
    pub fn sample_into(&self, rng: &mut ChaCha8Rng, len: usize, src: &mut Vec<i64>, tgt: &mut Vec<i64>) {
        let last = self.vocab as i64 - 1;
        for _ in 0..len {
            let w = rng.random_range(FIRST_WORD..=last);
            src.push(w);
            let replaced = rng.random::<f64>() < self.noise;
            tgt.push(if replaced { rng.random_range(FIRST_WORD..=last) } else { self.translate(w) });
        }
        src.push(EOS);
    }

    /// The probability the best predictor gives target word `t` for source
    /// word `w`.
    pub fn posterior(&self, w: i64, t: i64) -> f64 {
        let r = self.noise / self.words() as f64;
        if self.translate(w) == t {
            1.0 - self.noise + r
        } else {
            r
        }
    }

    /// The best reachable mean cross-entropy per target token (nats),
    /// [`harness_format::suite::floor::translation_floor`].
    pub fn floor(&self) -> f64 {
        harness_format::suite::floor::translation_floor(self.vocab, self.noise)
    }

    /// The best reachable top-1 accuracy per target token: the dictionary's
    /// word is right with probability `q`.
    pub fn best_accuracy(&self) -> f64 {
        harness_format::suite::floor::translation_best_accuracy(self.vocab, self.noise)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_floor_is_the_mean_loss_of_the_true_posterior() {
        // Independent of the closed form: the mean -ln p(target | source)
        // of the true posterior over sampled pairs, and its best guess's
        // accuracy.
        for (vocab, noise) in [(16, 0.1), (50, 0.3), (5, 0.0), (12, 1.0), (4, 0.5)] {
            let task = Translation::new(vocab, noise, 7);
            let mut rng = ChaCha8Rng::seed_from_u64(11);
            let (mut src, mut tgt) = (Vec::new(), Vec::new());
            for _ in 0..2000 {
                let (mut s, mut t) = (Vec::new(), Vec::new());
                task.sample_into(&mut rng, 32, &mut s, &mut t);
                assert_eq!((s.len(), t.len(), s.pop()), (33, 32, Some(EOS)), "32 words and the end, 32 words");
                src.extend(s);
                tgt.extend(t);
            }
            let n = src.len() as f64;
            let nll: f64 = src.iter().zip(&tgt).map(|(&w, &t)| -task.posterior(w, t).ln()).sum::<f64>() / n;
            let hits = src.iter().zip(&tgt).filter(|(&w, &t)| task.translate(w) == t).count() as f64 / n;
            // 64,000 tokens: the Monte Carlo error is well below 0.02.
            assert!((nll - task.floor()).abs() < 0.02, "vocab {vocab}, noise {noise}: {nll} vs {}", task.floor());
            assert!((hits - task.best_accuracy()).abs() < 0.01, "vocab {vocab}, noise {noise}: {hits}");
            assert!(src.iter().chain(&tgt).all(|&w| (2..vocab as i64).contains(&w)), "words only, no start or end token");
        }
        assert!((Translation::new(12, 1.0, 0).floor() - 10f64.ln()).abs() < 1e-12, "random targets: ln(words)");
        assert_eq!(Translation::new(12, 0.0, 0).floor(), 0.0);
    }

    #[test]
    fn the_dictionary_is_a_seeded_permutation() {
        let a = Translation::new(40, 0.1, 3);
        let mut seen: Vec<i64> = (2..40).map(|w| a.translate(w)).collect();
        seen.sort();
        assert_eq!(seen, (2..40).collect::<Vec<_>>());
        let b = Translation::new(40, 0.1, 3);
        let c = Translation::new(40, 0.1, 4);
        assert!((2..40).all(|w| a.translate(w) == b.translate(w)));
        assert!((2..40).any(|w| a.translate(w) != c.translate(w)));
    }
}
