//! Rules 5 and 6: the labels a bundle carries (suite version, hardware
//! class, GPU count, tracks, plugins) are worked out from the released
//! suite it ran and compared with the result's submission record and the
//! manifest; the hardware is judged from the fingerprint and from every
//! entry's own record of where it ran, never from a label. On the CPU
//! class the fingerprint must also record libtorch's CPU kernels held to
//! the class's level (`machine.cpu_kernels`).

use std::path::Path;

use super::{list, Manifest, Released, Submission, Suite, Verdict, RESUBMIT};
use harness_format::machine::{cpu_class_problem, Fingerprint, CPU_CLASS};
use harness_format::results::RunResult;

const EDITED: &str = "submit the result of the run as it was written: labels are worked out from the released suite, not read";

/// Rule 5: the labels are the released suite's, and the manifest's are
/// the result's.
pub(super) fn check_labels(suite: &Suite, released: &Released, m: &Manifest, sub: &Submission, r: &RunResult, v: &mut Verdict) {
    let meta = &suite.spec.suite;
    let version = meta.version.as_deref();
    let class = meta.hardware.as_ref().map(|h| h.class.as_str());
    let mut label = |what: &str, recorded: Option<&str>, derived: Option<&str>| {
        if recorded != derived {
            v.add(
                "labels",
                format!("{what} is {}; the released suite that ran ({}) gives {}", shown(recorded), released.file, shown(derived)),
                EDITED,
            );
        }
    };
    label("the result's suite version", sub.suite_version.as_deref(), version);
    label("the manifest's suite version", m.suite.version.as_deref(), version);
    label("the result's hardware class", sub.hardware_class.as_deref(), class);
    label("the manifest's hardware class", m.hardware_class.as_deref(), class);
    // A release moves to suites/standard/VERSION/ when the next one comes:
    // the file it was released as keeps its name.
    let file_name = |f: &str| Path::new(f).file_name().map(|n| n.to_os_string());
    if m.suite.released_as.as_deref().map(file_name) != Some(file_name(released.file)) {
        label("the manifest's released suite", m.suite.released_as.as_deref(), Some(released.file));
    }
    label("the manifest's suite name", Some(&m.suite.name), Some(&meta.name));
    if !sub.released_suite {
        v.add("labels", format!("the result says its suite was not a released one; it is {}", released.file), EDITED);
    }
    if m.gpus != sub.gpus {
        v.add("labels", format!("the manifest says {} GPUs, the result {}", m.gpus, sub.gpus), EDITED);
    }
    // The tracks the plugin was entered in; bundles of harness versions
    // before that listed every track that ran, which stays accepted.
    let entered = crate::submission::entered_tracks(r);
    if m.tracks != entered && m.tracks != sub.tracks {
        v.add("labels", format!("the manifest's tracks are {}, the result's entered {}", list(&m.tracks), list(&entered)), EDITED);
    }
    let plugin = |p: (&str, &str, &str, &str, u64)| format!("{} `{}` {} (sha256 {}, {} bytes)", p.0, p.1, p.2, super::short(p.3), p.4);
    let in_manifest: Vec<String> = m.plugins.iter().map(|p| plugin((&p.kind, &p.name, &p.version, &p.sha256, p.bytes))).collect();
    let in_result: Vec<String> = sub.entered.iter().map(|p| plugin((&p.kind, &p.name, &p.version, &p.sha256, p.bytes))).collect();
    if in_manifest != in_result {
        v.add(
            "labels",
            format!("the manifest's plugins are [{}], the result's [{}]", in_manifest.join("; "), in_result.join("; ")),
            EDITED,
        );
    }
}

fn shown(x: Option<&str>) -> String {
    x.map_or("none".into(), |x| format!("`{x}`"))
}

/// What every entry of a run on `machine` with `gpus` GPUs (ranks) of
/// `suite`'s class records as its device (host/src/launch.rs,
/// `device_name`): `cpu`, `cuda (<GPU>)`, or `<N> x cuda (<GPU>)`.
fn device_name(suite: &Suite, machine: &Fingerprint, gpus: u32) -> Option<String> {
    if suite.spec.suite.device == harness_format::suite::DeviceKind::Cpu {
        return Some("cpu".into());
    }
    let gpu = machine.gpus.first()?;
    Some(if gpus > 1 { format!("{gpus} x cuda ({})", gpu.name) } else { format!("cuda ({})", gpu.name) })
}

/// Rule 6: the fingerprint (as bundled twice: `machine.json` and the
/// result's) has the class's GPU, as many as the run used, and every entry
/// ran there: its device, its ranks and, on GPUs, its device memory. On
/// the CPU class, its CPU has AVX2 and FMA and libtorch's CPU kernels were
/// held to them: only then does a rerun on another CPU of the class give
/// the trajectory bit for bit.
pub(super) fn check_hardware(suite: &Suite, sub: &Submission, r: &RunResult, machine_json: Option<&[u8]>, v: &mut Verdict) {
    const TODO: &str = "run on the suite's hardware class, and submit the result as it was written";
    match machine_json.map(serde_json::from_slice::<Fingerprint>) {
        Some(Ok(m)) if m == r.machine => {}
        Some(Ok(_)) => v.add("hardware", "machine.json is not the fingerprint recorded in result.json", RESUBMIT),
        Some(Err(e)) => v.add("hardware", format!("machine.json is not a machine fingerprint: {e}"), RESUBMIT),
        None => {} // rule 1 says why it is missing
    }
    let Some(h) = &suite.spec.suite.hardware else { return };
    let on_gpus = !h.gpu.is_empty();
    let machine = &r.machine;
    if h.class == CPU_CLASS {
        if let Some(why) = cpu_class_problem(machine) {
            v.add(
                "hardware",
                why,
                "run on an x86-64 CPU with AVX2 and FMA with a harness that holds libtorch's CPU kernels to the class's level itself \
                 (docs/rules.md, \"The CPU class\"), and submit the result as it was written",
            );
        }
    }
    if on_gpus {
        if (machine.gpus.len() as u64) < u64::from(sub.gpus) {
            v.add("hardware", format!("the run used {} GPUs; the fingerprint lists {}", sub.gpus, machine.gpus.len()), TODO);
        }
        for g in machine.gpus.iter().take(sub.gpus as usize).filter(|g| !g.name.contains(&h.gpu)) {
            v.add("hardware", format!("GPU {} of the fingerprint is {}; the class {} needs {}", g.index, g.name, h.class, h.gpu), TODO);
        }
    }
    let want = device_name(suite, machine, sub.gpus);
    let elsewhere: Vec<String> =
        r.entries.iter().filter(|e| Some(&e.device) != want.as_ref()).map(|e| format!("{} (`{}`)", e.id, e.device)).collect();
    if !elsewhere.is_empty() {
        v.add(
            "hardware",
            format!(
                "{} entries did not run on the device the fingerprint and the class {} on {} GPUs give ({}): {}",
                elsewhere.len(),
                h.class,
                sub.gpus,
                want.map_or("a GPU the fingerprint lacks".into(), |d| format!("`{d}`")),
                list(&elsewhere)
            ),
            TODO,
        );
    }
    let mut wrong = Vec::new();
    for e in &r.entries {
        let Some(m) = &e.metrics else { continue };
        if m.world_size != sub.gpus {
            wrong.push(format!("{} trained on {} ranks, the run's GPU count is {}", e.id, m.world_size, sub.gpus));
        }
        if !m.ranks.is_empty() && m.ranks.len() as u64 != u64::from(m.world_size) {
            wrong.push(format!("{} records {} ranks' memory for {} ranks", e.id, m.ranks.len(), m.world_size));
        }
        if on_gpus && m.memory.peak_device_allocated_bytes.is_none() {
            wrong.push(format!("{} has no GPU memory figures (it did not train on a GPU)", e.id));
        }
    }
    if !wrong.is_empty() {
        v.add("hardware", list(&wrong), TODO);
    }
}
