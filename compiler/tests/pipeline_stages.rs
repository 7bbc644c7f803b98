//! Pipeline stages (issue 22): the cut of a trained graph into P stages, on models
//! written here and on every example.

use distc::{compile, compile_file, CompileOptions};
use distc_ir::{Graph, Op};
use distc_passes::pipeline::stages::{partition, Direction, StageError, StagePlan};

/// An MLP of `layers` equal hidden layers on synthetic data.
fn deep_mlp(layers: usize, width: usize) -> String {
    let mut s = format!("model deep {{\n  input x: f32[B, {width}]\n  input label: i32[B]\n");
    for k in 0..layers {
        s += &format!(
            "  param w{k}: f32[{width}, {width}] = glorot\n  param b{k}: f32[{width}] = zeros\n"
        );
    }
    s += &format!("  param wo: f32[{width}, 10] = glorot\n");
    s += "  h0 = x\n";
    for k in 0..layers {
        s += &format!("  h{} = relu(h{k} @ w{k} + b{k})\n", k + 1);
    }
    s += &format!("  minimize softmax_cross_entropy(h{layers} @ wo, label)\n}}\n");
    s += &format!(
        "train {{\n  data = gaussian_classes(features = {width}, classes = 10)\n  batch = 32\n  optimizer = sgd(lr = 0.1)\n  steps = 3\n  seed = 5\n}}\n"
    );
    s
}

fn worker(src: &str) -> Graph {
    compile("test.dsl", src, &CompileOptions::default())
        .unwrap_or_else(|e| panic!("{e}"))
        .programs
        .worker
}

fn stage_of_var(plan: &StagePlan, g: &Graph, name: &str) -> Vec<usize> {
    let (id, _, _) = g
        .params()
        .into_iter()
        .find(|(_, n, _)| *n == name)
        .unwrap_or_else(|| panic!("no `{name}`"));
    plan.readers.get(&id).cloned().unwrap_or_default()
}

#[test]
fn a_deep_mlp_is_cut_into_balanced_contiguous_stages() {
    let layers = 8;
    let g = worker(&deep_mlp(layers, 64));
    for p in [1, 2, 4, 8] {
        let plan = partition(&g, p).unwrap_or_else(|e| panic!("P = {p}: {e}"));
        for (s, st) in plan.stats.iter().enumerate() {
            println!("P = {p}: stage {s}: {st:?}");
        }
        assert!(plan.tied.is_empty(), "P = {p}: {:?}", plan.tied);
        // Each layer's variables on one stage, in layer order, every stage used.
        let mut last = 0;
        let mut used = vec![false; p];
        for k in 0..layers {
            for v in [format!("w{k}"), format!("b{k}")] {
                let held = stage_of_var(&plan, &g, &v);
                assert_eq!(held.len(), 1, "P = {p}: `{v}` held by {held:?}");
                assert!(
                    held[0] >= last,
                    "P = {p}: `{v}` on {} after {last}",
                    held[0]
                );
                last = held[0];
                used[held[0]] = true;
            }
        }
        assert!(
            used.iter().all(|u| *u),
            "P = {p}: a stage holds no layer: {used:?}"
        );
        // Balanced: the heaviest stage within one layer of the mean.
        let total: f64 = plan.stats.iter().map(|s| s.forward_flops).sum();
        let layer = 2.0 * 32.0 * 64.0 * 64.0;
        for (s, st) in plan.stats.iter().enumerate() {
            assert!(
                st.forward_flops <= total / p as f64 + 1.5 * layer,
                "P = {p}: stage {s} has {} of {total} flops",
                st.forward_flops
            );
        }
        // A chain: activations go to the next stage, gradients to the one before,
        // each one [B, 64] f32 per micro-batch (plus the labels' gradient-free path).
        for c in &plan.crossings {
            match c.direction {
                Direction::Forward => assert_eq!(c.to, c.from + 1, "P = {p}: {c:?}"),
                Direction::Backward => assert_eq!(c.to + 1, c.from, "P = {p}: {c:?}"),
            }
            assert_eq!(c.bytes, 32 * 64 * 4, "P = {p}: {c:?}");
        }
        if p > 1 {
            assert!(plan
                .crossings
                .iter()
                .any(|c| c.direction == Direction::Backward));
        }
        // Every backward kernel of a layer is on the stage of its variables.
        for id in g.node_ids() {
            if let Op::ParamGrad { param } = g.op(id) {
                let held = stage_of_var(&plan, &g, param);
                let producer = g.node(id).inputs[0].node;
                assert_eq!(
                    plan.stage_of.get(&producer),
                    held.first(),
                    "P = {p}: the gradient of `{param}`"
                );
            }
        }
    }
}

#[test]
fn a_tied_embedding_is_held_by_both_ends() {
    let src = "model tied {
  input ids: i32[B, 4]
  input label: i32[B]
  param emb: f32[100, 16] = uniform(-0.1, 0.1)
  param w1: f32[64, 64] = glorot
  param w2: f32[64, 16] = glorot
  x = reshape(embedding(emb, ids), [B, 64])
  h1 = tanh(x @ w1)
  h2 = tanh(h1 @ w2)
  minimize softmax_cross_entropy(h2 @ transpose(emb), label)
}
train {
  data = zipf_tokens(vocab = 100, context = 4, classes = 100, s = 1.1)
  batch = 8
  optimizer = sgd(lr = 0.1)
  steps = 2
  seed = 1
}
";
    let g = match compile("tied.dsl", src, &CompileOptions::default()) {
        Ok(c) => c.programs.worker,
        Err(e) => panic!("{e}"),
    };
    let plan = partition(&g, 2).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(plan.tied, vec![("emb".to_string(), vec![0, 1])]);
    assert!(plan.stats[0].variables.contains(&"emb".to_string()));
    assert!(plan.stats[1].variables.contains(&"emb".to_string()));
}

#[test]
fn every_example_cuts_in_two_and_too_many_stages_are_refused() {
    for name in [
        "mlp.dsl",
        "dense_mlp.dsl",
        "cnn.dsl",
        "lm.dsl",
        "sparse_lm.dsl",
        "recsys.dsl",
    ] {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../examples")
            .join(name);
        let g = compile_file(&path, &CompileOptions::default())
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .programs
            .worker;
        let plan = partition(&g, 2).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            plan.stats
                .iter()
                .all(|s| s.forward_flops > 0.0 || !s.variables.is_empty()),
            "{name}: {:?}",
            plan.stats
        );
        // Every kernel and sink has a stage; every crossing's stages differ.
        for id in g.node_ids() {
            if !g.op(id).is_source() {
                assert!(plan.stage_of.contains_key(&id), "{name}: {id} has no stage");
            }
        }
        assert!(plan.crossings.iter().all(|c| c.from != c.to));
        match partition(&g, 10_000) {
            Err(StageError::TooFewKernels { stages: 10_000, .. }) => {}
            other => panic!("{name}: 10000 stages: {other:?}"),
        }
    }
    let g = worker(&deep_mlp(2, 8));
    assert_eq!(partition(&g, 0), Err(StageError::NoStages));
}
