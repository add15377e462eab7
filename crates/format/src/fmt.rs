//! Short forms of numbers and hashes for console lines and tables.

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
