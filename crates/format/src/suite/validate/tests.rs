use super::*;
use crate::suite::spec::FaultSpec;

/// Parses suite text named `test.toml` (also for the plan's tests).
pub(in crate::suite) fn parse(src: &str) -> Result<Suite, SuiteErrors> {
    Suite::parse(Path::new("test.toml"), src.to_owned())
}

/// A valid suite: one workload, two strategies, two repeats.
pub(in crate::suite) const OK: &str = r#"
[suite]
name = "t"
repeats = 2

[[workload]]
name = "w"
model = { kind = "gpt", preset = "tiny" }
data = { kind = "synthetic", vocab = 64 }
batch = 4
seq_len = 16
steps = 10
optimizer = { kind = "adamw", lr = 1e-3 }

[[strategy]]
name = "a"
baseline = true

[[strategy]]
name = "b"
"#;

#[test]
fn fault_budgets_are_positive_and_only_bound_injected_failures() {
    // Issue 61: the budgets that end an entry failing without end.
    for (faults, says) in [
        ("{ at_steps = [3], max_restarts = 0 }", "`max_restarts` must be at least 1"),
        ("{ at_steps = [3], max_time_lost_ratio = 0.0 }", "`max_time_lost_ratio` must be a positive multiple"),
        ("{ mtbf_s = 5, max_time_lost_ratio = -1.0 }", "`max_time_lost_ratio` must be a positive multiple"),
        ("{ mtbf_s = 5, max_time_lost_ratio = nan }", "`max_time_lost_ratio` must be a positive multiple"),
        ("{ oom_above_batch = 8, max_restarts = 5 }", "`max_restarts` only bounds injected failures"),
        ("{ max_time_lost_ratio = 5.0 }", "`max_time_lost_ratio` only bounds injected failures"),
    ] {
        let e = parse(&OK.replace("steps = 10", &format!("steps = 10\nfaults = {faults}"))).expect_err(faults);
        assert_eq!(e.0.len(), 1, "{faults}: {e}");
        assert!(e.0[0].message.contains(says) && e.0[0].line_col().unwrap().0 == 13, "{faults}: {e}");
    }
    let s = parse(&OK.replace("steps = 10", "steps = 10\nfaults = { mtbf_s = 5, max_restarts = 7, max_time_lost_ratio = 2.5 }")).unwrap();
    let f = s.spec.workloads[0].faults.as_ref().unwrap();
    assert_eq!((f.max_restarts(), f.max_time_lost_ratio()), (7, 2.5));
    let f = FaultSpec::default();
    assert_eq!((f.max_restarts(), f.max_time_lost_ratio()), (1000, 10.0));
}

/// `[projection]`: clusters of the `harness project` shape, strategies
/// of the suite; each mistake at its line.
#[test]
fn a_projection_section_names_clusters_and_the_suites_strategies() {
    let ok = format!("{OK}\n[projection]\nclusters = [\"1-128x8:net=100Gbps\", \"2x4:net=10Gbps\"]\nstrategies = [\"allreduce\", \"b\"]\n");
    let s = parse(&ok).unwrap();
    let p = s.spec.projection.as_ref().unwrap();
    assert_eq!(p.clusters.len(), 2);
    assert_eq!(p.strategies, ["allreduce", "b"]);
    assert!(parse(OK).unwrap().spec.projection.is_none());
    for (from, to, says) in [
        ("\"2x4:net=10Gbps\"", "\"2by4\"", "cluster `2by4` is not NODESxGPUS"),
        ("\"1-128x8:net=100Gbps\", \"2x4:net=10Gbps\"", "", "needs at least one cluster"),
        ("\"allreduce\", \"b\"", "\"c\"", "strategy `c` is not one of the suite's"),
    ] {
        let e = parse(&ok.replace(from, to)).expect_err(says);
        assert_eq!(e.0.len(), 1, "{e}");
        assert!(e.0[0].message.contains(says), "{e}");
        assert!(e.0[0].line_col().is_some_and(|(l, _)| l >= 23), "{e}");
    }
    assert!(parse(&format!("{OK}\n[projection]\nclusters = [\"1x8\"]\nnodes = 2\n")).is_err());
    let many = vec!["\"1x8\""; MAX_PROJECTION_CLUSTERS + 1].join(", ");
    let e = parse(&format!("{OK}\n[projection]\nclusters = [{many}]\n")).unwrap_err();
    assert!(e.0[0].message.contains("more than 64"), "{e}");
}

#[test]
fn errors_point_at_line_and_column() {
    let bad = OK.replace("batch = 4", "batch = 0");
    let e = parse(&bad).unwrap_err();
    assert_eq!(e.0.len(), 1);
    assert_eq!(e.0[0].line_col(), Some((10, 9)));
}

#[test]
fn what_a_terminal_would_act_on_is_shown_not_sent() {
    // A suite may spell escape sequences in its strings and keys, and
    // put raw control or bidirectional characters in its text; its
    // errors quote the former and show lines holding the latter.
    let sent = |text: &str| -> Vec<char> { text.chars().filter(|&c| crate::fmt::unseen(c) && c != '\n').collect() };
    for (quoted, says) in [
        (OK.replace("name = \"w\"", "name = \"w\\u001b]0;title\\u0007\""), r"workload name `w\u{1b}]0;title\u{7}` is not a plain name"),
        (OK.replace("steps = 10", "steps = 10\n\"k\\u001b[2J\" = 1"), r"unknown field `k\u{1b}[2J`"),
    ] {
        let text = parse(&quoted).unwrap_err().to_string();
        assert!(sent(&text).is_empty(), "{:?} in {text}", sent(&text));
        assert!(text.contains(says), "{text}");
    }
    // Raw characters: TOML refuses control characters, not the
    // bidirectional ones; either way the excerpt shows U+FFFD, and its
    // caret stays under the character the message is about.
    for (raw, at) in [("batch = 0 # \u{202e} x \u{2066}", "batch = 0"), ("batch = 4 # \u{1b}[31m red \u{9b}", "\u{fffd}[31m")] {
        let e = parse(&OK.replace("batch = 4", raw)).unwrap_err();
        let text = e.to_string();
        assert!(sent(&text).is_empty(), "{:?} in {text}", sent(&text));
        let (_, col) = e.0[0].line_col().unwrap();
        let line = text.lines().find(|l| l.contains(at)).unwrap_or_else(|| panic!("{text}"));
        let caret = text.lines().skip_while(|l| *l != line).nth(1).unwrap();
        let start = line.find("batch").unwrap();
        assert_eq!(caret[start..].chars().position(|c| c == '^'), Some(col - 1), "{text}");
    }
    // A description is text for people: tabs and line breaks, nothing
    // a terminal acts on (the report shows it; bundles carry it).
    let described = |d: &str| OK.replace("repeats = 2", &format!("repeats = 2\ndescription = \"{d}\""));
    assert!(parse(&described(r"two lines\n\tand a tab, ünïcode")).is_ok());
    for d in [r"\u001b]0;title\u0007", r"right \u202e to left"] {
        let text = parse(&described(d)).unwrap_err().to_string();
        assert!(sent(&text).is_empty(), "{:?} in {text}", sent(&text));
        assert!(text.contains("test.toml:5:15: the description holds"), "{text}");
    }
}

#[test]
fn nccl_settings_and_topologies_are_checked_where_written() {
    let two_ranks = OK.replace("repeats = 2", "repeats = 2\nworld_size = 4");
    let good = two_ranks.replace(
        "name = \"b\"",
        "name = \"b\"\nnccl = { NCCL_ALGO = \"Ring\", NCCL_MAX_NCHANNELS = 4 }\nnccl_transport = \"network\"\nlink = { gbps = 10, nodes = 2 }",
    );
    let s = parse(&good).unwrap();
    let env = s.spec.strategies[1].nccl_env();
    assert_eq!(env["NCCL_ALGO"], "Ring");
    assert_eq!(env["NCCL_MAX_NCHANNELS"], "4");
    assert_eq!(env["NCCL_P2P_DISABLE"], "1");
    for (bad, says) in [
        ("nccl = { ALGO = \"Ring\" }", "`ALGO` is not an NCCL setting"),
        ("nccl = { NCCL_DEBUG = \"WARN\" }", "`NCCL_DEBUG` is set by harness"),
        ("nccl = { NCCL_ALGO = [1] }", "must be a string, an integer or a boolean"),
        ("nccl = { \"NCCL_ALGO\\u001b[2J\" = \"Ring\" }", "`NCCL_ALGO\u{1b}[2J` is not an NCCL setting"),
        ("nccl = { NCCL_ = 1 }", "`NCCL_` is not an NCCL setting"),
        (
            "nccl = { NCCL_ALGO = \"Ring\\u001b]0;t\\u0007\" }",
            r#"`NCCL_ALGO` = "Ring\u{1b}]0;t\u{7}" holds a character other than printable ASCII"#,
        ),
        ("nccl_transport = \"ib\"", "unknown variant `ib`"),
        ("link = { gbps = 10, nodes = 3 }", "`nodes = 3` does not split world_size = 4"),
        ("link = { gbps = 10, nodes = 1 }", "`nodes = 1` does not split"),
    ] {
        let e = parse(&two_ranks.replace("name = \"b\"", &format!("name = \"b\"\n{bad}"))).unwrap_err();
        assert!(e.0[0].message.contains(says), "{bad}: {e}");
        assert_eq!(e.0[0].line_col().unwrap().0, 22, "{bad}: {e}");
    }
}

#[test]
fn a_bf16_reduction_is_for_the_built_in_all_reduce_alone() {
    let two_ranks = OK.replace("repeats = 2", "repeats = 2\nworld_size = 2");
    let s = parse(&two_ranks.replace("name = \"b\"", "name = \"b\"\nreduce_dtype = \"bf16\"")).unwrap();
    assert_eq!(s.spec.strategies[1].reduce_dtype, crate::suite::ReduceDtype::Bf16);
    assert_eq!(s.spec.strategies[0].reduce_dtype, crate::suite::ReduceDtype::Fp32);
    for (bad, says) in [
        ("zero = 1", "ZeRO reduce-scatters them in their own type"),
        ("link = { gbps = 10 }", "an emulated link reduces after the backward pass"),
        ("compressor = \"none\"", "compressor `none` reduces the gradients itself"),
    ] {
        let text = two_ranks.replace("name = \"b\"", &format!("name = \"b\"\nreduce_dtype = \"bf16\"\n{bad}"));
        let e = parse(&text).unwrap_err();
        assert!(e.0.iter().any(|e| e.message.contains(says)), "{bad}: {e}");
    }
    let e = parse(&two_ranks.replace("name = \"b\"", "name = \"b\"\nreduce_dtype = \"fp8\"")).unwrap_err();
    assert!(e.0[0].message.contains("unknown variant `fp8`"), "{e}");
}

#[test]
fn cudnn_autotuning_is_off_unless_a_workload_turns_it_on() {
    let off = parse(OK).unwrap();
    assert!(!off.spec.workloads[0].cudnn_benchmark);
    let on = parse(&OK.replace("steps = 10", "steps = 10\ncudnn_benchmark = true")).unwrap();
    assert!(on.spec.workloads[0].cudnn_benchmark);
    let e = parse(&OK.replace("steps = 10", "steps = 10\ncudnn_benchmark = \"yes\"")).unwrap_err();
    assert!(e.to_string().contains("invalid type"), "{e}");
}

#[test]
fn cuda_graphs_are_off_unless_a_workload_turns_them_on() {
    let off = parse(OK).unwrap();
    assert!(!off.spec.workloads[0].cuda_graph);
    let on = parse(&OK.replace("steps = 10", "steps = 10\ncuda_graph = true")).unwrap();
    assert!(on.spec.workloads[0].cuda_graph);
    let e = parse(&OK.replace("steps = 10", "steps = 10\ncuda_graph = \"auto\"")).unwrap_err();
    assert!(e.to_string().contains("invalid type"), "{e}");
}

#[test]
fn stop_at_target_needs_a_target_and_evaluations() {
    let stop = OK.replace("steps = 10", "steps = 10\nstop_at_target = true");
    let e = parse(&stop).unwrap_err();
    let all = e.to_string();
    assert!(all.contains("`stop_at_target` needs a target"), "{all}");
    assert!(all.contains("`stop_at_target` needs evaluations during training"), "{all}");
    assert_eq!(e.0[0].line_col().unwrap().0, 13);
    parse(&stop.replace("steps = 10", "steps = 10\ntarget_above_floor = 0.2\neval_every_tokens = 256")).unwrap();
    parse(&stop.replace("steps = 10", "steps = 10\ntarget_loss = 3.0\neval_every = 2")).unwrap();
    for (bad, says) in
        [("eval_every_tokens = 0", "`eval_every_tokens` must be at least 1"), ("eval_every_tokens = 64\neval_every = 2", "not both")]
    {
        let e = parse(&OK.replace("steps = 10", &format!("steps = 10\n{bad}"))).unwrap_err();
        assert!(e.0[0].message.contains(says), "{bad}: {e}");
    }
}

#[test]
fn vision_workloads_need_images_one_image_per_sample_and_a_resnet_depth_or_vit_patches() {
    let vision = OK
        .replace(r#"model = { kind = "gpt", preset = "tiny" }"#, r#"model = { kind = "vision", preset = "tiny" }"#)
        .replace(r#"data = { kind = "synthetic", vocab = 64 }"#, r#"data = { kind = "images" }"#)
        .replace("seq_len = 16", "seq_len = 1");
    parse(&vision).unwrap();
    parse(&vision.replace(
        "steps = 10",
        "steps = 10
target_accuracy = 0.8
stop_at_target = true
eval_every = 5",
    ))
    .unwrap();
    parse(&vision.replace(r#"preset = "tiny""#, r#"preset = "vit-tiny""#)).unwrap();
    parse(&vision.replace(r#"preset = "tiny""#, "n_layer = 50, d_model = 16")).unwrap();
    for (from, to, says) in [
        ("seq_len = 1", "seq_len = 4", "`seq_len` must be 1"),
        (r#"data = { kind = "images" }"#, r#"data = { kind = "synthetic", vocab = 64 }"#, "trains on `kind = \"images\"` data"),
        (r#"preset = "tiny""#, r#"preset = "tiny", n_layer = 12"#, "no ResNet of depth 12"),
        (r#"preset = "tiny""#, r#"preset = "tiny", n_head = 2"#, "a ResNet has no `n_head`"),
        (r#"data = { kind = "images" }"#, r#"data = { kind = "images", label_noise = 0.9 }"#, "`label_noise` must lie in [0, 0.9000)"),
        (r#"data = { kind = "images" }"#, r#"data = { kind = "images", image_size = 8, padding = 8 }"#, "`padding` must be smaller"),
        (r#"data = { kind = "images" }"#, r#"data = { kind = "images", threads = 0 }"#, "`threads` must be at least 1"),
        (
            r#"data = { kind = "images" }"#,
            r#"data = { kind = "images", threads = 2, pipeline = "device" }"#,
            "`pipeline = \"device\"` makes them on the device",
        ),
        (r#"data = { kind = "images" }"#, r#"data = { kind = "images", pipeline = "gpu" }"#, "unknown variant `gpu`"),
        (
            "steps = 10",
            "steps = 10
target_accuracy = 1.5",
            "`target_accuracy` is a top-1 accuracy",
        ),
        (
            "steps = 10",
            "steps = 10
target_accuracy = 0.5
target_loss = 1.0",
            "not both",
        ),
        (
            "steps = 10",
            "steps = 10
recompute = \"all\"",
            "does not recompute",
        ),
    ] {
        let e = parse(&vision.replace(from, to)).unwrap_err();
        assert!(e.to_string().contains(says), "{to}: {e}");
    }
    // A ViT cuts the image into whole patches.
    let e = parse(
        &vision
            .replace(r#"preset = "tiny""#, r#"preset = "vit-tiny""#)
            .replace(r#"{ kind = "images" }"#, r#"{ kind = "images", image_size = 30 }"#),
    )
    .unwrap_err();
    assert!(e.to_string().contains("a multiple of 4"), "{e}");
    // Accuracy targets are for classifiers; images for the vision model.
    let e = parse(&OK.replace(
        "steps = 10",
        "steps = 10
target_accuracy = 0.9",
    ))
    .unwrap_err();
    assert!(e.to_string().contains("only classification workloads"), "{e}");
    let e = parse(&OK.replace(r#"data = { kind = "synthetic", vocab = 64 }"#, r#"data = { kind = "images" }"#)).unwrap_err();
    assert!(e.to_string().contains("image data needs `model.kind = \"vision\"`"), "{e}");
}

#[test]
fn unknown_key_is_an_error_with_location() {
    let bad = OK.replace("seq_len = 16", "seq_len = 16\nsteps_ = 3");
    let e = parse(&bad).unwrap_err();
    assert!(e.0[0].message.contains("unknown field `steps_`"), "{}", e);
    assert_eq!(e.0[0].line_col().unwrap().0, 12);
}
