//! Escaping for what `harness report` writes. Every string read from a
//! result file or a bundle is the submitter's to choose: suite, workload,
//! strategy and device names, suite versions, plugin names, versions and
//! hashes, switches, NCCL lines, errors, `harness verify`'s reasons (which
//! quote all of these) and the bundles' folder names. Such a string reaches
//! the Markdown only through [`md`] or [`md_code`], the HTML page only
//! through [`html`] (or [`Markup`], which picks one of them), and is never
//! written into a link: the report's links are built from hex digits and
//! its own names alone.

pub use harness_format::fmt::terminal;
use harness_format::fmt::unseen;

/// `s` as HTML text or as an attribute value (between double or single
/// quotes): `& < > " '` become entities, unseen characters (other than
/// tab and line breaks, which HTML shows as spaces) become U+FFFD.
pub fn html(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            '\t' | '\n' | '\r' => out.push(c),
            c if unseen(c) => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

/// `s` as Markdown text that reads as itself anywhere on one line of the
/// leaderboard, table cells included: line breaks and tabs become spaces
/// (no new row, line or block can start), other unseen characters U+FFFD,
/// `& < >` entities (no HTML tag, raw `<script>` included, and no
/// autolink), and the characters Markdown gives a meaning inline are
/// backslash-escaped: `\`, `` ` `` (no code span), `*`, `_`, `~` (no
/// emphasis), `[`, `]` (no link or image), `|` (no table cell; GitHub's
/// table parser pairs a backslash with the next punctuation, so `\` is
/// escaped too and the pipe's own backslash is never taken by another),
/// `$` (no math).
pub fn md(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '\\' | '`' | '*' | '_' | '~' | '[' | ']' | '|' | '$' => {
                out.push('\\');
                out.push(c);
            }
            '\t' | '\n' | '\r' => out.push(' '),
            c if unseen(c) => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

/// `s` as inline code in the Markdown: a code span when `s` holds none of
/// the characters a code span cannot hold safely (a backtick would end the
/// span, a pipe the table cell, `<`, `>` and `&` would be shown raw or not
/// at all, an unseen character would not be seen), else `<code>` around
/// [`md`]`(s)`, which GitHub shows the same way. No backtick in `s` can
/// ever end a code span this writes.
pub fn md_code(s: &str) -> String {
    let plain = |c: char| !unseen(c) && !matches!(c, '`' | '|' | '\\' | '<' | '>' | '&');
    // A span that starts and ends with a space loses one of each.
    let trimmed = s.starts_with(' ') && s.ends_with(' ');
    if !s.is_empty() && !trimmed && s.chars().all(plain) {
        format!("`{s}`")
    } else {
        format!("<code>{}</code>", md(s))
    }
}

/// One of the two outputs, for what both write alike (a title with a name
/// in it): text and inline code, escaped for that output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Markup {
    Markdown,
    Html,
}

impl Markup {
    /// `s` as text: [`md`] or [`html`].
    pub fn text(self, s: &str) -> String {
        match self {
            Markup::Markdown => md(s),
            Markup::Html => html(s),
        }
    }

    /// `s` as inline code: [`md_code`], or `<code>` around [`html`].
    pub fn code(self, s: &str) -> String {
        match self {
            Markup::Markdown => md_code(s),
            Markup::Html => format!("<code>{}</code>", html(s)),
        }
    }
}

/// `s`, a sentence that quotes names in backticks, as HTML: each piece
/// escaped, the quoted ones in `<code>` (a backtick left unpaired stays a
/// backtick). The tags are this function's own, so always balanced.
pub fn code_spans(s: &str) -> String {
    let pieces: Vec<&str> = s.split('`').collect();
    if pieces.len() % 2 == 0 {
        return html(s);
    }
    pieces.iter().enumerate().map(|(i, p)| if i % 2 == 1 { format!("<code>{}</code>", html(p)) } else { html(p) }).collect()
}

/// The first 12 characters of a hash (whole characters, whatever the
/// string holds).
pub fn short(sha: &str) -> &str {
    sha.char_indices().nth(12).map_or(sha, |(i, _)| &sha[..i])
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOSTILE: &str = "a\r\n| 1 | forged |`x`<script>alert(1)</script>&amp;\\|\u{202e}\u{0}\"'[l](javascript:x)";

    #[test]
    fn html_leaves_no_tag_attribute_end_or_unseen_character() {
        let e = html(HOSTILE);
        assert!(!e.contains(['<', '>', '"', '\'', '\u{202e}', '\u{0}']), "{e}");
        assert!(e.contains("&lt;script&gt;") && e.contains("&amp;amp;") && e.contains("&quot;&#39;"), "{e}");
        assert_eq!(html("plain name-1.0 (abc)"), "plain name-1.0 (abc)");
    }

    #[test]
    fn markdown_text_stays_on_its_line_and_in_its_cell() {
        let e = md(HOSTILE);
        assert!(!e.contains(['\r', '\n', '<', '>', '\u{202e}', '\u{0}']), "{e}");
        // Every pipe and backtick is escaped by a backslash of its own: the
        // run of backslashes before it is odd.
        for (i, c) in e.char_indices().filter(|(_, c)| matches!(c, '|' | '`' | '[')) {
            let run = e[..i].chars().rev().take_while(|&b| b == '\\').count();
            assert_eq!(run % 2, 1, "{c} at {i} of {e}");
        }
        assert_eq!(md("topk 0.1.0 (c4b8bc5d3ce2)"), "topk 0.1.0 (c4b8bc5d3ce2)");
    }

    #[test]
    fn code_spans_cannot_be_left_by_backticks() {
        assert_eq!(md_code("allreduce"), "`allreduce`");
        assert_eq!(md_code("HARNESS_FUSED_MLP=0, HARNESS_OVERLAP=0"), "`HARNESS_FUSED_MLP=0, HARNESS_OVERLAP=0`");
        for s in ["a`b", "``", "`", "x|y", "<script>", " spaced ", "", "a\nb", "\\"] {
            let e = md_code(s);
            assert!(e.starts_with("<code>") && e.ends_with("</code>"), "{s:?} -> {e}");
            let inner = &e["<code>".len()..e.len() - "</code>".len()];
            assert_eq!(inner, md(s));
        }
        assert_eq!(Markup::Html.code("a<b"), "<code>a&lt;b</code>");
        assert_eq!(Markup::Markdown.text("a|b"), "a\\|b");
    }

    #[test]
    fn terminal_text_carries_no_escape_sequence() {
        assert_eq!(terminal("a\u{1b}[31mb\u{202e}"), "a\u{fffd}[31mb\u{fffd}");
    }
}
