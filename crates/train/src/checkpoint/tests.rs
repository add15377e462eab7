use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::Result;
use harness_format::secrets::Key;
use sha2::{Digest, Sha256};
use tch::{Device, Kind, Tensor};

use super::confined::Dir;
use super::manifest::{read_record, FileRecord, Manifest, Seal};
use super::read::{read_file_into, DIRECT_ALIGN};
use super::write::{tree_digest, write_tensors};
use super::*;

/// The key the stores of these tests seal with.
pub(super) fn key() -> Key {
    super::manifest::user_key().expect("the tests' key")
}

fn snap(step: u64, v: f32) -> Snapshot {
    Snapshot {
        position: Position { step, data_position: step * 4, micro_batch: 4, accum_steps: 1, lr_scale: 1.0 },
        model: vec![("w".into(), Tensor::from_slice(&[v, v + 1.0]))],
        state: vec![("optimizer/exp_avg.0".into(), Tensor::from_slice(&[v * 2.0]))],
        plugins: vec![("compressor".into(), vec![1, 2, 3]), ("batch".into(), vec![])],
        ready: None,
    }
}

/// The run the stores of these tests belong to, as entry `entry`.
fn run(entry: &str) -> RunIdentity {
    RunIdentity {
        suite_sha256: "ab".repeat(32),
        entry: entry.into(),
        seed: 7,
        world_size: 1,
        steps: Some(300),
        plugins: [("compressor".to_owned(), "cd".repeat(32))].into(),
        shards: String::new(),
    }
}

/// What the stores of these tests accept: [`snap`]'s tensors, the
/// fixed batch 4 x 1 and 300 steps.
fn accept() -> Accept {
    Accept { layout: Layout::of(&snap(0, 0.0)), bounds: Bounds::fixed(4, 1, Some(300)) }
}

/// A store of entry `w/a/r0` in `root`.
fn store(root: &Path, compress: bool) -> Store {
    Store::open(root, 0, 1, compress, false).unwrap().for_run(run("w/a/r0"), accept()).unwrap()
}

#[test]
fn a_checkpoint_reads_back_what_was_written_and_damage_is_found() {
    for compress in [false, true] {
        let d = tempfile::tempdir().unwrap();
        let s = store(d.path(), compress);
        s.write_part(&snap(10, 1.5)).unwrap();
        let dir = s.commit(snap(10, 1.5).position).unwrap();
        assert_eq!(verify(&dir).unwrap().step, 10);
        let back = s.read(10).unwrap();
        assert_eq!(back.position, snap(10, 1.5).position);
        assert_eq!(Vec::<f32>::try_from(&back.model[0].1).unwrap(), vec![1.5, 2.5]);
        assert_eq!(back.plugin("compressor"), Some(&[1u8, 2, 3][..]));
        assert_eq!(back.plugin("batch"), Some(&[][..]));
        assert_eq!(list(d.path()).iter().map(|c| c.0).collect::<Vec<_>>(), vec![10]);

        // A flipped byte is reported, naming the file.
        let f = dir.join(format!("model{}", s.ext()));
        let mut b = fs::read(&f).unwrap();
        let last = b.len() - 1;
        b[last] ^= 1;
        fs::write(&f, b).unwrap();
        let e = format!("{:#}", verify(&dir).unwrap_err());
        assert!(e.contains("is damaged"), "{e}");
        assert!(s.read(10).is_err());
    }
}

#[test]
fn reads_into_snapshot_buffers_land_in_their_memory_and_find_damage() {
    let d = tempfile::tempdir().unwrap();
    let s = store(d.path(), false);
    s.write_part(&snap(10, 1.5)).unwrap();
    let dir = s.commit(snap(10, 1.5).position).unwrap();
    let mut buffers = snap(0, 0.0);
    buffers.plugins.clear();
    let back = s.read_into(10, &mut buffers).unwrap();
    assert_eq!(back.position, snap(10, 1.5).position);
    // Straight into the buffers' memory, no copy.
    assert_eq!(back.model[0].1.data_ptr(), buffers.model[0].1.data_ptr());
    assert_eq!(Vec::<f32>::try_from(&buffers.model[0].1).unwrap(), vec![1.5, 2.5]);
    assert_eq!(back.state[0].1.data_ptr(), buffers.state[0].1.data_ptr());
    assert_eq!(Vec::<f32>::try_from(&buffers.state[0].1).unwrap(), vec![3.0]);
    assert_eq!(back.plugin("compressor"), Some(&[1u8, 2, 3][..]));
    assert_eq!(back.plugin("batch"), Some(&[][..]));

    // Pieces of 7 bytes: they straddle the length prefix, the header
    // and the tensors; the digest is the same tree as written.
    let rec = read_record(&dir.join("rank-0.json")).unwrap();
    let bytes = fs::read(dir.join(&rec.file)).unwrap();
    let digests: Vec<[u8; 32]> = bytes.chunks(7).map(|c| Sha256::digest(c).into()).collect();
    let small = FileRecord { sha256: tree_digest(&digests), chunk_bytes: Some(7), ..rec.clone() };
    let into = vec![("optimizer/exp_avg.0".to_owned(), Tensor::from_slice(&[0.0f32]))];
    let (folder, layout) = (Dir::open(&dir).unwrap(), accept().layout);
    let got = read_file_into(&folder, &small, layout.state(), &into, ReadMode::RESTORE).unwrap();
    assert_eq!(got.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["optimizer/exp_avg.0", "plugin/compressor", "plugin/batch"]);
    assert_eq!(Vec::<f32>::try_from(&into[0].1).unwrap(), vec![3.0]);

    // A flipped byte in the data, or in the header, is found.
    let f = dir.join(&rec.file);
    for at in [bytes.len() - 1, 9] {
        let mut b = bytes.clone();
        b[at] ^= 1;
        fs::write(&f, b).unwrap();
        let Err(e) = s.read_into(10, &mut snap(0, 0.0)) else { panic!("byte {at}: the damage was not found") };
        let e = format!("{e:#}");
        assert!(e.contains("is damaged"), "byte {at}: {e}");
    }
    // A shape that does not match gets a tensor of its own.
    fs::write(&f, &bytes).unwrap();
    let odd = vec![("optimizer/exp_avg.0".to_owned(), Tensor::from_slice(&[0.0f32, 0.0]))];
    let got = read_file_into(&folder, &rec, layout.state(), &odd, ReadMode::RESTORE).unwrap();
    assert_ne!(got[0].1.data_ptr(), odd[0].1.data_ptr());
    assert_eq!(Vec::<f32>::try_from(&got[0].1).unwrap(), vec![3.0]);
}

#[test]
fn every_read_mode_reads_the_same_bytes_and_finds_damage() {
    let d = tempfile::tempdir().unwrap();
    let big: Vec<f32> = (0..100_003).map(|i| i as f32 * 0.5).collect();
    let mut written = snap(10, 1.5);
    written.state[0].1 = Tensor::from_slice(&big);
    let layout = Layout::of(&written);
    let s = Store::open(d.path(), 0, 1, false, true).unwrap();
    let s = s.for_run(run("w/a/r0"), Accept { layout: layout.clone(), bounds: Bounds::fixed(4, 1, None) }).unwrap();
    s.write_part(&written).unwrap();
    let dir = s.commit(written.position).unwrap();
    // Pieces of two pages (direct reads apply) over a 400 KB file: many
    // pieces in flight, the last one short.
    let rec = read_record(&dir.join("rank-0.json")).unwrap();
    let bytes = fs::read(dir.join(&rec.file)).unwrap();
    let folder = Dir::open(&dir).unwrap();
    let chunk = 2 * DIRECT_ALIGN;
    let digests: Vec<[u8; 32]> = bytes.chunks(chunk).map(|c| Sha256::digest(c).into()).collect();
    let small = FileRecord { sha256: tree_digest(&digests), chunk_bytes: Some(chunk as u64), ..rec.clone() };
    let f = dir.join(&rec.file);
    for direct in [true, false] {
        for readers in [1, 3, 8] {
            let mode = ReadMode { direct, readers };
            let into = vec![("optimizer/exp_avg.0".to_owned(), Tensor::zeros([100_003], (Kind::Float, Device::Cpu)))];
            read_file_into(&folder, &small, layout.state(), &into, mode).unwrap();
            assert_eq!(Vec::<f32>::try_from(&into[0].1).unwrap(), big, "{mode:?}");
            // A flipped byte in a middle piece is found.
            let mut b = bytes.clone();
            b[bytes.len() / 2] ^= 1;
            fs::write(&f, b).unwrap();
            let e = format!("{:#}", read_file_into(&folder, &small, layout.state(), &into, mode).unwrap_err());
            assert!(e.contains("is damaged"), "{mode:?}: {e}");
            fs::write(&f, &bytes).unwrap();
        }
    }
}

#[test]
fn torn_writes_are_not_checkpoints_and_are_cleaned_up() {
    let d = tempfile::tempdir().unwrap();
    let s = store(d.path(), false);
    s.write_part(&snap(5, 1.0)).unwrap(); // no commit: a crash here
    assert!(list(d.path()).is_empty());
    s.write_part(&snap(6, 1.0)).unwrap();
    s.commit(snap(6, 1.0).position).unwrap();
    s.delete(6).unwrap();
    assert!(list(d.path()).is_empty());
    Store::open(d.path(), 0, 1, false, false).unwrap();
    assert_eq!(fs::read_dir(d.path()).unwrap().count(), 0, "the torn write was left behind");
}

/// The refusal `r` ends in, checked to name the checkpoint folder `dir`
/// and the field `field` in its message.
fn refusal<T>(r: Result<T>, dir: &Path, field: &str) -> String {
    let Err(e) = r else { panic!("the checkpoint in {} was accepted; `{field}` should be refused", dir.display()) };
    let message = format!("{e:#}");
    let refused = e.chain().find_map(|c| c.downcast_ref::<Refused>()).unwrap_or_else(|| panic!("not a refusal: {message}"));
    assert_eq!(refused.field, field, "{message}");
    assert_eq!(refused.dir, dir, "{message}");
    assert!(message.contains(&dir.display().to_string()) && message.contains(&format!("`{field}`")), "{message}");
    message
}

/// A store of entry `w/a/r0` in a new folder, with the checkpoint of
/// step 40 written; the folder and the checkpoint's directory.
fn written(compress: bool) -> (tempfile::TempDir, Store, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let s = store(&d.path().join("w_a_r0"), compress);
    s.write_part(&snap(40, 1.5)).unwrap();
    let dir = s.commit(snap(40, 1.5).position).unwrap();
    (d, s, dir)
}

/// Edits the manifest in `dir` as someone who knows the format and
/// holds the user's key would: its sha256 recomputed and sealed anew.
fn forge(dir: &Path, edit: impl FnOnce(&mut Manifest)) {
    forge_with(dir, Some(&key()), edit)
}

/// [`forge`], the seal made with `key` (None: the seal left as it was,
/// by someone without a key).
fn forge_with(dir: &Path, key: Option<&Key>, edit: impl FnOnce(&mut Manifest)) {
    let path = dir.join("checkpoint.json");
    let mut m: Manifest = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    edit(&mut m);
    m.sha256 = m.digest();
    if let Some(key) = key {
        m.seal = Seal::of(key, &m.sha256);
    }
    fs::write(path, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
}

#[test]
fn an_honest_checkpoint_restores_bit_for_bit_and_lr_scale_keeps_its_bits() {
    let d = tempfile::tempdir().unwrap();
    let bounds = Bounds::plugin("ramp", 65536, Some(300));
    let s = Store::open(d.path(), 0, 1, false, false).unwrap();
    let s = s.for_run(run("w/a/r0"), Accept { layout: accept().layout, bounds }).unwrap();
    let mut w = snap(40, 1.5);
    // A value that a JSON number need not read back to bit for bit.
    w.position.lr_scale = 0.1f64.sqrt() * 3.000000000000001;
    s.write_part(&w).unwrap();
    s.commit(w.position).unwrap();
    let back = s.read(40).unwrap();
    assert_eq!(back.position.lr_scale.to_bits(), w.position.lr_scale.to_bits());
    assert_eq!(back.position, w.position);
    assert!(back.model[0].1.equal(&w.model[0].1) && back.state[0].1.equal(&w.state[0].1));
}

#[test]
fn a_symlinked_step_folder_file_or_checkpoint_directory_is_refused() {
    let (_a, s, dir) = written(false);
    // Another run's checkpoint, outside the folder, of the very same
    // entry: linked in as a newer step.
    let (_b, _, theirs) = written(false);
    let linked = s.dir(41);
    std::os::unix::fs::symlink(&theirs, &linked).unwrap();
    assert_eq!(s.list().unwrap(), [40, 41]);
    let e = refusal(s.read(41), &linked, "the folder");
    assert!(e.contains("is a symbolic link, not a directory"), "{e}");
    // A file of the checkpoint linked to the same bytes elsewhere.
    let model = dir.join("model.safetensors");
    fs::remove_file(&model).unwrap();
    std::os::unix::fs::symlink(theirs.join("model.safetensors"), &model).unwrap();
    let e = refusal(s.read(40), &dir, "model.safetensors");
    assert!(e.contains("is a symbolic link, not a regular file"), "{e}");
    // The entry's checkpoint directory itself, or its parent, a link.
    let root = dir.parent().unwrap();
    let link = root.with_file_name("linked");
    std::os::unix::fs::symlink(root, &link).unwrap();
    let e = format!("{:#}", Store::open(&link, 0, 1, false, false).err().unwrap());
    assert!(e.contains("is a symbolic link"), "{e}");
    let e = format!("{:#}", Store::open(&link.join("x"), 0, 1, false, false).err().unwrap());
    assert!(e.contains("is a symbolic link"), "{e}");
}

#[test]
fn a_manifest_naming_a_file_outside_its_folder_is_refused() {
    let (_d, s, dir) = written(false);
    // Without its hash recomputed, any edit is refused by the hash.
    let path = dir.join("checkpoint.json");
    let text = fs::read_to_string(&path).unwrap();
    fs::write(&path, text.replace("\"model.safetensors\"", "\"../step-00000041/model.safetensors\"")).unwrap();
    refusal(s.read(40), &dir, "sha256");
    fs::write(&path, &text).unwrap();
    for outside in ["../step-00000041/model.safetensors", "/etc/passwd", "..", "sub/model.safetensors"] {
        forge(&dir, |m| m.model.file = outside.into());
        let e = refusal(s.read(40), &dir, "model.file");
        assert!(e.contains("not `model.safetensors`"), "{e}");
        refusal(verify(&dir), &dir, "model.file");
        fs::write(&path, &text).unwrap();
        forge(&dir, |m| m.ranks[0].file = outside.into());
        refusal(s.read(40), &dir, "ranks[0].file");
        fs::write(&path, &text).unwrap();
    }
    s.read(40).unwrap();
}

#[test]
fn a_renamed_step_folder_and_a_step_beyond_the_plan_are_refused() {
    let (_d, s, dir) = written(false);
    let renamed = s.dir(99_999_999);
    fs::rename(&dir, &renamed).unwrap();
    assert_eq!(s.list().unwrap(), [99_999_999]);
    let e = refusal(s.read(99_999_999), &renamed, "position.step");
    assert!(e.contains("is 40, but the folder is named for step 99999999"), "{e}");
    // The manifest changed to agree: beyond the run's 300 steps.
    forge(&renamed, |m| {
        m.position.step = 99_999_999;
        m.position.data_position = 99_999_999 * 4;
    });
    let e = refusal(s.read(99_999_999), &renamed, "position.step");
    assert!(e.contains("beyond the 300 steps the run plans"), "{e}");
    // Names that are not the canonical form are no checkpoints.
    fs::rename(&renamed, s.root.join("step-40")).unwrap();
    assert!(s.list().unwrap().is_empty());
}

#[test]
fn every_field_of_the_position_is_bounded_and_covered_by_the_hash() {
    let (_d, s, dir) = written(false);
    let path = dir.join("checkpoint.json");
    let honest = fs::read(&path).unwrap();
    // Not covered by the hash: refused as an edit.
    let text = String::from_utf8(honest.clone()).unwrap();
    fs::write(&path, text.replace("\"micro_batch\": 4", "\"micro_batch\": 4000000000")).unwrap();
    let e = refusal(s.read(40), &dir, "sha256");
    assert!(e.contains("changed after it was written"), "{e}");
    // Covered by a recomputed hash: refused by its bound.
    type Edit = fn(&mut Position);
    let cases: [(&str, Edit, &str); 9] = [
        ("position.micro_batch", |p| p.micro_batch = 4_000_000_000, "is 4000000000, outside 1..=4"),
        ("position.micro_batch", |p| p.micro_batch = 0, "outside 1..=4"),
        ("position.accum_steps", |p| p.accum_steps = 2, "is 2, outside 1..=1"),
        ("position.lr_scale", |p| p.lr_scale = 1e30, "is 1000000000000000000000000000000, not 1"),
        ("position.lr_scale", |p| p.lr_scale = f64::NAN, "is NaN, not 1"),
        ("position.data_position", |p| p.data_position = u64::MAX, "outside 40..=176"),
        ("position.data_position", |p| p.data_position = 39, "outside 40..=176"),
        ("position.step", |p| p.step = 0, "is 0, but the folder is named for step 40"),
        ("position.step", |p| p.step = 41, "is 41, but the folder is named for step 40"),
    ];
    for (field, edit, why) in cases {
        forge(&dir, |m| edit(&mut m.position));
        let e = refusal(s.read(40), &dir, field);
        assert!(e.contains(why), "{e}");
        fs::write(&path, &honest).unwrap();
    }
    // A batch-policy plugin: what the host accepts from one.
    let p = Store::open(s.root.as_path(), 0, 1, false, false).unwrap();
    let p = p.for_run(run("w/a/r0"), Accept { layout: accept().layout, bounds: Bounds::plugin("ramp", 65536, Some(300)) }).unwrap();
    forge(&dir, |m| m.position.lr_scale = 2.5);
    assert_eq!(p.read(40).unwrap().position.lr_scale, 2.5);
    let cases: [(&str, Edit, &str); 5] = [
        ("position.lr_scale", |p| p.lr_scale = 1e30, "it must be finite, positive and at most 4294967296"),
        ("position.lr_scale", |p| p.lr_scale = -1.0, "it must be finite, positive"),
        ("position.lr_scale", |p| p.lr_scale = f64::INFINITY, "it must be finite, positive"),
        ("position.micro_batch", |p| p.micro_batch = 4_000_000_000, "outside 1..=65536"),
        ("position.accum_steps", |p| p.accum_steps = 65537, "outside 1..=65536"),
    ];
    for (field, edit, why) in cases {
        fs::write(&path, &honest).unwrap();
        forge(&dir, |m| edit(&mut m.position));
        let e = refusal(p.read(40), &dir, field);
        assert!(e.contains(why), "{e}");
    }
    // lr_scale as a JSON number (not the exact text) does not parse.
    fs::write(&path, &honest).unwrap();
    let text = String::from_utf8(honest.clone()).unwrap();
    fs::write(&path, text.replace("\"lr_scale\": \"1\"", "\"lr_scale\": 1e30")).unwrap();
    refusal(s.read(40), &dir, "checkpoint.json");
    // An unknown field is refused, not ignored (it would be outside the hash).
    fs::write(&path, text.replacen("\"format\": 3,", "\"format\": 3, \"extra\": 1,", 1)).unwrap();
    let e = refusal(s.read(40), &dir, "checkpoint.json");
    assert!(e.contains("unknown field `extra`"), "{e}");
    // Format 2 (no keyed seal) and older: refused by name, with what to do.
    for old in [1, 2] {
        fs::write(&path, text.replacen("\"format\": 3", &format!("\"format\": {old}"), 1)).unwrap();
        let e = refusal(s.read(40), &dir, "format");
        assert!(e.contains(&format!("is {old}, an older harness's, without the keyed seal of format 3")), "{e}");
        assert!(e.contains("run the entry again in a new result file"), "{e}");
    }
    fs::write(&path, text.replacen("\"format\": 3", "\"format\": 4", 1)).unwrap();
    let e = refusal(s.read(40), &dir, "format");
    assert!(e.contains("is 4; this harness reads format 3"), "{e}");
}

#[test]
fn a_sparse_8_gib_file_is_refused_before_it_is_read() {
    let t0 = std::time::Instant::now();
    let (_d, s, dir) = written(false);
    // In place of the model file, the manifest untouched.
    let model = dir.join("model.safetensors");
    let honest = fs::read(&model).unwrap();
    File::create(&model).unwrap().set_len(8 << 30).unwrap();
    let e = refusal(s.read(40), &dir, "model.safetensors");
    assert!(e.contains("is 8589934592 bytes, more than the"), "{e}");
    refusal(s.read_into(40, &mut snap(0, 0.0)), &dir, "model.safetensors");
    // Declared in the manifest as well.
    forge(&dir, |m| m.model.bytes = 8 << 30);
    let e = refusal(s.read(40), &dir, "model.bytes");
    assert!(e.contains(&format!("is 8589934592, but this run's tensors make a file of exactly {} bytes", honest.len())), "{e}");
    // A rank file, compressed or not: within what its tensors occupy.
    for compress in [false, true] {
        let (_d, s, dir) = written(compress);
        let rank = dir.join(format!("rank-0{}", s.ext()));
        File::create(&rank).unwrap().set_len(8 << 30).unwrap();
        refusal(s.read(40), &dir, &format!("rank-0{}", s.ext()));
        forge(&dir, |m| m.ranks[0].bytes = 8 << 30);
        let e = refusal(s.read(40), &dir, "ranks[0].bytes");
        assert!(e.contains("is 8589934592, more than the"), "{e}");
    }
    assert!(t0.elapsed().as_secs() < 20, "the sparse files were read: {:?}", t0.elapsed());
}

#[test]
fn a_fifo_in_place_of_a_file_is_refused_at_once() {
    let (_d, s, dir) = written(false);
    let s = Arc::new(s);
    for file in ["model.safetensors", "checkpoint.json"] {
        let path = dir.join(file);
        let keep = dir.join("kept");
        fs::rename(&path, &keep).unwrap();
        assert!(std::process::Command::new("mkfifo").arg(&path).status().unwrap().success());
        let (tx, rx) = std::sync::mpsc::channel();
        let s2 = s.clone();
        std::thread::spawn(move || {
            let _ = tx.send(s2.read(40).map(drop));
        });
        let got = rx.recv_timeout(std::time::Duration::from_secs(10)).expect("reading the checkpoint blocked on a FIFO");
        let e = refusal(got, &dir, file);
        assert!(e.contains("is a FIFO, not a regular file"), "{e}");
        fs::remove_file(&path).unwrap();
        fs::rename(&keep, &path).unwrap();
    }
}

#[test]
fn a_checkpoint_of_another_run_or_entry_is_refused() {
    let (d, _, dir) = written(false);
    let ours = d.path().join("w_b_r0");
    fs::create_dir_all(&ours).unwrap();
    let copy = ours.join("step-00000040");
    fs::create_dir(&copy).unwrap();
    for e in fs::read_dir(&dir).unwrap() {
        let e = e.unwrap();
        fs::copy(e.path(), copy.join(e.file_name())).unwrap();
    }
    let other = |edit: fn(&mut RunIdentity)| {
        let mut r = run("w/a/r0");
        edit(&mut r);
        Store::open(&ours, 0, 1, false, false).unwrap().for_run(r, accept()).unwrap()
    };
    type Edit = fn(&mut RunIdentity);
    let cases: [(&str, Edit, &str); 6] = [
        ("run.entry", |r| r.entry = "w/b/r0".into(), "is `w/a/r0`, this run's is `w/b/r0`: the checkpoint belongs to another run or entry"),
        ("run.suite_sha256", |r| r.suite_sha256 = "ef".repeat(32), "belongs to another run or entry"),
        ("run.seed", |r| r.seed = 8, "is 7, this run's is 8"),
        ("run.steps", |r| r.steps = Some(200), "is Some(300), this run's is Some(200)"),
        ("run.plugins", |r| r.plugins.clear(), "belongs to another run or entry"),
        // ZeRO's shards laid out otherwise (the checkpoint's run had none).
        (
            "run.shards",
            |r| r.shards = "0123456789abcdef".into(),
            "is none, this run's is `0123456789abcdef`: the ZeRO shards lie differently",
        ),
    ];
    for (field, edit, why) in cases {
        let e = refusal(other(edit).read(40), &copy, field);
        assert!(e.contains(why), "{e}");
    }
    // The same run reads its own copy.
    other(|_| {}).read(40).unwrap();
    // A world of another size.
    let two = Store::open(&ours, 0, 2, false, false).unwrap();
    let two = two.for_run(RunIdentity { world_size: 2, ..run("w/a/r0") }, accept()).unwrap();
    refusal(two.read(40), &copy, "run.world_size");
    // Compressed by a run that does not compress.
    let zst = Store::open(&ours, 0, 1, true, false).unwrap().for_run(run("w/a/r0"), accept()).unwrap();
    refusal(zst.read(40), &copy, "compressed");
    // A forged shard layout is refused without echoing what it holds.
    forge(&copy, |m| m.run.shards = "\u{1b}[2J\nrefused? no".into());
    let e = refusal(other(|_| {}).read(40), &copy, "run.shards");
    assert!(e.contains("is no layout digest (16 bytes), this run's is none") && !e.contains('\u{1b}'), "{e}");
    // So is a forged entry id.
    forge(&copy, |m| m.run.entry = "w/\u{1b}[2J".into());
    let e = refusal(other(|_| {}).read(40), &copy, "run.entry");
    assert!(e.contains("is a value of 6 bytes (not shown") && !e.contains('\u{1b}'), "{e}");
}

#[test]
fn a_file_listing_other_tensors_is_refused_before_they_are_allocated() {
    let (_d, s, dir) = written(false);
    let honest = fs::read(dir.join("checkpoint.json")).unwrap();
    let rewrite = |state: Vec<(String, Tensor)>| {
        let rec = write_tensors(&dir, "rank-0.safetensors", &state, false, &AtomicBool::new(false)).unwrap();
        forge(&dir, |m| m.ranks[0] = rec);
    };
    let bytes = |n: usize| Tensor::from_slice(&vec![0u8; n]);
    type Named = Vec<(String, Tensor)>;
    let cases: [(Named, &str, &str); 5] = [
        (
            vec![
                ("optimizer/exp_avg.0".into(), Tensor::from_slice(&[1.0f32, 2.0])),
                ("plugin/compressor".into(), bytes(1)),
                ("plugin/batch".into(), bytes(0)),
            ],
            "rank-0.safetensors: tensor optimizer/exp_avg.0",
            "is Float of shape [2]; this run's is Float of shape [1]",
        ),
        (
            vec![
                ("optimizer/exp_avg.0".into(), Tensor::from_slice(&[1.0f64])),
                ("plugin/compressor".into(), bytes(1)),
                ("plugin/batch".into(), bytes(0)),
            ],
            "rank-0.safetensors: tensor optimizer/exp_avg.0",
            "is Double of shape [1]",
        ),
        (
            vec![
                ("optimizer/exp_avg.0".into(), Tensor::from_slice(&[1.0f32])),
                ("evil".into(), bytes(1)),
                ("plugin/compressor".into(), bytes(1)),
                ("plugin/batch".into(), bytes(0)),
            ],
            "rank-0.safetensors: tensor evil",
            "is not a tensor this run has",
        ),
        (
            vec![("plugin/compressor".into(), bytes(1)), ("plugin/batch".into(), bytes(0))],
            "rank-0.safetensors: tensor optimizer/exp_avg.0",
            "is missing",
        ),
        (
            vec![
                ("optimizer/exp_avg.0".into(), Tensor::from_slice(&[1.0f32])),
                ("plugin/compressor".into(), bytes((1 << 20) + 1)),
                ("plugin/batch".into(), bytes(0)),
            ],
            "rank-0.safetensors: tensor plugin/compressor",
            "the state of the `compressor` plugin is bytes, at most 1048576",
        ),
    ];
    for (state, field, why) in cases {
        rewrite(state);
        let e = refusal(s.read(40), &dir, field);
        assert!(e.contains(why), "{e}");
        let e = refusal(s.read_into(40, &mut snap(0, 0.0)), &dir, field);
        assert!(e.contains(why), "{e}");
    }
    fs::write(dir.join("checkpoint.json"), honest).unwrap();
    // A plugin state beyond the cap is not written in the first place.
    let mut big = snap(41, 1.0);
    big.plugins[0].1 = vec![0; (1 << 20) + 1];
    let e = format!("{:#}", s.write_part(&big).unwrap_err());
    assert!(e.contains("the compressor plugin's state is 1048577 bytes, more than the 1048576"), "{e}");
}

/// Issue 61: format 2's seal was an unkeyed sha256, so a checkpoint
/// rewritten with its hashes recomputed resumed (random weights trained
/// to eval loss 185). The seal is now keyed: a rewrite without the
/// user's key is refused by name, and so is one sealed with a key of
/// the forger's own, or a checkpoint of another user's.
#[test]
fn r61_a_checkpoint_rewritten_with_recomputed_hashes_is_refused_by_its_seal() {
    for compress in [false, true] {
        let (_d, s, dir) = written(compress);
        let model = format!("model{}", s.ext());
        let weights = vec![("w".to_owned(), Tensor::from_slice(&[153.0f32, -7.0]))];
        let rec = write_tensors(&dir, &model, &weights, compress, &AtomicBool::new(false)).unwrap();
        // Every hash recomputed, the seal kept: refused, naming the
        // checkpoint (its step) and the seal.
        forge_with(&dir, None, |m| m.model = rec.clone());
        let e = refusal(s.read(40), &dir, "seal");
        assert!(e.contains("step-00000040") && e.contains("was changed after it was written"), "{e}");
        assert!(e.contains(&format!("(key {})", key().id())), "{e}");
        refusal(s.read_into(40, &mut snap(0, 0.0)), &dir, "seal");
        // The manifest's hash alone still holds: `verify` checks that the
        // checkpoint is whole, not that it is authentic.
        verify(&dir).unwrap();
        // Sealed with a key of the forger's own: refused, naming both keys.
        let theirs = Key::from_bytes([1; 32]);
        forge_with(&dir, Some(&theirs), |_| {});
        let e = refusal(s.read(40), &dir, "seal");
        assert!(e.contains(&format!("was made with key {}, not with this user's checkpoint key", theirs.id())), "{e}");
        // A seal's key id that is not one is not echoed.
        forge_with(&dir, None, |m| m.seal.key = "\u{1b}[2Jforged".into());
        let e = refusal(s.read(40), &dir, "seal");
        assert!(e.contains("was made with no key id (10 bytes)") && !e.contains('\u{1b}'), "{e}");
    }
    // An honest checkpoint read by a store of another user's key (or of
    // another machine): refused; the writer's key reads it.
    let (_d, s, dir) = written(false);
    let elsewhere = Store::open(&s.root, 0, 1, false, false).unwrap().for_run(run("w/a/r0"), accept()).unwrap();
    let elsewhere = elsewhere.with_key(Key::from_bytes([2; 32]));
    let e = refusal(elsewhere.read(40), &dir, "seal");
    assert!(e.contains("written by another user or machine"), "{e}");
    s.read(40).unwrap();
}

/// What remains possible, as docs/checkpoint-policies.md says: whoever
/// holds the user's key (the user) and edits their own checkpoint
/// consistently (the files, their hashes, the manifest's, sealed anew,
/// within the layout and bounds) feeds the run what they like. The
/// result records that the entry resumed.
#[test]
fn a_consistent_edit_sealed_with_the_users_own_key_is_accepted_as_documented() {
    let (_d, s, dir) = written(false);
    let weights = vec![("w".to_owned(), Tensor::from_slice(&[153.0f32, -7.0]))];
    let rec = write_tensors(&dir, "model.safetensors", &weights, false, &AtomicBool::new(false)).unwrap();
    forge(&dir, |m| m.model = rec);
    let back = s.read(40).unwrap();
    assert_eq!(Vec::<f32>::try_from(&back.model[0].1).unwrap(), [153.0, -7.0]);
}
