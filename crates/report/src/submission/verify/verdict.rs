//! What `verify` found ([`Verdict`]: each broken rule a [`Violation`]), the
//! helpers every check writes it with, and the text `harness verify`
//! prints ([`render`]).

use std::path::Path;

use serde::Serialize;

use harness_format::fmt::{printable, printable_path};

/// One broken rule: what is wrong, and what to do about it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Violation {
    /// The rule (the check's short name: files, result, suite, plugin,
    /// labels, hardware, plan, steps, histograms, figures, log, failures,
    /// official).
    pub rule: &'static str,
    pub what: String,
    pub todo: String,
}

/// What `verify` found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Verdict {
    pub violations: Vec<Violation>,
    /// Facts worth saying that break no rule.
    pub notes: Vec<String>,
}

impl Verdict {
    pub fn verified(&self) -> bool {
        self.violations.is_empty()
    }

    pub(super) fn add(&mut self, rule: &'static str, what: impl Into<String>, todo: impl Into<String>) {
        self.violations.push(Violation { rule, what: what.into(), todo: todo.into() });
    }

    /// The one-line reasons, for a leaderboard row.
    pub fn reasons(&self) -> Vec<String> {
        self.violations.iter().map(|v| format!("{}: {}", v.rule, v.what)).collect()
    }
}

pub(super) const RESUBMIT: &str = "run `harness submit` again on the original result file";

/// Relative difference of two figures, for the comparisons that allow
/// the rounding of a computation done twice (or of its JSON text).
pub(super) fn close(a: f64, b: f64, rel: f64) -> bool {
    a == b || (a - b).abs() <= rel * a.abs().max(b.abs())
}

/// The first 12 characters of a hash for messages (a hostile one may hold
/// any characters: cut at a character boundary).
pub(super) fn short(sha: &str) -> &str {
    sha.char_indices().nth(12).map_or(sha, |(i, _)| &sha[..i])
}

pub(super) fn list<S: AsRef<str>>(xs: &[S]) -> String {
    const SHOWN: usize = 6;
    let mut s = xs.iter().take(SHOWN).map(|x| x.as_ref().to_owned()).collect::<Vec<_>>().join(", ");
    if xs.len() > SHOWN {
        s.push_str(&format!(", and {} more", xs.len() - SHOWN));
    }
    s
}

/// The text `harness verify` prints.
pub fn render(dir: &Path, v: &Verdict) -> String {
    // The reasons quote what the bundle chose (names, versions, paths):
    // for a terminal, escaped.
    let p = |s: &str| printable(s).into_owned();
    let dir = printable_path(dir);
    let mut out = String::new();
    for n in &v.notes {
        out.push_str(&format!("note: {}\n", p(n)));
    }
    if v.verified() {
        out.push_str(&format!("{dir}: verified\n"));
        return out;
    }
    for x in &v.violations {
        out.push_str(&format!("violation [{}]: {}\n  what to do: {}\n", x.rule, p(&x.what), p(&x.todo)));
    }
    out.push_str(&format!("{dir}: NOT verified ({} violations)\n", v.violations.len()));
    out
}
