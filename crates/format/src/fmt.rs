//! Short forms of numbers and hashes for console lines and tables, and
//! text from files made safe to print.

use std::borrow::Cow;

/// 12345.6 -> "12.3k".
pub fn human(x: f64) -> String {
    if x >= 1e9 {
        format!("{:.2}G", x / 1e9)
    } else if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.1}")
    }
}

/// `n` and the noun, singular for one: `counted(1, "entry", "entries")` is
/// "1 entry", `counted(3, ...)` "3 entries".
pub fn counted(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// The first 12 characters of a hash (or the whole, if shorter).
pub fn short(s: &str) -> &str {
    &s[..s.len().min(12)]
}

/// Characters a reader does not see but that change how the text around
/// them reads: control characters (C0, DEL, C1; a terminal acts on escape
/// sequences that start with some of them) and the Unicode bidirectional
/// controls, which can reorder what follows them on screen.
pub fn unseen(c: char) -> bool {
    c.is_control() || matches!(c, '\u{200e}' | '\u{200f}' | '\u{061c}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// The unseen characters that text for a terminal must not hold as they
/// are: all but tabs and line feeds, which lay out multi-line text. A
/// carriage return is withheld: alone, it sends the cursor back to the
/// start of the line, and what follows overwrites what was printed (a
/// folder named `ok\rNOT verified` would read as something else). Where a
/// file's own lines are shown, see [`withheld_in_lines`].
pub fn withheld(c: char) -> bool {
    unseen(c) && !matches!(c, '\t' | '\n')
}

/// Whether the character `c` at byte `at` of `text`, a file's lines as
/// they are shown (a suite's excerpt, its descriptions), is withheld: as
/// [`withheld`], except for the carriage return of a CRLF line end, which
/// ends the line like the line feed after it.
pub fn withheld_in_lines(text: &str, at: usize, c: char) -> bool {
    withheld(c) && !(c == '\r' && text.as_bytes().get(at + 1) == Some(&b'\n'))
}

/// `s` with the characters `escaped` picks written as escapes (`\u{1b}`).
fn escaping(s: &str, escaped: impl Fn(char) -> bool) -> Cow<'_, str> {
    if !s.chars().any(&escaped) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if escaped(c) {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// `s` as a terminal may print it when a file or a plugin chose it (a
/// message that quotes names and values, a table of them): [`withheld`]
/// characters written as escapes (`\u{1b}`, `\u{d}`), so that the reader
/// sees what the file held; tabs and line feeds lay the text out. A single
/// name or value on a line of its own making uses [`printable_line`].
pub fn printable(s: &str) -> Cow<'_, str> {
    escaping(s, withheld)
}

/// One name or value that a file or a plugin chose, for a line of the
/// terminal (a plugin's name, a host name, a folder): every [`unseen`]
/// character written as an escape, tabs and line feeds too, so that it
/// cannot start a line of its own that reads as harness's.
pub fn printable_line(s: &str) -> Cow<'_, str> {
    escaping(s, unseen)
}

/// A path as [`printable_line`] shows it: a folder from elsewhere (a
/// bundle someone sent) may hold escape sequences and line breaks in its
/// name.
pub fn printable_path(p: &std::path::Path) -> String {
    printable_line(&p.display().to_string()).into_owned()
}

/// Text for one terminal line that names files and folders (`harness
/// report`'s notes), whose names may hold escape sequences: every unseen
/// character, line breaks included, becomes U+FFFD.
pub fn terminal(s: &str) -> String {
    s.chars().map(|c| if unseen(c) { '\u{fffd}' } else { c }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printable_text_escapes_what_a_terminal_acts_on_and_keeps_the_rest() {
        assert!(matches!(printable("plain, ünïcode\tand\nlines"), Cow::Borrowed(_)));
        assert_eq!(printable("a\u{1b}[2Jb\u{7}\u{9b}c\u{202e}d\u{7f}"), r"a\u{1b}[2Jb\u{7}\u{9b}c\u{202e}d\u{7f}");
    }

    /// Issue 61: `harness verify` and `harness reproduce` printed a carriage
    /// return from a bundle folder's name, which let the rest of the name
    /// overwrite what the line said.
    #[test]
    fn a_carriage_return_is_escaped_everywhere_and_a_line_break_in_a_name_too() {
        assert_eq!(printable("ok\rNOT verified\r\n"), "ok\\u{d}NOT verified\\u{d}\n");
        assert!(!printable("a\rb\u{b}c\u{c}d").contains(['\r', '\u{b}', '\u{c}']));
        // A name is one line: a line feed or a tab in it is escaped too.
        assert_eq!(printable_line("p\n[harness] ok\t\r"), r"p\u{a}[harness] ok\u{9}\u{d}");
        assert!(matches!(printable_line("topk 0.1.0"), Cow::Borrowed(_)));
        let folder = std::path::Path::new("/b/ok\rNOT\n.bundle");
        assert_eq!(printable_path(folder), r"/b/ok\u{d}NOT\u{a}.bundle");
    }

    #[test]
    fn a_files_crlf_line_ends_are_kept_and_a_lone_carriage_return_is_not() {
        let text = "a = 1\r\nb = 2\rc\r";
        let withheld: Vec<usize> = text.char_indices().filter(|&(i, c)| withheld_in_lines(text, i, c)).map(|(i, _)| i).collect();
        assert_eq!(withheld, [12, 14]);
    }
}
