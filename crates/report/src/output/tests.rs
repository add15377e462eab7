//! The board against hostile submitters: folder names, plugin names and
//! result strings chosen to forge rows, run scripts or leave the board's
//! folder; copies of one bundle; bundles that do not verify. The bundles
//! are copies of a real verified one (results/h100/submissions/1.2), edited
//! the way a submitter could; `verify` runs as `harness report` runs it,
//! with an `inspect` that says each artifact is the plugin its result names
//! (what the real plugin loader would read from an artifact built so).

use std::path::{Path, PathBuf};

use super::*;
use crate::inputs::{self, load};
use crate::submission::{sha256_hex, MANIFEST, RESULT};
use crate::test_support::copy_dir;
use harness_format::plugin::{Kind, Manifest as PluginManifest, Transport};
use harness_format::results::{EntryStatus, NcclRecord};

/// Forges a rank-1 row, runs a script, links out, and reorders what follows.
const FORGE: &str = "x\r\n| 1 | forged | 9.99 |\n<script>alert(1)</script>`](javascript:alert(2))\u{202e}|";

fn real_bundle() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../results/h100/submissions/1.2/compression-topk.bundle")
}

/// Says each artifact is the plugin that the result of one of `bundles`
/// names for its sha256 (verify hands the inspector a component's bytes
/// only).
fn inspector(bundles: &[PathBuf]) -> impl Fn(&[u8]) -> anyhow::Result<PluginManifest> {
    // Bundles given, and those in folders given.
    let dirs: Vec<PathBuf> = bundles
        .iter()
        .flat_map(|p| match crate::submission::is_bundle(p) {
            true => vec![p.clone()],
            false => {
                let mut d: Vec<PathBuf> = std::fs::read_dir(p).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
                d.sort();
                d
            }
        })
        .collect();
    // Of bundles that name one artifact differently, the first given (in
    // name order) says what it is.
    let mut named: std::collections::HashMap<String, harness_format::results::EnteredPlugin> = std::collections::HashMap::new();
    for p in dirs
        .iter()
        .filter_map(|b| harness_format::results::RunResult::read(&b.join(RESULT)).ok())
        .filter_map(|r| r.submission.and_then(|s| s.entered.into_iter().next()))
    {
        named.entry(p.sha256.clone()).or_insert(p);
    }
    move |bytes: &[u8]| {
        let sha = sha256_hex(bytes);
        let p = named.get(&sha).ok_or_else(|| anyhow::anyhow!("no bundle names the artifact {sha}"))?;
        let kind = [Kind::Compressor, Kind::BatchPolicy, Kind::CheckpointPolicy].into_iter().find(|k| k.name() == p.kind).unwrap();
        Ok(PluginManifest {
            name: p.name.clone(),
            version: p.version.clone(),
            kind,
            transport: Transport::Wasm,
            abi: "0.1.1".into(),
            sha256: sha,
            path: PathBuf::new(),
        })
    }
}

/// Edits a bundle's result.json; with `rehash`, also its manifest's entry
/// for it (as a submitter would, so the bundle still verifies).
fn edit_result(bundle: &Path, rehash: bool, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut r: serde_json::Value = serde_json::from_slice(&std::fs::read(bundle.join(RESULT)).unwrap()).unwrap();
    edit(&mut r);
    let bytes = serde_json::to_vec_pretty(&r).unwrap();
    std::fs::write(bundle.join(RESULT), &bytes).unwrap();
    if rehash {
        edit_manifest(bundle, |m| {
            let f = m["files"].as_array_mut().unwrap().iter_mut().find(|f| f["path"] == RESULT).unwrap();
            f["sha256"] = sha256_hex(&bytes).into();
            f["bytes"] = bytes.len().into();
        });
    }
}

fn edit_manifest(bundle: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(bundle.join(MANIFEST)).unwrap()).unwrap();
    edit(&mut m);
    std::fs::write(bundle.join(MANIFEST), serde_json::to_vec_pretty(&m).unwrap()).unwrap();
}

/// The plugin's own name, as the artifact declares it: the bundle still
/// verifies.
fn rename_plugin(bundle: &Path, name: &str) {
    edit_result(bundle, true, |r| {
        r["submission"]["entered"][0]["name"] = name.into();
        // Every entry that ran it records it under that name too.
        for e in r["entries"].as_array_mut().unwrap() {
            for p in e["metrics"]["plugins"].as_array_mut().into_iter().flatten() {
                if p["name"] == "topk" {
                    p["name"] = name.into();
                }
            }
        }
    });
    edit_manifest(bundle, |m| m["plugins"][0]["name"] = name.into());
}

/// The operator's records that reproduced each verified bundle, its own
/// result as the rerun.
fn vouched(loaded: &inputs::Loaded) -> Vec<crate::reproduction::Reproduced> {
    loaded
        .bundles
        .iter()
        .filter(|v| v.verdict.verified())
        .map(|v| crate::reproduction::Reproduced::vouching(&v.bundle.result, v.bundle.result.clone(), true))
        .collect()
}

/// The board of `paths`, every verified bundle reproduced by the operator.
fn report(paths: &[PathBuf], out: &Path) -> (inputs::Loaded, String, String) {
    let loaded = load(paths, &inspector(paths)).unwrap();
    write(out, &loaded, &vouched(&loaded)).unwrap();
    let md = std::fs::read_to_string(out.join("LEADERBOARD.md")).unwrap();
    let html = std::fs::read_to_string(out.join("index.html")).unwrap();
    (loaded, md, html)
}

/// Every `href` of the page.
fn hrefs(html: &str) -> Vec<String> {
    html.match_indices("href=")
        .map(|(i, _)| {
            let rest = &html[i + 5..];
            let q = rest.chars().next().unwrap();
            assert_eq!(q, '"', "an href without quotes at {}", &html[i..i + 40]);
            rest[1..rest[1..].find('"').unwrap() + 1].to_owned()
        })
        .collect()
}

/// The target of every Markdown link (a `](` whose `]` no backslash
/// escapes).
fn md_links(md: &str) -> Vec<String> {
    md.match_indices("](")
        .filter(|(i, _)| md[..*i].chars().rev().take_while(|&c| c == '\\').count() % 2 == 0)
        .map(|(i, _)| md[i + 2..].split(')').next().unwrap().to_owned())
        .collect()
}

/// Every link stays in the board's folder and names a file that is there:
/// a table of the page, or a bundle's copy under bundles/<hex>/.
fn assert_links_stay_inside(out: &Path, md: &str, html: &str) {
    let copy = |href: &str| {
        let parts: Vec<&str> = href.split('/').collect();
        assert!(
            parts.len() == 3
                && parts[0] == "bundles"
                && parts[1].len() >= 16
                && parts[1].chars().all(|c| c.is_ascii_hexdigit())
                && [RESULT, MANIFEST, "index.html"].contains(&parts[2]),
            "a link out of the board's folder: {href}"
        );
        assert!(out.join(href).is_file(), "{href} links to nothing");
    };
    for h in hrefs(html) {
        match h.strip_prefix("#board-").or_else(|| h.strip_prefix("#track-")) {
            Some(n) => assert!(n.parse::<usize>().is_ok() && html.contains(&format!("id=\"{}\"", &h[1..])), "{h}"),
            None => copy(&h),
        }
    }
    // Each submission's page links only beside itself and back to the board.
    for page in std::fs::read_dir(out.join("bundles")).into_iter().flatten().flatten().map(|d| d.path().join("index.html")) {
        let Ok(text) = std::fs::read_to_string(&page) else { continue };
        for h in hrefs(&text) {
            let back = h.strip_prefix("../../").unwrap_or_else(|| panic!("{}: a link out of the board: {h}", page.display()));
            match back.split_once('#') {
                Some(("index.html", anchor)) => assert!(html.contains(&format!("id=\"{anchor}\"")), "{h}"),
                _ if back == "index.html" => {}
                _ => copy(back),
            }
        }
        assert!(!text.contains("<script") && !text.contains("src="), "{}", page.display());
    }
    for l in md_links(md) {
        copy(&l);
    }
    assert!(!html.contains("src="), "the page loads nothing");
}

/// Text that comes from outside appears in the page only as text: after a
/// `>` with no `<` since.
fn assert_only_text(html: &str, needle: &str) {
    for (i, _) in html.match_indices(needle) {
        assert!(html[..i].rfind('>') > html[..i].rfind('<'), "{needle} inside a tag: {}", &html[i.saturating_sub(80)..i + needle.len()]);
    }
}

/// The Markdown's tables: (header cells, each row's cells), counting the
/// pipes no backslash escapes.
fn md_tables(md: &str) -> Vec<(usize, Vec<usize>)> {
    let cells = |l: &str| {
        let b = l.as_bytes();
        (0..b.len()).filter(|&i| b[i] == b'|' && b[..i].iter().rev().take_while(|&&c| c == b'\\').count() % 2 == 0).count() - 1
    };
    let mut out: Vec<(usize, Vec<usize>)> = Vec::new();
    let mut inside = false;
    for l in md.lines() {
        match (l.starts_with('|'), inside) {
            (true, false) => out.push((cells(l), Vec::new())),
            (true, true) if !l.starts_with("| ---") && !l.starts_with("|---") => out.last_mut().unwrap().1.push(cells(l)),
            _ => {}
        }
        inside = l.starts_with('|');
    }
    out
}

#[test]
fn the_real_bundle_verifies_with_the_fake_inspect() {
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&real_bundle(), &tmp.path().join("r.bundle"));
    let b = tmp.path().join("r.bundle");
    let v = crate::submission::verify::verify(&b, &inspector(std::slice::from_ref(&b)));
    assert!(v.verified(), "{:?}", v.violations);
}

#[test]
fn a_javascript_folder_name_is_text_and_every_link_stays_in_the_board() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("in");
    let name = "javascript:alert(document.cookie)\"'<b>.bundle";
    copy_dir(&real_bundle(), &dir.join(name));
    let out = tmp.path().join("board");
    let (loaded, md, html) = report(std::slice::from_ref(&dir), &out);
    assert_eq!(loaded.bundles.len(), 1);
    assert!(loaded.bundles[0].ranks(), "{:?}", loaded.bundles[0].verdict.violations);
    assert_links_stay_inside(&out, &md, &html);
    assert!(!hrefs(&html).iter().any(|h| h.contains("javascript:")));
    assert_only_text(&html, "javascript:");
    assert!(html.contains("javascript:alert(document.cookie)&quot;&#39;&lt;b&gt;.bundle"), "the folder is shown as text");
    assert!(md.contains("javascript:alert(document.cookie)\"'&lt;b&gt;.bundle"), "{md}");
    // The copies are the bundle's files, in a folder named by its content.
    let id = inputs::content_id(&loaded.bundles[0].bundle.manifest);
    for f in [RESULT, MANIFEST] {
        let copy = out.join("bundles").join(&id[..16]).join(f);
        assert_eq!(std::fs::read(&copy).unwrap(), std::fs::read(dir.join(name).join(f)).unwrap(), "{f}");
    }
    assert!(html.contains(&format!("href=\"bundles/{}/result.json\"", &id[..16])));
}

#[test]
fn a_plugin_name_cannot_forge_a_row_or_carry_a_script() {
    let tmp = tempfile::tempdir().unwrap();
    let b = tmp.path().join("r.bundle");
    copy_dir(&real_bundle(), &b);
    rename_plugin(&b, FORGE);
    let out = tmp.path().join("board");
    let (loaded, md, html) = report(&[b], &out);
    assert!(loaded.bundles[0].ranks(), "the plugin's own name breaks no rule: {:?}", loaded.bundles[0].verdict.violations);

    // Two workloads' tables (the baseline and the renamed submission
    // strategy) and the track's table (the submission and the reference),
    // every row as wide as its header.
    let tables = md_tables(&md);
    assert_eq!(tables.iter().map(|t| t.1.len()).collect::<Vec<_>>(), [2, 2, 2], "{md}");
    for (header, rows) in &tables {
        assert!(rows.iter().all(|r| r == header), "{header} cells, rows {rows:?}:\n{md}");
    }
    assert!(!md.lines().any(|l| l.starts_with("| 1 | forged")), "{md}");
    assert!(md.lines().filter(|l| l.contains("forged")).all(|l| l.contains("0.1.0")), "the name stays on its own line:\n{md}");
    assert!(!md.contains("<script>") && !md.contains('\u{202e}') && !md.contains('\r'), "{md}");
    let ranked = md.lines().find(|l| l.starts_with("| 1 | x ")).expect("the plugin ranked first on its track");
    assert!(
        ranked
            .contains("x  \\| 1 \\| forged \\| 9.99 \\| &lt;script&gt;alert(1)&lt;/script&gt;\\`\\](javascript:alert(2))\u{fffd}\\| 0.1.0"),
        "{ranked}"
    );

    // The page: one script, its own; rows as many as in the Markdown.
    assert_eq!(html.matches("<script").count(), 1);
    assert_eq!(html.matches("<tr").count(), 3 + 3 + 3, "a header and two rows per table");
    assert!(html.contains("x\r\n| 1 | forged | 9.99 |\n&lt;script&gt;alert(1)&lt;/script&gt;`](javascript:alert(2))\u{fffd}| 0.1.0"));
    assert_only_text(&html, "javascript:");
    assert_links_stay_inside(&out, &md, &html);
}

#[test]
fn one_bundle_under_four_folder_names_is_ranked_once() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("in");
    for name in ["a.bundle", "b.bundle", "c.bundle", "d.bundle"] {
        copy_dir(&real_bundle(), &dir.join(name));
    }
    // A manifest written at another time holds the same content.
    edit_manifest(&dir.join("c.bundle"), |m| m["created_at"] = "2027-01-01T00:00:00Z".into());
    let out = tmp.path().join("board");
    let (loaded, md, html) = report(std::slice::from_ref(&dir), &out);
    assert_eq!(loaded.bundles.len(), 4);
    assert!(loaded.bundles.iter().all(|v| v.verdict.verified()));
    assert_eq!(loaded.bundles.iter().filter(|v| v.ranks()).count(), 1);
    for v in &loaded.bundles[1..] {
        assert_eq!(v.same_as.as_deref(), Some(dir.join("a.bundle").as_path()));
        assert_eq!(v.files.folder, loaded.bundles[0].files.folder);
    }
    // One row on the track, and the per-workload tables pool its repeats once.
    let subs = crate::submissions::boards(&loaded.bundles, &vouched(&loaded));
    assert_eq!(subs.len(), 1);
    assert_eq!(subs[0].rows.iter().filter(|r| r.rank.is_some()).count(), 1);
    let original = &loaded.bundles[0].bundle.result;
    let per_workload = |w: &str| original.entries.iter().filter(|e| e.workload == w && e.strategy.starts_with("submission-")).count();
    let boards = crate::boards(&loaded.results);
    for b in &boards {
        let row = b.rows.iter().find(|r| r.group.strategy.ends_with("[submission-compression]")).unwrap();
        assert_eq!(row.group.runs.len(), per_workload(&b.workload), "{}", b.workload);
    }
    assert_eq!(md.lines().filter(|l| l.starts_with("| 1 | topk 0.1.0 |")).count(), 1, "ranked once on the track:\n{md}");
    assert_eq!(md.lines().filter(|l| l.starts_with("- ") && l.contains("same content as")).count(), 3, "{md}");
    assert!(md.contains(&format!("same content as {}, ranked as that one", dir.join("a.bundle").display())), "{md}");
    assert_eq!(html.matches("same content as").count(), 3);
    assert_eq!(std::fs::read_dir(out.join("bundles")).unwrap().count(), 1, "one copy of one content");
    assert_links_stay_inside(&out, &md, &html);
}

#[test]
fn an_unverified_bundle_is_in_no_table_and_listed_apart_with_its_reasons() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("in");
    copy_dir(&real_bundle(), &dir.join("good.bundle"));
    // The result edited after bundling, the manifest left as it was: its
    // content claims to be good.bundle's.
    copy_dir(&real_bundle(), &dir.join("tampered.bundle"));
    edit_result(&dir.join("tampered.bundle"), false, |r| {
        r["submission"]["entered"][0]["name"] = "evil<script>x</script>".into();
        r["submission"]["entered"][0]["version"] = "6.6.6".into();
    });
    let out = tmp.path().join("board");
    let (loaded, md, html) = report(std::slice::from_ref(&dir), &out);
    let tampered = &loaded.bundles[1];
    assert!(!tampered.verdict.verified() && !tampered.ranks() && tampered.same_as.is_none());
    assert_eq!(inputs::content_id(&tampered.bundle.manifest), loaded.bundles[0].id, "it claims good.bundle's content");
    assert_ne!(tampered.files.folder, loaded.bundles[0].files.folder, "but keeps its copies apart");
    assert_eq!(loaded.results.len(), 1, "only the verified bundle's result joins the tables");

    // In no table of either output.
    let boards = crate::boards(&loaded.results);
    assert!(boards.iter().all(|b| b.rows.iter().all(|r| !r.group.strategy.contains("evil") && !r.group.strategy.contains("6.6.6"))));
    assert!(md.lines().filter(|l| l.starts_with('|')).all(|l| !l.contains("evil") && !l.contains("6.6.6")), "{md}");
    let tables: String = html.split("<table>").skip(1).map(|t| t.split("</table>").next().unwrap()).collect();
    assert!(!tables.contains("evil") && !tables.contains("6.6.6"));
    // Listed apart, with verify's reason, escaped.
    let line = md.lines().find(|l| l.contains("tampered.bundle")).unwrap();
    assert!(line.starts_with("- ") && md.find("### Not ranked") < md.find(line), "{md}");
    assert!(line.contains("evil&lt;script&gt;x&lt;/script&gt; 6.6.6"), "{line}");
    assert!(line.contains("not verified: files: result.json "), "{line}");
    assert!(!md.contains("<script>") && html.matches("<script").count() == 1);
    assert!(html.contains("evil&lt;script&gt;x&lt;/script&gt; 6.6.6") && html.contains("not verified: files: result.json "));
    // The verified bundle's copy is its own result, not the tampered one.
    let good = out.join("bundles").join(&loaded.bundles[0].files.folder).join(RESULT);
    assert_eq!(std::fs::read(good).unwrap(), std::fs::read(dir.join("good.bundle").join(RESULT)).unwrap());
    let bad = out.join("bundles").join(&tampered.files.folder).join(RESULT);
    assert_eq!(std::fs::read(bad).unwrap(), std::fs::read(dir.join("tampered.bundle").join(RESULT)).unwrap());
    assert_links_stay_inside(&out, &md, &html);
}

#[test]
fn every_string_of_a_result_file_is_escaped_in_both_outputs() {
    let mut r = harness_format::results::testing::result("s", None, 100.0);
    r.suite.name = FORGE.into();
    r.suite.text = format!("[suite]\nversion = {}\n", toml::Value::String(FORGE.into()));
    assert_eq!(crate::suite_version(&r).as_deref(), Some(FORGE));
    let e = &mut r.entries[0];
    (e.workload, e.strategy, e.device) = (FORGE.into(), FORGE.into(), FORGE.into());
    e.metrics.as_mut().unwrap().nccl = Some(NcclRecord {
        version: Some(FORGE.into()),
        settings: [(FORGE.to_owned(), FORGE.to_owned())].into(),
        transports: vec![FORGE.into()],
        note: None,
    });
    let mut failed = r.entries[0].clone();
    failed.status = EntryStatus::Failed { error: FORGE.into(), kind: Some(FORGE.into()) };
    failed.metrics = None;
    r.entries.push(failed);
    r.switches = [("HARNESS_X".to_owned(), FORGE.to_owned())].into();
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join(format!("{}.json", "javascript:alert(1)<i>"));
    std::fs::write(&file, serde_json::to_vec(&r).unwrap()).unwrap();
    let out = tmp.path().join("board");
    let (_, md, html) = report(&[file], &out);

    let tables = md_tables(&md);
    assert_eq!(tables.len(), 1, "{md}");
    assert_eq!(tables[0].1, [tables[0].0], "one row, as wide as the header:\n{md}");
    assert!(!md.lines().any(|l| l.starts_with("| 1 | forged")));
    assert!(!md.contains("<script>") && !md.contains("<i>") && !md.contains('\r') && !md.contains('\u{202e}'), "{md}");
    assert!(md_links(&md).is_empty(), "{md}");
    // Each line that shows the string shows all of it, escaped.
    let escaped = crate::escape::md(FORGE);
    for l in md.lines().filter(|l| l.contains("forged")) {
        assert!(l.contains(&escaped), "{l}");
    }
    assert_eq!(html.matches("<script").count(), 1);
    assert!(!html.contains("<i>") && !html.contains('\u{202e}'));
    assert_only_text(&html, "javascript:");
    assert_only_text(&html, "forged");
    assert!(hrefs(&html).is_empty(), "no bundles, no links");
}

/// The committed bundles of one GPU class (of one suite version, when
/// given), as `harness report` is given them.
fn committed_bundles(class: &str, version: Option<&str>) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../results").join(class).join("submissions");
    let mut out: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .flatten()
        // Suite versions' folders ("1.2"), not the board's copies in bundles/.
        .filter(|d| d.file_name().to_string_lossy().starts_with(|c: char| c.is_ascii_digit()))
        .filter(|d| version.is_none_or(|v| d.file_name() == v))
        .flat_map(|d| std::fs::read_dir(d.path()).into_iter().flatten().flatten().map(|e| e.path()))
        .filter(|p| crate::submission::is_bundle(p))
        .collect();
    out.sort();
    out
}

/// The boards of the committed H100 and H200 bundles, and of the H100's
/// suite version 1.2 alone (its compression tracks, docs/leaderboard.png):
/// every bundle ranks, and every page is written. With `BOARD_OUT` set,
/// the boards are written into `$BOARD_OUT/h100`, `h200` and
/// `h100-1.2` to be looked at (scripts/board-screenshots.sh).
#[test]
fn the_committed_bundles_make_boards_where_every_bundle_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let root = std::env::var_os("BOARD_OUT").map_or_else(|| tmp.path().to_owned(), PathBuf::from);
    for (class, version, name) in [("h100", None, "h100"), ("h200", None, "h200"), ("h100", Some("1.2"), "h100-1.2")] {
        let bundles = committed_bundles(class, version);
        assert!(bundles.len() >= 3, "{name}: {bundles:?}");
        let out = root.join(name);
        let (loaded, md, html) = report(&bundles, &out);
        for v in &loaded.bundles {
            assert!(v.ranks(), "{}: {:?}", v.bundle.dir.display(), v.verdict.violations);
            assert!(out.join("bundles").join(&v.files.folder).join("index.html").is_file());
        }
        assert!(html.contains("class=\"plot forest\"") && html.contains("class=\"plot profile\""));
        assert_links_stay_inside(&out, &md, &html);
    }
}

/// Issue 60: "Once per content is easy to evade. Appending a line to
/// run.log, adding a file to the manifest, or an unknown field in
/// result.json makes a new identity: one run ranked 3 times, 300 copies
/// gave 300 rows." The real bundle, and copies of it with each of those
/// (the manifest rehashed), given to the board: the field is refused by
/// verify, the others are one row whose repeats are the run's, once.
#[test]
fn one_run_in_bundles_with_bytes_added_is_one_row_with_its_repeats_once() {
    use crate::submission::{sha256_hex, LOG, MANIFEST, RESULT};
    let real = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../results/h100/submissions/1.2/compression-topk.bundle");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("in");
    let json = |p: &Path| -> serde_json::Value { serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap() };
    // Adds `rel` with `bytes` (over any such file) and rehashes the manifest.
    let put = |bundle: &Path, rel: &str, bytes: &[u8]| {
        std::fs::write(bundle.join(rel), bytes).unwrap();
        let mut m = json(&bundle.join(MANIFEST));
        let files = m["files"].as_array_mut().unwrap();
        let entry = serde_json::json!({"path": rel, "sha256": sha256_hex(bytes), "bytes": bytes.len()});
        match files.iter_mut().find(|f| f["path"] == rel) {
            Some(f) => *f = entry,
            None => files.push(entry),
        }
        std::fs::write(bundle.join(MANIFEST), serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    };
    for name in ["a.bundle", "log.bundle", "file.bundle", "field.bundle"] {
        crate::test_support::copy_dir(&real, &dir.join(name));
    }
    let mut log = std::fs::read(real.join(LOG)).unwrap();
    log.extend_from_slice(b"rerun for the leaderboard\n");
    put(&dir.join("log.bundle"), LOG, &log);
    put(&dir.join("file.bundle"), "NOTES.txt", b"a file harness submit never writes\n");
    let mut r = json(&real.join(RESULT));
    r["resubmitted"] = true.into();
    put(&dir.join("field.bundle"), RESULT, &serde_json::to_vec_pretty(&r).unwrap());

    let inspect = crate::test_support::inspect_as("topk", "0.1.0");
    let loaded = crate::inputs::load(std::slice::from_ref(&dir), &inspect).unwrap();
    let verified: Vec<String> = loaded
        .bundles
        .iter()
        .filter(|v| v.verdict.verified())
        .map(|v| v.bundle.dir.file_name().unwrap().to_string_lossy().into())
        .collect();
    assert_eq!(verified, ["a.bundle", "file.bundle", "log.bundle"]);
    let field = loaded.bundles.iter().find(|v| v.bundle.dir.ends_with("field.bundle")).unwrap();
    assert!(field.verdict.reasons().iter().any(|r| r.contains("`resubmitted`")), "{:?}", field.verdict.reasons());

    let subs = crate::submissions::boards(&loaded.bundles, &[]);
    assert_eq!(subs.len(), 1);
    let rows: Vec<&crate::submissions::SubRow> = subs[0].rows.iter().filter(|r| !r.reference).collect();
    assert_eq!(rows.len(), 1, "one run, one row");
    assert_eq!(rows[0].bundle, dir.join("a.bundle"), "the first given");
    let original = &loaded.bundles[0].bundle.result;
    for (w, s) in subs[0].workloads.iter().zip(&rows[0].ratios) {
        let repeats = original.entries.iter().filter(|e| &e.workload == w && e.strategy == "submission-compression").count();
        assert_eq!(repeats, 3);
        assert_eq!(s.as_ref().unwrap().n, repeats, "{w}: the run's repeats, each once, not once per bundle");
    }
    let md = crate::submissions::markdown(&subs, &loaded.bundles);
    assert_eq!(md.lines().filter(|l| l.starts_with("| - | topk 0.1.0")).count(), 1, "shown once, self-reported: {md}");
}
