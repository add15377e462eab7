//! What `harness report` writes into its folder: `LEADERBOARD.md`,
//! `index.html`, and `bundles/<folder>/` with each listed bundle's
//! `result.json` and `MANIFEST.json` ([`crate::submissions::Files`]), which
//! the two link to, and each ranked bundle's own page (`index.html`). Nothing links anywhere else: not to the bundles' own
//! folders, whose names their submitters chose.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::inputs::Loaded;
use crate::submissions;
use crate::{html, Board};
use harness_format::results::write_atomic;

/// What [`write()`] wrote.
pub struct Written {
    pub leaderboard: PathBuf,
    pub page: PathBuf,
    /// The per-workload tables.
    pub boards: Vec<Board>,
    /// The submission tables.
    pub submission_boards: usize,
}

/// Scores what was loaded, with the operator's reproductions (`operator`,
/// checked: [`crate::reproduction::load_signed`]), and writes the board
/// into `out_dir` (created if needed): the bundles' copies first, then `LEADERBOARD.md` and
/// `index.html`, each replaced atomically.
pub fn write(out_dir: &Path, loaded: &Loaded, operator: &[crate::reproduction::Reproduced]) -> Result<Written> {
    let boards = crate::boards(&loaded.results);
    let subs = submissions::boards(&loaded.bundles, operator);
    copy_bundles(out_dir, loaded)?;
    for v in loaded.bundles.iter().filter(|v| v.ranks() && !v.files.links().is_empty()) {
        let page = html::submission_page::page(v, &subs);
        write_atomic(&out_dir.join(submissions::BUNDLES).join(&v.files.folder).join("index.html"), page.as_bytes())?;
    }
    let mut md = crate::leaderboard_markdown(&boards, &loaded.sources);
    if !loaded.bundles.is_empty() {
        md.push('\n');
        md.push_str(&submissions::markdown(&subs, &loaded.bundles));
    }
    // Projections (a suite's `[projection]`): a section of their own,
    // never rows of a board.
    let projections = crate::project::suite::of_results(&loaded.results, &loaded.sources);
    md.push_str(&crate::project::suite::markdown(&projections));
    let page = html::page_with(&boards, &subs, &loaded.bundles, &loaded.sources, &projections);
    let (md_path, html_path) = (out_dir.join("LEADERBOARD.md"), out_dir.join("index.html"));
    write_atomic(&md_path, md.as_bytes())?;
    write_atomic(&html_path, page.as_bytes())?;
    Ok(Written { leaderboard: md_path, page: html_path, boards, submission_boards: subs.len() })
}

/// Writes each bundle's copied files into `bundles/<folder>/`; a folder
/// shared by several bundles (copies of one content) is written once, by
/// the first. Copies from an earlier report stay where they were and are
/// replaced when written again.
fn copy_bundles(out_dir: &Path, loaded: &Loaded) -> Result<()> {
    let mut written = BTreeSet::new();
    for v in &loaded.bundles {
        let links = v.files.links();
        if links.is_empty() || !written.insert(v.files.folder.clone()) {
            continue;
        }
        for ((_, href), bytes) in links.iter().zip(&v.copies) {
            write_atomic(&out_dir.join(href), bytes)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
