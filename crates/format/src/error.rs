//! Why an entry failed, as types: the step loop classifies its errors once
//! ([`EntryError`]), launch records them, and the CLI maps a run with failed
//! entries to its exit code. A leaf module: it imports nothing of harness.

/// Why an entry failed. `message` is what the result file stores and the
/// summary prints; the variant says what kind of failure it was.
#[derive(Debug, Clone, PartialEq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum EntryError {
    /// Out of memory, where no retry with a smaller batch was possible.
    #[error("{message}")]
    OutOfMemory { message: String },
    /// A strategy plugin failed: it trapped, broke a sandbox rule, returned
    /// an error or an invalid result. `plugin` is its name.
    #[error("{message}")]
    Plugin { plugin: String, message: String },
    /// Another rank failed, or a collective timed out waiting for one.
    #[error("{message}")]
    RankLost { message: String },
    /// Data-parallel replicas no longer hold the same parameters.
    #[error("{message}")]
    ReplicasDiverged { strategy: String, message: String },
    /// The training loss became NaN or infinite.
    #[error("{message}")]
    NonFiniteLoss { step: u64, message: String },
    /// libtorch raised an error (its first line).
    #[error("{message}")]
    Torch { message: String },
    /// Anything else (I/O, a checkpoint that does not verify, ...).
    #[error("{message}")]
    Other { message: String },
}

impl EntryError {
    /// The message stored in results.
    pub fn message(&self) -> &str {
        match self {
            EntryError::OutOfMemory { message }
            | EntryError::Plugin { message, .. }
            | EntryError::RankLost { message }
            | EntryError::ReplicasDiverged { message, .. }
            | EntryError::NonFiniteLoss { message, .. }
            | EntryError::Torch { message }
            | EntryError::Other { message } => message,
        }
    }

    /// A short name of the kind of failure.
    pub fn kind(&self) -> &'static str {
        match self {
            EntryError::OutOfMemory { .. } => "out-of-memory",
            EntryError::Plugin { .. } => "plugin",
            EntryError::RankLost { .. } => "rank-lost",
            EntryError::ReplicasDiverged { .. } => "replicas-diverged",
            EntryError::NonFiniteLoss { .. } => "non-finite-loss",
            EntryError::Torch { .. } => "libtorch",
            EntryError::Other { .. } => "other",
        }
    }

    /// The same error, said of rank `rank` ("rank 1: ...").
    pub fn on_rank(&self, rank: usize) -> EntryError {
        let mut e = self.clone();
        let m = match &mut e {
            EntryError::OutOfMemory { message }
            | EntryError::Plugin { message, .. }
            | EntryError::RankLost { message }
            | EntryError::ReplicasDiverged { message, .. }
            | EntryError::NonFiniteLoss { message, .. }
            | EntryError::Torch { message }
            | EntryError::Other { message } => message,
        };
        *m = format!("rank {rank}: {m}");
        e
    }

    /// A panic of the training code: libtorch errors surface as panics of
    /// `tch` carrying the C++ exception with its backtrace; keep the first
    /// line that says what happened.
    pub fn from_panic(msg: &str) -> EntryError {
        let first = first_line(msg);
        if is_oom_message(first) {
            EntryError::OutOfMemory { message: format!("out of memory: {first}") }
        } else {
            EntryError::Torch { message: first.to_owned() }
        }
    }
}

/// Whether an error or panic message is libtorch's out-of-memory error
/// (CUDA's caching allocator says "CUDA out of memory"; the Python-facing
/// exception type is `OutOfMemoryError`).
pub fn is_oom_message(msg: &str) -> bool {
    msg.contains("out of memory") || msg.contains("OutOfMemoryError")
}

/// `msg` without libtorch's C++ backtraces: an exception's text is followed
/// by "Exception raised from ..." and dozens of "frame #N" lines, which
/// say nothing to a user and would fill result files.
pub fn without_backtrace(msg: &str) -> String {
    let mut out = String::new();
    let mut skipping = false;
    for line in msg.split_inclusive('\n') {
        let t = line.trim_start();
        if t.starts_with("Exception raised from") || t.starts_with("frame #") {
            skipping = true;
            continue;
        }
        if skipping && (t.is_empty() || t.starts_with('(') || t.starts_with("0x")) {
            continue;
        }
        skipping = false;
        out.push_str(line);
    }
    out.trim_end().to_owned()
}

/// The first line of a libtorch error that says what happened, without
/// the `unwrap` wrapper, tch's `Torch("...")` quoting or the C++ backtrace.
pub fn first_line(msg: &str) -> &str {
    let msg = msg.trim_start_matches("called `Result::unwrap()` on an `Err` value: ");
    // tch formats its error with Debug: Torch("first line\nException raised...").
    let msg = msg.strip_prefix("Torch(\"").map_or(msg, |m| m.split("\\n").next().unwrap_or(m));
    msg.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("panic")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backtraces_are_cut() {
        let e = "host op `matmul`: shapes cannot be multiplied (2x3 and 4x5)\nException raised from meta at /pytorch/aten/src/ATen/native/LinearAlgebra.cpp:190 (most recent call first):\nframe #0: c10::Error::Error() + 0x9 (0x7f in libc10.so)\nframe #1: at::meta() + 0x10\n";
        assert_eq!(without_backtrace(e), "host op `matmul`: shapes cannot be multiplied (2x3 and 4x5)");
        assert_eq!(without_backtrace("plain\nsecond line"), "plain\nsecond line");
    }

    #[test]
    fn panics_keep_their_first_line_and_out_of_memory_is_named() {
        let torch = "called `Result::unwrap()` on an `Err` value: Torch(\"shape '[2, 3]' is invalid\\nException raised from ...\")";
        assert_eq!(EntryError::from_panic(torch), EntryError::Torch { message: "shape '[2, 3]' is invalid".into() });
        let oom = EntryError::from_panic("CUDA out of memory. Tried to allocate 2.00 GiB\n  frame #0 ...");
        assert_eq!(oom.kind(), "out-of-memory");
        assert_eq!(oom.message(), "out of memory: CUDA out of memory. Tried to allocate 2.00 GiB");
    }
}
