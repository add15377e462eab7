//! `sdk/include/harness_strategy.h` and `harness_sdk::abi` describe the same
//! ABI: constants, op codes, and (compiled with the system C compiler) the
//! layout of every struct.

use std::collections::BTreeMap;
use std::mem::{offset_of, size_of};
use std::path::PathBuf;
use std::process::Command;

use harness_sdk::abi::{self, Op};

const HEADER: &str = include_str!("../include/harness_strategy.h");

fn defines() -> BTreeMap<String, i64> {
    HEADER
        .lines()
        .filter_map(|line| {
            let rest = line.trim().strip_prefix("#define ")?;
            let mut words = rest.split_whitespace();
            let name = words.next()?;
            let value = words.next()?.parse().ok()?;
            Some((name.to_owned(), value))
        })
        .collect()
}

/// `AllReduceSum` -> `ALL_REDUCE_SUM`, `ReadF32` -> `READ_F32`.
fn screaming(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

#[test]
fn constants_agree() {
    let d = defines();
    assert_eq!(d["HARNESS_ABI_VERSION"], i64::from(abi::ABI_VERSION));
    assert_eq!(d["HARNESS_STATUS_OK"], i64::from(abi::STATUS_OK));
    assert_eq!(d["HARNESS_STATUS_ERROR"], i64::from(abi::STATUS_ERROR));
    assert_eq!(d["HARNESS_STATUS_PANIC"], i64::from(abi::STATUS_PANIC));
    assert_eq!(d["HARNESS_KIND_COMPRESSOR"], i64::from(abi::KIND_COMPRESSOR));
    assert_eq!(d["HARNESS_KIND_BATCH_POLICY"], i64::from(abi::KIND_BATCH_POLICY));
    assert_eq!(d["HARNESS_KIND_CHECKPOINT_POLICY"], i64::from(abi::KIND_CHECKPOINT_POLICY));
    let dtypes: Vec<_> = d.iter().filter(|(k, _)| k.starts_with("HARNESS_DTYPE_")).collect();
    assert_eq!(dtypes.len(), abi::DTYPES.len());
    for (i, name) in abi::DTYPES.iter().enumerate() {
        assert_eq!(d[&format!("HARNESS_DTYPE_{}", name.to_uppercase())], i as i64, "dtype {name}");
        assert_eq!(harness_sdk::Dtype::from_index(i as u32).unwrap().name(), *name);
    }
}

#[test]
fn every_op_has_its_code() {
    let d = defines();
    let header_ops: BTreeMap<_, _> = d.iter().filter(|(k, _)| k.starts_with("HARNESS_OP_")).collect();
    assert_eq!(header_ops.len(), Op::ALL.len(), "the header and abi::Op list different ops");
    for (i, op) in Op::ALL.iter().enumerate() {
        assert_eq!(*op as u32 as usize, i + 1, "Op::ALL is not in code order at {op:?}");
        assert_eq!(Op::from_code(*op as u32), Some(*op));
        let name = format!("HARNESS_OP_{}", screaming(&format!("{op:?}")));
        assert_eq!(d.get(&name).copied(), Some(i64::from(*op as u32)), "{name}");
    }
    assert_eq!(Op::from_code(0), None);
    assert_eq!(Op::from_code(Op::ALL.len() as u32 + 1), None);
}

#[test]
fn every_symbol_is_declared() {
    let symbols = [
        abi::symbols::ABI_VERSION,
        abi::symbols::KIND,
        abi::symbols::CREATE,
        abi::symbols::DESTROY,
        abi::symbols::INFO,
        abi::symbols::CONFIGURE,
        abi::symbols::LAST_ERROR,
        abi::symbols::STATE_SAVE,
        abi::symbols::STATE_LOAD,
        abi::symbols::COMPRESS,
        abi::symbols::COMPRESS_SETUP,
        abi::symbols::BATCH_INITIAL,
        abi::symbols::BATCH_NEXT,
        abi::symbols::BATCH_WANTS_GRADIENT_STATS,
        abi::symbols::CHECKPOINT_DECIDE,
    ];
    for s in symbols {
        let name = std::str::from_utf8(s.strip_suffix(b"\0").expect("NUL-terminated")).unwrap();
        assert!(HEADER.contains(&format!(" {name}(")) || HEADER.contains(&format!("*{name}(")), "{name} is not declared in the header");
    }
}

/// `(C struct, Rust type, [fields])`: both sides' offsets and sizes.
macro_rules! layouts {
    ($(($c:ident, $rust:ty, [$($field:ident),* $(,)?])),* $(,)?) => {{
        let mut rust = BTreeMap::new();
        let mut c = String::new();
        $(
            rust.insert(format!("{} size", stringify!($c)), size_of::<$rust>());
            c.push_str(&format!("printf(\"{} size %zu\\n\", sizeof({}));\n", stringify!($c), stringify!($c)));
            $(
                rust.insert(format!("{}.{}", stringify!($c), stringify!($field)), offset_of!($rust, $field));
                c.push_str(&format!(
                    "printf(\"{0}.{1} %zu\\n\", offsetof({0}, {1}));\n",
                    stringify!($c),
                    stringify!($field)
                ));
            )*
        )*
        (rust, c)
    }};
}

#[test]
fn struct_layouts_agree_with_the_c_compiler() {
    let (rust, prints) = layouts!(
        (harness_op_args, abi::OpArgs, [tensors, n_tensors, floats, n_floats, ints, n_ints, data, n_data]),
        (harness_op_result, abi::OpResult, [tensors, scalar, ints, n_ints, data, n_data, ptr]),
        (harness_host, abi::Host, [abi_version, ctx, op, drop_tensor, last_error, log]),
        (harness_bucket_info, abi::BucketInfo, [step, index, count]),
        (harness_param_slot, abi::ParamSlot, [name, name_len, shape, ndim, offset, numel, dtype, weight]),
        (harness_bucket_layout, abi::BucketLayout, [numel, params, n_params]),
        (harness_batch, abi::Batch, [micro_batch, accum_steps, lr_scale]),
        (
            harness_step_telemetry,
            abi::StepTelemetry,
            [
                step,
                loss,
                step_time_s,
                elapsed_s,
                memory_used_bytes,
                memory_total_bytes,
                tokens_per_s,
                micro_batch,
                accum_steps,
                world_size,
                has_grad_sq_norm,
                has_local_grad_sq_norm,
                out_of_memory,
                grad_sq_norm,
                local_grad_sq_norm
            ]
        ),
        (
            harness_checkpoint_history,
            abi::CheckpointHistory,
            [has_last_cost_s, last_cost_s, saved, n_saved, failures, n_failures, since_last_s]
        ),
        (harness_decision, abi::Decision, [save, delete_steps, n_delete]),
        (harness_info, abi::Info, [name, name_len, version, version_len]),
    );
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("harness-sdk-header");
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("layout.c");
    let include = concat!(env!("CARGO_MANIFEST_DIR"), "/include");
    std::fs::write(
        &src,
        format!("#include <stdio.h>\n#include <stddef.h>\n#include \"harness_strategy.h\"\nint main(void) {{\n{prints}return 0;\n}}\n"),
    )
    .unwrap();
    let exe = dir.join("layout");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    let status = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Werror", "-I", include, "-o"])
        .arg(&exe)
        .arg(&src)
        .status()
        .unwrap_or_else(|e| panic!("this test compiles the header with `{cc}` (set CC): {e}"));
    assert!(status.success(), "the header does not compile with {cc}");
    let out = Command::new(&exe).output().unwrap();
    let c: BTreeMap<String, usize> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap();
            (k.to_owned(), v.parse().unwrap())
        })
        .collect();
    assert_eq!(c, rust);
}
