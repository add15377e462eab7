//! What a guest wrote to stderr, kept for error messages, and what the
//! host reads from it: a Rust guest's panic message, a Python guest's
//! exception, the end of another guest's output.

use std::sync::{Arc, Mutex};

use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};

use super::super::log;

/// A guest's stderr, kept for error messages: the first and the last
/// [`Stderr::KEEP`] bytes, whatever it writes in between, so a panic
/// message written after megabytes of output is still there. Writes never
/// fail and never block.
#[derive(Clone, Default)]
pub struct Stderr(Arc<Mutex<StderrBuf>>);

#[derive(Default)]
struct StderrBuf {
    head: Vec<u8>,
    tail: std::collections::VecDeque<u8>,
    total: u64,
}

impl Stderr {
    const KEEP: usize = 16 << 10;

    fn push(&self, bytes: &[u8]) {
        let mut b = self.0.lock().unwrap_or_else(|e| e.into_inner());
        b.total += bytes.len() as u64;
        let room = Self::KEEP.saturating_sub(b.head.len());
        let (to_head, rest) = bytes.split_at(room.min(bytes.len()));
        b.head.extend_from_slice(to_head);
        let rest = &rest[rest.len().saturating_sub(Self::KEEP)..];
        b.tail.extend(rest);
        let over = b.tail.len().saturating_sub(Self::KEEP);
        b.tail.drain(..over);
    }

    /// What was kept, with a marker where bytes were left out.
    pub fn contents(&self) -> String {
        let b = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut s = String::from_utf8_lossy(&b.head).into_owned();
        let cut = b.total - b.head.len() as u64 - b.tail.len() as u64;
        if cut > 0 {
            s.push_str(&format!("\n[... {cut} bytes left out ...]\n"));
        }
        s.push_str(&String::from_utf8_lossy(&b.tail.iter().copied().collect::<Vec<u8>>()));
        s
    }
}

impl IsTerminal for Stderr {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for Stderr {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }
    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

#[async_trait::async_trait]
impl Pollable for Stderr {
    async fn ready(&mut self) {}
}

#[async_trait::async_trait]
impl OutputStream for Stderr {
    fn write(&mut self, bytes: bytes::Bytes) -> StreamResult<()> {
        self.push(&bytes);
        Ok(())
    }
    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }
    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(64 << 10)
    }
}

impl tokio::io::AsyncWrite for Stderr {
    fn poll_write(self: std::pin::Pin<&mut Self>, _cx: &mut std::task::Context<'_>, buf: &[u8]) -> std::task::Poll<std::io::Result<usize>> {
        self.push(buf);
        std::task::Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: std::pin::Pin<&mut Self>, _cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: std::pin::Pin<&mut Self>, _cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

/// " at FILE:LINE:COL: MESSAGE" from a Rust guest's panic output on stderr.
pub(super) fn panic_message(stderr: &str) -> Option<String> {
    let mut lines = stderr.lines().skip_while(|l| !l.contains("panicked at"));
    let first = lines.next()?;
    let at = first.split_once("panicked at").map(|(_, r)| r.trim().trim_end_matches(':')).unwrap_or("");
    let msg: Vec<&str> = lines.take_while(|l| !l.starts_with("note:")).collect();
    Some(format!(" at {at}: {}", msg.join(" ")))
}

/// Bytes of a guest's stderr (its last ones) that an error quotes.
const QUOTED_STDERR: usize = 4 << 10;

/// `text` as lines quoted under an error: each line escaped and cut (so
/// nothing the plugin wrote can pass for a line of harness's own), marked
/// `  | `, at most its last [`QUOTED_STDERR`] bytes.
fn quoted(text: &str) -> String {
    let text = text.trim_end();
    let mut cut = text.len().saturating_sub(QUOTED_STDERR);
    while !text.is_char_boundary(cut) {
        cut += 1;
    }
    let mut out = String::new();
    if cut > 0 {
        out.push_str(&format!("\n  | [... {cut} bytes left out ...]"));
    }
    for line in text[cut..].lines() {
        out.push_str("\n  | ");
        out.push_str(&log::clean(line, log::MAX_LINE_CHARS));
    }
    out
}

/// What a guest wrote to stderr before it trapped without a Rust panic
/// message (a guest in C or JavaScript that aborts, say), quoted: its last
/// [`QUOTED_STDERR`] bytes, or nothing if it wrote nothing.
pub(super) fn stderr_tail(stderr: &str) -> String {
    match stderr.trim().is_empty() {
        true => String::new(),
        false => format!("; its stderr ends:{}", quoted(stderr)),
    }
}

/// The exception that ended a Python guest, from the traceback on its
/// stderr: componentize-py prints an exception that escapes an export
/// (any but its `Err`, which is the export's error result) and then
/// panics with "Python function threw an unexpected exception", which says
/// neither what was raised nor where. Returns "it raised TYPE: MESSAGE (at
/// FILE line N, in FUNCTION)", the innermost frame of the plugin's own code
/// (not of Python's library), then the traceback quoted. `None` if stderr
/// holds no traceback, or if the guest panicked in Rust for another reason.
pub(super) fn guest_exception(stderr: &str, panic: Option<&str>) -> Option<String> {
    if panic.is_some_and(|p| !p.contains("Python")) {
        return None;
    }
    // The last traceback (of a chain of exceptions, the one raised last),
    // up to the runtime's panic message after it.
    let start = stderr.rfind("Traceback (most recent call last):")?;
    let tb = &stderr[start..];
    let tb = &tb[..tb.find("\nthread '").map_or(tb.len(), |i| i + 1)];
    let lines: Vec<&str> = tb.lines().collect();
    // Frames and their source lines are indented; the exception is the
    // first line after them that is not.
    let at = 1 + lines[1..].iter().position(|l| !l.is_empty() && !l.starts_with(char::is_whitespace))?;
    let exception: Vec<&str> = lines[at..].iter().map(|l| l.trim()).filter(|l| !l.is_empty()).collect();
    // `  File "PATH", line N, in NAME`
    let frames: Vec<(&str, &str, &str)> = lines[1..at]
        .iter()
        .filter_map(|l| {
            let rest = l.trim_start().strip_prefix("File \"")?;
            let (path, rest) = rest.split_once("\", line ")?;
            let (line, name) = rest.split_once(", in ").unwrap_or((rest, "?"));
            Some((path, line.trim(), name.trim()))
        })
        .collect();
    // componentize-py's file system: Python's library under /python, the
    // bindings under /world, its own modules under /bundled, and the
    // plugin's folders (`-p`, the current one by default) as /0, /1, ...
    let library = |path: &str| {
        path.starts_with('<') || ["/python/", "/world/", "/bundled/"].iter().any(|p| path.starts_with(p)) || path.contains("site-packages")
    };
    let frame = frames.iter().rev().find(|f| !library(f.0)).or(frames.last());
    let mut out = format!("it raised {}", log::clean(&exception.join(" "), log::MAX_LINE_CHARS));
    if let Some((path, line, name)) = frame {
        // "/0/app.py" -> "app.py": the path in the plugin's folder.
        let own =
            path.strip_prefix('/').and_then(|p| p.split_once('/')).filter(|(n, _)| n.parse::<u32>().is_ok()).map_or(*path, |(_, p)| p);
        out.push_str(&format!(" (at {} line {}, in {})", log::clean(own, 200), log::clean(line, 20), log::clean(name, 100)));
    }
    out.push_str(&quoted(tb));
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stderr_keeps_its_head_and_tail() {
        let s = Stderr::default();
        for _ in 0..1024 {
            s.push(&[b'y'; 1024]);
        }
        s.push(b"thread '<unnamed>' panicked at src/lib.rs:1:1:\nthe end\n");
        let text = s.contents();
        assert!(text.len() < 40 << 10);
        assert!(text.contains("bytes left out"));
        assert_eq!(panic_message(&text).unwrap(), " at src/lib.rs:1:1: the end");
    }

    /// What componentize-py writes before its panic: the traceback; the
    /// error names the exception, the innermost frame of the plugin's own
    /// code (not of Python's library) and quotes the traceback.
    #[test]
    fn a_python_exception_is_read_from_its_traceback() {
        let panic = "thread '<unnamed>' panicked at runtime/src/lib.rs:1293:29:\n\
                     Python function threw an unexpected exception\nnote: run with `RUST_BACKTRACE=1`\n";
        let tb = "Traceback (most recent call last):\n  File \"/0/app.py\", line 44, in compress\n    \
                  tomllib.loads(\"=\")\n  File \"/python/tomllib/_parser.py\", line 102, in loads\n\
                  tomllib.TOMLDecodeError: Invalid statement\n  (at line 1, column 1)\n";
        let stderr = format!("earlier output\n{tb}{panic}");
        let p = panic_message(&stderr);
        let e = guest_exception(&stderr, p.as_deref()).unwrap();
        let (first, quoted) = e.split_once('\n').unwrap();
        assert_eq!(first, "it raised tomllib.TOMLDecodeError: Invalid statement (at line 1, column 1) (at app.py line 44, in compress)");
        assert!(quoted.starts_with("  | Traceback (most recent call last):\n  |   File \"/0/app.py\""), "{quoted}");
        assert!(!e.contains("earlier output") && !e.contains("panicked"), "{e}");
        // Of a chain, the exception raised last; escapes stay escaped.
        let chained = format!(
            "{tb}\nDuring handling of the above exception, another exception occurred:\n\n\
             Traceback (most recent call last):\n  File \"/0/app.py\", line 54, in check_k\nValueError: bad \u{1b}[2Kk\n{panic}"
        );
        let e = guest_exception(&chained, panic_message(&chained).as_deref()).unwrap();
        assert!(e.starts_with("it raised ValueError: bad \\u{1b}[2Kk (at app.py line 54, in check_k)\n"), "{e}");
        assert!(!e.contains('\u{1b}') && !e.contains("TOMLDecodeError"), "{e}");
        // A Rust panic is not taken for an exception, nor is a bare abort.
        let rust = format!("{tb}thread '<unnamed>' panicked at src/lib.rs:1:1:\nboom\n");
        assert!(guest_exception(&rust, panic_message(&rust).as_deref()).is_none());
        assert!(guest_exception("", None).is_none());
    }

    /// A guest that aborts without a Rust panic message (JavaScript's engine,
    /// C): the end of its stderr, quoted line by line.
    #[test]
    fn an_abort_quotes_the_end_of_stderr() {
        assert_eq!(stderr_tail(" \n"), "");
        let tail = stderr_tail(&format!("{}\nexpected a string\nStack:\n  f@app.js:1:2\n", "x".repeat(10_000)));
        assert!(tail.starts_with("; its stderr ends:\n  | [... "), "{tail}");
        assert!(tail.ends_with("\n  | expected a string\n  | Stack:\n  |   f@app.js:1:2"), "{tail}");
        assert!(tail.len() < QUOTED_STDERR + 600, "{}", tail.len());
    }

    #[test]
    fn panic_messages_are_read_from_stderr() {
        let s = "thread '<unnamed>' (1) panicked at src/lib.rs:51:20:\nboom\nnote: run with `RUST_BACKTRACE=1`\n";
        assert_eq!(super::panic_message(s).unwrap(), " at src/lib.rs:51:20: boom");
        assert!(super::panic_message("nothing").is_none());
    }
}
