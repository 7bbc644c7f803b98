//! `--mesh` and `--shard` from the command line (issue 23): `explain`'s mesh section, a
//! plan file that runs and saves the whole variables, and bad flags refused by name.

use std::path::PathBuf;

mod common;

use common::{distc, text};

fn tmp(name: &str) -> PathBuf {
    common::temp_dir("mesh-cli").join(name)
}

fn arg(p: &std::path::Path) -> &str {
    p.to_str().expect("utf-8 path")
}

#[test]
fn explain_shows_the_mesh_the_split_variables_and_the_collectives() {
    let plan = tmp("tp.plan.json");
    let o = distc(&[
        "compile",
        "examples/dense_mlp.dsl",
        "--mesh",
        "data=2,model=2",
        "--batch",
        "16",
        "-o",
        arg(&plan),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    // b1 splits with w1's columns (Megatron's column-parallel bias).
    assert!(
        text(&o).contains("split over 2: b1:0 w1:1 w2:0"),
        "{}",
        text(&o)
    );
    let o = distc(&["explain", arg(&plan)]);
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    for want in [
        "mesh: data=2 x model=2 (4 workers): worker w is model rank w % 2 of data rank w / 2",
        "w1         [784,1024]           1 [784,512]",
        "w2         [1024,1024]          0 [512,1024]",
        "model_all_reduce{parts=2}",
        // 2 (T-1)/T x 16 x 1024 x 4 bytes forward and back; b1's gradient stays split.
        "predicted model-axis bytes per step per worker: 64.0 KiB (65536 bytes)",
    ] {
        assert!(t.contains(want), "`{want}` not in:\n{t}");
    }
    // The plan runs from its file; --save holds the whole variables.
    let saved = tmp("tp.safetensors");
    let o = distc(&[
        "run",
        arg(&plan),
        "--steps",
        "2",
        "-q",
        "--save",
        arg(&saved),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let (vars, _) = distc_runtime::core::checkpoint::load(&saved).expect("saved");
    assert_eq!(vars["w1"].shape(), [784, 1024]);
    assert!(!vars.contains_key("w1.tp"));
}

#[test]
fn a_mesh_with_a_pipe_axis_explains_its_coordinates_and_trains_whole_variables() {
    let plan = tmp("tp-pipe.plan.json");
    let o = distc(&[
        "compile",
        "examples/dense_mlp.dsl",
        "--mesh",
        "data=2,model=2,pipe=2",
        "--micro-batches",
        "2",
        "--batch",
        "16",
        "-o",
        arg(&plan),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let o = distc(&["explain", arg(&plan)]);
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    for want in [
        "mesh: data=2 x model=2 x pipe=2 (8 workers): worker w is model rank w % 2 of stage \
         (w / 2) % 2 of data rank w / 4",
        "replicas: 2 (8 workers / 2 stages / 2 model ranks)",
        "w1.tp b1",
        "model_all_reduce{parts=2}",
    ] {
        assert!(t.contains(want), "`{want}` not in:\n{t}");
    }
    let saved = tmp("tp-pipe.safetensors");
    let o = distc(&[
        "run",
        arg(&plan),
        "--steps",
        "2",
        "-q",
        "--save",
        arg(&saved),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let (vars, _) = distc_runtime::core::checkpoint::load(&saved).expect("saved");
    assert_eq!(vars["w1"].shape(), [784, 1024]);
    assert_eq!(vars["w2"].shape(), [1024, 1024]);
    assert!(
        !vars.keys().any(|k| k.ends_with(".tp")),
        "{:?}",
        vars.keys()
    );
}

/// Issue 40, item 2: stages T workers wide write their state whole (each part and each
/// part's Adam slots gathered from the stage's model ranks) and resume it (the parts
/// and their slots cut again): stopped at step 2 and resumed, the run ends bit for bit
/// where the uninterrupted one ends; the state resumes under another layout too.
#[test]
fn stages_on_a_model_axis_write_and_resume_their_state() {
    let plan = tmp("tp-pipe-adam.plan.json");
    let o = distc(&[
        "compile",
        "tests/models/adam_mlp.dsl",
        "--mesh",
        "data=1,model=2,pipe=2",
        "--micro-batches",
        "2",
        "--batch",
        "16",
        "-o",
        arg(&plan),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let (whole, state, resumed) = (
        tmp("tp-pipe-4.st"),
        tmp("tp-pipe.state"),
        tmp("tp-pipe-r.st"),
    );
    for args in [
        vec!["--steps", "4", "--save", arg(&whole)],
        vec!["--steps", "2", "--checkpoint", arg(&state)],
        vec![
            "--steps",
            "4",
            "--resume",
            arg(&state),
            "--save",
            arg(&resumed),
        ],
    ] {
        let mut all = vec!["run", arg(&plan), "-q"];
        all.extend(args);
        let o = distc(&all);
        assert!(o.status.success(), "{all:?}: {}", text(&o));
    }
    assert_eq!(common::max_difference(&whole, &resumed), 0.0);
    let s = distc_runtime::core::checkpoint::load_state(&state).expect("the state");
    assert_eq!(s.index.step, 2);
    assert!(
        !s.params
            .keys()
            .chain(s.optimizer.keys())
            .any(|k| k.contains(".tp")),
        "{:?}",
        s.index
    );
    for var in s.params.keys() {
        for slot in ["m", "v"] {
            let t = &s.optimizer[&format!("{var}/{slot}")];
            assert_eq!(t.shape(), s.params[var].shape(), "{var}/{slot}");
        }
    }
    // Another layout resumes it.
    let o = distc(&[
        "train",
        "tests/models/adam_mlp.dsl",
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--batch",
        "16",
        "-q",
        "--steps",
        "4",
        "--resume",
        arg(&state),
    ]);
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn bad_meshes_and_shards_are_refused_by_name() {
    for (args, want) in [
        (vec!["--mesh", "data=2,modle=2"], "`modle` is not an axis"),
        (vec!["--mesh", "data=2,model=0"], "0 is not allowed"),
        (
            vec!["--mesh", "model=2", "--workers", "2"],
            "cannot be used with",
        ),
        (vec!["--shard", "w1=1"], "--mesh"),
        (
            vec!["--mesh", "model=3", "--shard", "w1=1"],
            "`w1` (f32[784,1024]) does not split into 3 equal parts",
        ),
        (
            vec!["--mesh", "model=3"],
            "the Megatron rule found no pair of matmuls",
        ),
        (
            vec!["--mesh", "model=2", "--shard", "w9=0"],
            "no variable of that name",
        ),
        (
            vec!["--mesh", "model=2", "--shard", "w1=2"],
            "`w1` (f32[784,1024]) is sharded along dimension 2",
        ),
        (
            vec![
                "--mesh",
                "data=2,model=2,pipe=2",
                "--strategy",
                "allreduce",
                "--zero",
                "3",
            ],
            "--zero 3 with --pipeline is not supported yet",
        ),
        (
            vec!["--mesh", "model=2,pipe=64"],
            "too few to cut into 64 stages",
        ),
    ] {
        let never = tmp("never.plan.json");
        let mut a = vec!["compile", "examples/dense_mlp.dsl", "-o", arg(&never)];
        a.extend(args.iter().copied());
        let o = distc(&a);
        assert!(!o.status.success(), "{args:?} compiled");
        assert!(
            text(&o).contains(want),
            "{args:?}: `{want}` not in {}",
            text(&o)
        );
        assert!(!text(&o).contains("panicked"), "{args:?}: {}", text(&o));
        assert!(!never.exists(), "{args:?} wrote a plan");
    }
}
