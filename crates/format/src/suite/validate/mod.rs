//! Checking a suite: [`Suite::load`] and [`Suite::parse`] read it, and
//! [`Suite::validate`] checks values against each other. Every problem is a
//! [`SuiteError`] that points into the file.
//!
//! The checks are methods of one checker, a file per part of the suite:
//! `[suite]` and `[projection]` here, the workloads in `workload.rs`, the
//! plugins, strategies and tracks in `strategy.rs`, the upper bounds in
//! `limits.rs`.

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

mod limits;
mod strategy;
mod workload;

use sha2::{Digest, Sha256};

use super::limits::MAX_NAME_LEN;
use super::spec::{ProjectionSpec, SuiteMeta, SuiteSpec};
use crate::fmt::{printable, withheld_in_lines};

/// A loaded, validated suite with its source.
#[derive(Debug, Clone)]
pub struct Suite {
    pub path: PathBuf,
    pub source: String,
    /// sha256 of the file's bytes, hex.
    pub sha256: String,
    pub spec: SuiteSpec,
}

/// A problem in a suite file, with where it is.
#[derive(Debug, Clone, thiserror::Error)]
pub struct SuiteError {
    pub path: PathBuf,
    pub source_text: String,
    pub span: Option<Range<usize>>,
    pub message: String,
    pub hint: Option<String>,
}

/// Several problems found by validation, reported together.
#[derive(Debug, Clone, thiserror::Error)]
pub struct SuiteErrors(pub Vec<SuiteError>);

impl fmt::Display for SuiteErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl SuiteError {
    /// Line and column (1-based) of the start of the span.
    pub fn line_col(&self) -> Option<(usize, usize)> {
        let start = self.span.as_ref()?.start.min(self.source_text.len());
        let before = &self.source_text[..start];
        let line = before.matches('\n').count() + 1;
        let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        Some((line, col))
    }
}

impl fmt::Display for SuiteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use codespan_reporting::diagnostic::{Diagnostic, Label};
        use codespan_reporting::files::SimpleFile;
        use codespan_reporting::term;
        let name = self.path.display().to_string();
        let loc = match self.line_col() {
            Some((l, c)) => format!("{name}:{l}:{c}"),
            None => name.clone(),
        };
        // The file chose the message's quotes and the excerpt: what a
        // terminal would act on (escape sequences) is shown, not sent.
        let (loc, message) = (printable(&loc), printable(&self.message));
        let mut diag = Diagnostic::error().with_message(format!("{loc}: {message}"));
        let (source, at) = excerpt(&self.source_text);
        if let Some(span) = &self.span {
            let end = span.end.max(span.start + 1).min(self.source_text.len());
            let start = span.start.min(end);
            diag = diag.with_labels(vec![Label::primary((), at(start)..at(end))]);
        }
        if let Some(h) = &self.hint {
            diag = diag.with_notes(vec![format!("hint: {}", printable(h))]);
        }
        let file = SimpleFile::new(printable(&name), source.as_str());
        let mut out = Vec::new();
        let config = term::Config::default();
        if term::emit(&mut out, &config, &file, &diag).is_err() {
            return write!(f, "error: {loc}: {message}");
        }
        f.write_str(String::from_utf8_lossy(&out).trim_end())
    }
}

/// `source` for an excerpt on a terminal: each character withheld from
/// its lines ([`withheld_in_lines`]) replaced by U+FFFD, with the map from
/// a byte offset in `source` to the same place in the copy.
fn excerpt(source: &str) -> (String, impl Fn(usize) -> usize + '_) {
    let shown = |i: usize, c: char| if withheld_in_lines(source, i, c) { '\u{fffd}' } else { c };
    let copy: String = source.char_indices().map(|(i, c)| shown(i, c)).collect();
    let at = move |offset: usize| {
        let mut o = offset.min(source.len());
        while !source.is_char_boundary(o) {
            o -= 1;
        }
        source[..o].char_indices().map(|(i, c)| shown(i, c).len_utf8()).sum()
    };
    (copy, at)
}

/// A path into the TOML document: keys and array indices.
#[derive(Debug, Clone)]
enum Seg {
    Key(&'static str),
    Index(usize),
}

use Seg::{Index, Key};

struct Checker<'a> {
    path: &'a Path,
    source: &'a str,
    doc: Option<toml_edit::Document<String>>,
    errors: Vec<SuiteError>,
}

impl<'a> Checker<'a> {
    fn span_of(&self, segs: &[Seg]) -> Option<Range<usize>> {
        let doc = self.doc.as_ref()?;
        let mut item: &toml_edit::Item = doc.as_item();
        let mut best = item.span();
        for seg in segs {
            let next = match seg {
                Seg::Key(k) => item.get(*k),
                Seg::Index(i) => item.get(*i),
            };
            match next {
                Some(n) => {
                    item = n;
                    if let Some(s) = n.span() {
                        best = Some(s);
                    }
                }
                None => break,
            }
        }
        best
    }

    fn err(&mut self, segs: &[Seg], message: impl Into<String>, hint: Option<String>) {
        let span = self.span_of(segs);
        self.errors.push(SuiteError {
            path: self.path.to_path_buf(),
            source_text: self.source.to_owned(),
            span,
            message: message.into(),
            hint,
        });
    }
}

impl Suite {
    /// An error about key `key` of the `index`-th `[[strategy]]` (or the
    /// strategy itself when the key is absent), at its line and column.
    pub fn strategy_error(&self, index: usize, key: &'static str, message: impl Into<String>, hint: Option<String>) -> SuiteError {
        let mut c = Checker {
            path: &self.path,
            source: &self.source,
            doc: self.source.parse::<toml_edit::Document<String>>().ok(),
            errors: Vec::new(),
        };
        c.err(&[Key("strategy"), Index(index), Key(key)], message, hint);
        c.errors.remove(0)
    }

    /// Reads and checks a suite file.
    pub fn load(path: &Path) -> Result<Suite, SuiteErrors> {
        let unreadable = |message: String| {
            SuiteErrors(vec![SuiteError {
                path: path.to_path_buf(),
                source_text: String::new(),
                span: None,
                message,
                hint: Some("give the path of a suite file, e.g. suites/cpu.toml".into()),
            }])
        };
        // Bounded: `harness validate /dev/zero` must not fill the memory.
        let bytes = crate::files::read_capped(path, crate::files::SUITE_MAX_BYTES).map_err(|e| match e {
            crate::files::FileError::Io { error, .. } => unreadable(format!("cannot read the suite: {error}")),
            e => unreadable(format!("cannot read the suite: {e}")),
        })?;
        let source = String::from_utf8(bytes).map_err(|e| unreadable(format!("cannot read the suite: it is not UTF-8 ({e})")))?;
        Suite::parse(path, source)
    }

    /// Parses and checks suite text (`path` only names it in messages).
    pub fn parse(path: &Path, source: String) -> Result<Suite, SuiteErrors> {
        let spec: SuiteSpec = match toml::from_str(&source) {
            Ok(s) => s,
            Err(e) => {
                let message = e.message().trim().to_owned();
                let hint = parse_hint(&message);
                return Err(SuiteErrors(vec![SuiteError {
                    path: path.to_path_buf(),
                    source_text: source.clone(),
                    span: e.span(),
                    message,
                    hint,
                }]));
            }
        };
        let sha256 = hex::encode(Sha256::digest(source.as_bytes()));
        let suite = Suite { path: path.to_path_buf(), source, sha256, spec };
        suite.validate()?;
        Ok(suite)
    }

    /// Checks values against each other; all problems are returned at once,
    /// in this order: `[suite]`, the workloads in file order, the plugins,
    /// the strategies.
    pub fn validate(&self) -> Result<(), SuiteErrors> {
        let mut c = Checker {
            path: &self.path,
            source: &self.source,
            doc: self.source.parse::<toml_edit::Document<String>>().ok(),
            errors: Vec::new(),
        };
        let s = &self.spec;
        c.meta(&s.suite);
        c.plan_bounds(s);
        let names = c.workloads(&s.workloads, &s.suite);
        c.plugins(&s.plugins);
        c.strategies(s, &names);
        c.tracks(s, &names);
        if let Some(p) = &s.projection {
            c.projection(p, s);
        }
        if c.errors.is_empty() {
            Ok(())
        } else {
            Err(SuiteErrors(c.errors))
        }
    }
}

/// The most cluster strings (and strategies) a `[projection]` may name: a
/// report of others' result files must not be made to project without end.
pub const MAX_PROJECTION_CLUSTERS: usize = 64;

/// The checks, one section of the file per method.
impl Checker<'_> {
    /// `[projection]`: at least one cluster, each of the shape
    /// `NODESxGPUS` or `A-BxGPUS` before its keys (the keys are read by
    /// `harness report`, which says what is wrong with them), and
    /// strategies the suite has (`allreduce` names the plain all-reduce).
    fn projection(&mut self, p: &ProjectionSpec, s: &SuiteSpec) {
        if p.clusters.is_empty() {
            self.err(
                &[Key("projection"), Key("clusters")],
                "`[projection]` needs at least one cluster",
                Some("e.g. clusters = [\"1-128x8:net=100Gbps\", \"2x4:net=10Gbps\"] (docs/projection.md)".into()),
            );
        }
        if p.clusters.len() > MAX_PROJECTION_CLUSTERS || p.strategies.len() > MAX_PROJECTION_CLUSTERS {
            self.err(
                &[Key("projection")],
                format!("`[projection]` names more than {MAX_PROJECTION_CLUSTERS} clusters or strategies"),
                Some("a range of nodes (`1-128x8:net=100Gbps`) names a cluster per power of two in one string".into()),
            );
        }
        let number =
            |x: &str| !x.is_empty() && x.len() <= 5 && x.bytes().all(|b| b.is_ascii_digit()) && x.parse::<u32>().is_ok_and(|n| n > 0);
        for (i, c) in p.clusters.iter().enumerate() {
            let shape = c.split_once(':').map_or(c.as_str(), |(a, _)| a);
            let ok = shape.split_once('x').is_some_and(|(nodes, g)| {
                number(g) && nodes.split_once('-').map_or_else(|| number(nodes), |(a, b)| number(a) && number(b))
            });
            if !ok {
                self.err(
                    &[Key("projection"), Key("clusters"), Index(i)],
                    format!("cluster `{}` is not NODESxGPUS[:key=value,...]", c.escape_debug()),
                    Some("e.g. \"64x8:net=100Gbps\" or \"1-128x8:net=400Gbps\" (docs/projection.md)".into()),
                );
            }
        }
        for (i, name) in p.strategies.iter().enumerate() {
            if name != "allreduce" && !s.strategies.iter().any(|t| &t.name == name) {
                self.err(
                    &[Key("projection"), Key("strategies"), Index(i)],
                    format!("strategy `{}` is not one of the suite's", name.escape_debug()),
                    Some("name a [[strategy]] of the suite, or `allreduce` for the plain all-reduce".into()),
                );
            }
        }
    }

    /// The `[suite]` table.
    fn meta(&mut self, meta: &SuiteMeta) {
        if meta.name.trim().is_empty() {
            self.err(&[Key("suite"), Key("name")], "the suite needs a name", None);
        }
        if meta.repeats == 0 {
            self.err(&[Key("suite"), Key("repeats")], "`repeats` must be at least 1", None);
        }
        if meta.world_size == 0 {
            self.err(&[Key("suite"), Key("world_size")], "`world_size` must be at least 1", None);
        }
        if meta.bucket_mb.is_some_and(|mb| !(mb.is_finite() && mb > 0.0)) {
            self.err(&[Key("suite"), Key("bucket_mb")], "`bucket_mb` must be a positive size in MiB", None);
        }
        if !(meta.collective_timeout_s.is_finite() && meta.collective_timeout_s > 0.0) {
            self.err(&[Key("suite"), Key("collective_timeout_s")], "`collective_timeout_s` must be a positive number of seconds", None);
        }
        if let Some(p) = meta.peak_tflops {
            if !(p.is_finite() && p > 0.0) {
                self.err(&[Key("suite"), Key("peak_tflops")], "`peak_tflops` must be a positive number", None);
            }
        }
        if meta.threads == Some(0) {
            self.err(&[Key("suite"), Key("threads")], "`threads` must be at least 1", Some("leave it out to use every core".into()));
        }
        self.description(&[Key("suite"), Key("description")], meta.description.as_deref());
        self.meta_bounds(meta);
    }

    /// A description is text for people (the report shows it, results and
    /// bundles carry it to others): tabs and line breaks, but no character
    /// that a terminal acts on or that reorders the text around it.
    fn description(&mut self, at: &[Seg], text: Option<&str>) {
        if let Some((_, c)) = text.and_then(|t| t.char_indices().find(|&(i, c)| withheld_in_lines(t, i, c))) {
            self.err(
                at,
                format!("the description holds {}, a character that a terminal acts on or that reorders text", c.escape_unicode()),
                Some("write it as plain text; tabs and line breaks are fine".into()),
            );
        }
    }
}

/// A plain name: names become parts of paths (the suite's result file,
/// entry ids in checkpoint and trace folders), so only ASCII letters,
/// digits, `-`, `_` and `.`, and at most [`MAX_NAME_LEN`] of them.
fn valid_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_NAME_LEN && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

/// The hint of a name that is not plain.
const NAME_HINT: &str = "use letters, digits, '-', '_' and '.', at most 100 characters";

fn parse_hint(message: &str) -> Option<String> {
    if message.contains("unknown field") {
        Some("check the spelling; docs/suite-format.md lists every key".into())
    } else if message.contains("missing field") {
        Some("add the key; docs/suite-format.md says what it means".into())
    } else if message.contains("invalid type") {
        Some("check the value's type (strings need quotes; numbers do not)".into())
    } else if message.contains("unknown variant") {
        Some("use one of the values listed above".into())
    } else {
        None
    }
}

#[cfg(test)]
pub(super) mod tests;
