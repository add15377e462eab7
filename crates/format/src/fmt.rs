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
/// are: all but tabs and line breaks, which lay out multi-line text.
pub fn withheld(c: char) -> bool {
    unseen(c) && !matches!(c, '\t' | '\n' | '\r')
}

/// `s` as a terminal may print it when a file chose it (a key, a name, a
/// value quoted in a message): [`withheld`] characters written as escapes
/// (`\u{1b}`), so that the reader sees what the file held. (One-line notes
/// that name files use [`terminal`] instead.)
pub fn printable(s: &str) -> Cow<'_, str> {
    if !s.chars().any(withheld) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if withheld(c) {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// A path as [`printable`] shows it: a folder from elsewhere (a bundle
/// someone sent) may hold escape sequences in its name.
pub fn printable_path(p: &std::path::Path) -> String {
    printable(&p.display().to_string()).into_owned()
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
}
