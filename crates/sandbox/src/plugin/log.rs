//! Plugin log output treated as data: every line is labelled with the
//! plugin's name, stripped of control characters (so a plugin cannot forge
//! or erase harness's own output lines with newlines or ANSI sequences),
//! cut to [`MAX_LINE_CHARS`], and each instance may write at most
//! [`MAX_LINES`] lines and [`MAX_BYTES`] bytes; later lines are dropped with
//! one notice.

use std::cell::Cell;

/// Characters of one log line that are printed; the rest is cut.
pub const MAX_LINE_CHARS: usize = 500;
/// Lines one plugin instance may log.
pub const MAX_LINES: u64 = 1000;
/// Bytes (after cutting) one plugin instance may log.
pub const MAX_BYTES: u64 = 256 << 10;

/// What one plugin instance has logged so far.
#[derive(Debug, Default)]
pub struct LogBudget {
    lines: Cell<u64>,
    bytes: Cell<u64>,
}

impl LogBudget {
    /// The line to print for `msg`, or `None` once the budget is spent (the
    /// first line over it is a notice saying so).
    pub fn admit(&self, plugin: &str, level: u32, msg: &str) -> Option<String> {
        let line = format!("[plugin {}] {}: {}", clean(plugin, 64), level_name(level), clean(msg, MAX_LINE_CHARS));
        let (lines, bytes) = (self.lines.get() + 1, self.bytes.get() + line.len() as u64);
        self.lines.set(lines);
        self.bytes.set(bytes);
        if lines <= MAX_LINES && bytes <= MAX_BYTES {
            return Some(line);
        }
        // Only the first line over the budget gets the notice.
        let over_before = lines - 1 > MAX_LINES || bytes - line.len() as u64 > MAX_BYTES;
        (!over_before).then(|| {
            format!(
                "[plugin {}] warn: log budget spent ({MAX_LINES} lines or {} KiB); further lines are dropped",
                clean(plugin, 64),
                MAX_BYTES >> 10
            )
        })
    }
}

fn level_name(level: u32) -> &'static str {
    match level {
        0 => "debug",
        1 => "info",
        _ => "warn",
    }
}

/// `s` with control and bidirectional characters escaped (`\n`, `\u{1b}`,
/// `\u{202e}`, ...) and cut to `max` characters.
pub fn clean(s: &str, max: usize) -> String {
    let mut out = String::new();
    for (n, c) in s.chars().enumerate() {
        if n >= max {
            let rest = s.chars().count() - n;
            out.push_str(&format!(" ... ({rest} more characters cut)"));
            break;
        }
        if harness_format::fmt::unseen(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Writes a plugin's log line to stderr, within its instance's budget
/// ([`LogBudget`]: escaped, cut, rate-limited).
pub fn log_line(budget: &LogBudget, plugin: &str, level: u32, msg: &str) {
    if let Some(line) = budget.admit(plugin, level, msg) {
        eprintln!("{line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_escaped_cut_and_rate_limited() {
        let b = LogBudget::default();
        let forged = b.admit("evil", 1, "ok\n\u{1b}[2K[harness] entry gpt/allreduce ok").unwrap();
        assert_eq!(forged, "[plugin evil] info: ok\\n\\u{1b}[2K[harness] entry gpt/allreduce ok");
        assert!(!forged.contains('\n') && !forged.contains('\u{1b}'));
        let long = b.admit("evil", 2, &"x".repeat(10_000)).unwrap();
        assert!(long.len() < 600 && long.ends_with("(9500 more characters cut)"), "{long}");
        let printed = (0..5000).filter_map(|_| b.admit("evil", 1, "spam")).collect::<Vec<_>>();
        assert_eq!(printed.len() as u64, MAX_LINES - 2 + 1, "the budget's lines, then one notice");
        assert!(printed.last().unwrap().contains("log budget spent"));
    }
}
