//! Evaluation without training (issue 36, item 3): `distc eval` of a run's saved
//! weights (or its training state) gives the metrics the run's own last evaluation
//! gave; `distc predict` writes the model's prediction for a file of inputs, equal to
//! the model computed by hand, whatever the batch (a partial last batch included).

use distc_runtime::core::checkpoint;

mod common;

use common::{distc, s, text};

const MODEL: &str = "model lin {\n  input x: f32[B, 5]\n  input label: i32[B]\n  \
    param w: f32[5, 3] = glorot\n  param b: f32[3] = zeros\n  \
    minimize softmax_cross_entropy(x @ w + b, label)\n}\n\
    train {\n  data = gaussian_classes(features = 5, classes = 3)\n  batch = 8\n  \
    optimizer = sgd(lr = 0.1)\n  steps = 20\n  seed = 4\n  eval_samples = 64\n}\n";

fn last_eval(metrics: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(metrics).expect("metrics");
    let last: serde_json::Value =
        serde_json::from_str(text.lines().last().expect("a line")).expect("json");
    // The metrics line holds the evaluation's fields beside the step's.
    ["eval_loss", "eval_accuracy", "eval_samples", "eval_device"]
        .iter()
        .map(|k| (k.to_string(), last[*k].clone()))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

#[test]
fn eval_of_saved_weights_is_the_runs_own_last_evaluation() {
    let dir = tempfile::tempdir().expect("temp dir");
    let m = dir.path().join("lin.dsl");
    std::fs::write(&m, MODEL).expect("writes");
    let (w, st, metrics) = (
        dir.path().join("w.safetensors"),
        dir.path().join("st.safetensors"),
        dir.path().join("m.jsonl"),
    );
    let o = distc(&[
        "train",
        s(&m),
        "-q",
        "--save",
        s(&w),
        "--checkpoint",
        s(&st),
        "--metrics",
        s(&metrics),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let trained = last_eval(&metrics);
    assert!(trained["eval_loss"].is_number(), "{trained}");
    for weights in [["--init", s(&w)], ["--resume", s(&st)]] {
        let e = dir.path().join("e.jsonl");
        let o = distc(&["eval", s(&m), weights[0], weights[1], "--metrics", s(&e)]);
        assert!(o.status.success(), "{}", text(&o));
        let mut got: serde_json::Value =
            serde_json::from_str(std::fs::read_to_string(&e).expect("written").trim())
                .expect("json");
        // A time, measured: not compared.
        assert!(got["eval_sec"].is_number(), "{got}");
        got.as_object_mut().expect("an object").remove("eval_sec");
        assert_eq!(got, trained, "{weights:?}");
        assert!(text(&o).contains("eval_accuracy"), "{}", text(&o));
    }
    let o = distc(&["eval", s(&m)]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--init"), "{}", text(&o));
    // Issue 60, item 7: weights whose loss is not finite (logits beyond f32) fail,
    // naming the loss; they used to exit 0.
    let (mut weights, meta) = checkpoint::load(&w).expect("weights");
    let big = weights.get_mut("w").expect("w");
    *big = distc_runtime::core::value::Tensor::filled(&big.tensor_type(), 3e38);
    let huge = dir.path().join("huge.safetensors");
    let list: Vec<(String, &distc_runtime::core::value::Tensor)> =
        weights.iter().map(|(k, t)| (k.clone(), t)).collect();
    checkpoint::save(&huge, &list, meta).expect("writes the weights");
    let o = distc(&["eval", s(&m), "--init", s(&huge)]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("do not compute a finite loss"),
        "{}",
        text(&o)
    );
}

#[test]
fn predict_writes_the_models_prediction_for_every_sample() {
    let dir = tempfile::tempdir().expect("temp dir");
    let m = dir.path().join("lin.dsl");
    std::fs::write(&m, MODEL).expect("writes");
    let w = dir.path().join("w.safetensors");
    let o = distc(&["train", s(&m), "-q", "--save", s(&w)]);
    assert!(o.status.success(), "{}", text(&o));
    // 11 samples: one batch of 8 and a partial one; no label (only the loss reads it).
    let n = 11;
    let x: Vec<f32> = (0..n * 5)
        .map(|i| ((i * 37) % 17) as f32 / 8.0 - 1.0)
        .collect();
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let write = |path: &std::path::Path, name: &str| {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![n, 5], &bytes)
                .expect("view");
        safetensors::serialize_to_file(vec![(name, view)], None, path).expect("writes");
    };
    let input = dir.path().join("in.safetensors");
    write(&input, "x");
    let out = dir.path().join("pred.safetensors");
    // `predict` of `input` with `extra` flags into `out`.
    let predict = |input: &std::path::Path, extra: &[&str]| {
        let mut args = vec!["predict", s(&m), "--init", s(&w), "--input", s(input)];
        args.extend(extra);
        args.extend(["-o", s(&out)]);
        distc(&args)
    };
    let predicted = |input: &std::path::Path, extra: &[&str]| {
        let o = predict(input, extra);
        assert!(o.status.success(), "{}", text(&o));
        let (pred, _) = checkpoint::load(&out).expect("loads");
        pred["prediction"].clone()
    };
    let pred = predicted(&input, &[]);
    assert_eq!(pred.shape(), &[n, 3]);
    let (weights, _) = checkpoint::load(&w).expect("weights");
    let (wv, bv) = (weights["w"].to_f64_vec(), weights["b"].to_f64_vec());
    let got = pred.to_f64_vec();
    for i in 0..n {
        for k in 0..3 {
            let want: f64 = (0..5)
                .map(|j| f64::from(x[i * 5 + j]) * wv[j * 3 + k])
                .sum::<f64>()
                + bv[k];
            assert!(
                (got[i * 3 + k] - want).abs() < 1e-5,
                "sample {i}, class {k}: {} against {want}",
                got[i * 3 + k]
            );
        }
    }
    // Issue 60, item 8: a batch far above the samples is not padding to allocate; the
    // predictions are the same.
    let a = predicted(&input, &["--batch", "4294967296"]).to_f64_vec();
    assert_eq!(a.len(), got.len());
    assert!(
        a.iter().zip(&got).all(|(x, y)| (x - y).abs() < 1e-6),
        "another batch predicted otherwise"
    );
    // U8 arrays (scripts/mnist-safetensors.py's images) are read as the `tensors`
    // source reads them: their values, as f32.
    let small: Vec<u8> = (0..n * 5).map(|i| ((i * 7) % 4) as u8).collect();
    let as_f32: Vec<u8> = small
        .iter()
        .flat_map(|&v| f32::from(v).to_le_bytes())
        .collect();
    let (u8_in, f32_in) = (
        dir.path().join("u8.safetensors"),
        dir.path().join("f32.safetensors"),
    );
    for (path, dtype, bytes) in [
        (&u8_in, safetensors::Dtype::U8, &small),
        (&f32_in, safetensors::Dtype::F32, &as_f32),
    ] {
        let view = safetensors::tensor::TensorView::new(dtype, vec![n, 5], bytes).expect("view");
        safetensors::serialize_to_file(vec![("x", view)], None, path).expect("writes");
    }
    assert_eq!(
        predicted(&u8_in, &[]).to_f64_vec(),
        predicted(&f32_in, &[]).to_f64_vec()
    );
    // An input the prediction reads, missing: named.
    let empty = dir.path().join("none.safetensors");
    write(&empty, "features");
    let o = predict(&empty, &[]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("none of the model's inputs") && text(&o).contains("none.safetensors"),
        "{}",
        text(&o)
    );
}

/// Issue 67, item 1: a sequence model's prediction is every position's logits, in the
/// model's own shape [N, T, V], computed by hand here; `predict` wrote [N, V], the
/// first rows of the flattened [N·T, V] logits, and exited 0.
#[test]
fn predict_of_a_sequence_model_writes_every_positions_prediction() {
    let dir = tempfile::tempdir().expect("temp dir");
    let m = dir.path().join("tok.dsl");
    std::fs::write(
        &m,
        "model tok {\n  input tokens: i32[B, 4]\n  input targets: i32[B, 4]\n  \
         param e: f32[6, 3] = uniform(-1, 1)\n  param w: f32[3, 5] = glorot\n  \
         minimize softmax_cross_entropy(embedding(e, tokens) @ w, targets)\n}\n\
         train {\n  data = tensors(path = \"train.safetensors\")\n  batch = 2\n  \
         optimizer = sgd(lr = 0.1)\n  steps = 3\n}\n",
    )
    .expect("writes");
    // Weights of no symmetry, so that a row or class out of place shows.
    let w = dir.path().join("w.safetensors");
    let values = |name: &str, len: usize| -> Vec<u8> {
        (0..len)
            .flat_map(|i| (((i * 7 + name.len()) % 11) as f32 / 5.0 - 1.0).to_le_bytes())
            .collect()
    };
    let (e_bytes, w_bytes) = (values("e", 18), values("wt", 15));
    let views = vec![
        (
            "e",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![6, 3], &e_bytes),
        ),
        (
            "w",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![3, 5], &w_bytes),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k, v.expect("view")));
    safetensors::serialize_to_file(views, None, &w).expect("writes the weights");
    // 3 samples: one batch of 2 and a partial one.
    let (n, t) = (3, 4);
    let tokens: Vec<i32> = (0..n * t).map(|i| ((i * 5 + 1) % 6) as i32).collect();
    let bytes: Vec<u8> = tokens.iter().flat_map(|v| v.to_le_bytes()).collect();
    let input = dir.path().join("in.safetensors");
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::I32, vec![n, t], &bytes)
        .expect("view");
    safetensors::serialize_to_file(vec![("tokens", view)], None, &input).expect("writes");
    let out = dir.path().join("pred.safetensors");
    let o = distc(&[
        "predict",
        s(&m),
        "--init",
        s(&w),
        "--input",
        s(&input),
        "-o",
        s(&out),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("[3, 4, 5] for 3 samples"), "{}", text(&o));
    let (pred, _) = checkpoint::load(&out).expect("loads");
    let pred = &pred["prediction"];
    assert_eq!(pred.shape(), &[n, t, 5]);
    let (weights, _) = checkpoint::load(&w).expect("weights");
    let (ev, wv) = (weights["e"].to_f64_vec(), weights["w"].to_f64_vec());
    let got = pred.to_f64_vec();
    for (row, &tok) in tokens.iter().enumerate() {
        for k in 0..5 {
            let want: f64 = (0..3)
                .map(|j| ev[tok as usize * 3 + j] * wv[j * 5 + k])
                .sum();
            let at = got[row * 5 + k];
            assert!(
                (at - want).abs() < 1e-5,
                "sample {}, position {}, class {k}: {at} against {want}",
                row / t,
                row % t
            );
        }
    }
}

/// Issue 36, item 4: the metrics a train block declares are what an evaluation
/// reports: top-k of all classes is 1, top-1 is the accuracy, perplexity is
/// `exp(eval_loss)`; a metric that does not fit the loss is refused at compile time.
#[test]
fn declared_metrics_are_reported_and_checked_against_the_loss() {
    let dir = tempfile::tempdir().expect("temp dir");
    let m = dir.path().join("lin.dsl");
    let metrics = dir.path().join("m.jsonl");
    for (list, check) in [("[top_k(3), perplexity]", 0), ("[accuracy, top_k(1)]", 1)] {
        let src = MODEL.replace(
            "eval_samples = 64\n",
            &format!("eval_samples = 64\n  metrics = {list}\n"),
        );
        std::fs::write(&m, src).expect("writes");
        let o = distc(&["train", s(&m), "-q", "--metrics", s(&metrics)]);
        assert!(o.status.success(), "{}", text(&o));
        let e = last_eval(&metrics);
        let line: serde_json::Value = serde_json::from_str(
            std::fs::read_to_string(&metrics)
                .expect("m")
                .lines()
                .last()
                .expect("line"),
        )
        .expect("json");
        if check == 0 {
            assert_eq!(line["eval_top_k_accuracy"], 1.0, "{line}");
            assert!(
                line["eval_accuracy"].is_null(),
                "only what is declared: {line}"
            );
            let (p, l) = (
                line["eval_perplexity"].as_f64().expect("perplexity"),
                e["eval_loss"].as_f64().expect("loss"),
            );
            assert!((p - l.exp()).abs() < 1e-9 * p, "{p} against exp({l})");
        } else {
            assert_eq!(line["eval_top_k_accuracy"], line["eval_accuracy"], "{line}");
        }
    }
    std::fs::write(
        &m,
        MODEL.replace(
            "eval_samples = 64\n",
            "eval_samples = 64\n  metrics = [rmse]\n",
        ),
    )
    .expect("writes");
    let o = distc(&["train", s(&m), "-q"]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("`rmse`") && text(&o).contains("(`mse`)"),
        "{}",
        text(&o)
    );
}

/// Issue 37: a batch-normalised model's evaluation reads the running statistics the
/// training moved, not the evaluation batch's own: `eval` of the saved weights is the
/// run's last evaluation, and the same weights with other running statistics evaluate
/// differently.
#[test]
fn eval_of_a_batch_normalised_model_reads_its_running_statistics() {
    let dir = tempfile::tempdir().expect("temp dir");
    let m = dir.path().join("bn.dsl");
    std::fs::write(
        &m,
        MODEL
            .replace("model lin", "model bn")
            .replace(
                "param b: f32[3] = zeros\n",
                "param b: f32[3] = zeros\n  param g: f32[5] = ones\n  param beta: f32[5] = zeros\n",
            )
            .replace("x @ w", "batch_norm(x, g, beta) @ w"),
    )
    .expect("writes");
    let (w, metrics) = (dir.path().join("w.safetensors"), dir.path().join("m.jsonl"));
    let o = distc(&[
        "train",
        s(&m),
        "-q",
        "--save",
        s(&w),
        "--metrics",
        s(&metrics),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let trained = last_eval(&metrics);
    let eval = |weights: &std::path::Path| -> serde_json::Value {
        let e = dir.path().join("e.jsonl");
        let o = distc(&["eval", s(&m), "--init", s(weights), "--metrics", s(&e)]);
        assert!(o.status.success(), "{}", text(&o));
        serde_json::from_str(std::fs::read_to_string(&e).expect("written").trim()).expect("json")
    };
    let got = eval(&w);
    assert_eq!(got["eval_loss"], trained["eval_loss"], "{got} vs {trained}");
    let (mut weights, meta) = checkpoint::load(&w).expect("reads the weights");
    let var = weights
        .get_mut("g_running_var")
        .expect("running variance saved");
    let moved = var.to_f64_vec();
    assert!(
        moved.iter().any(|&v| v != 1.0),
        "the running variance never moved: {moved:?}"
    );
    *var = distc_runtime::core::value::Tensor::filled(&var.tensor_type(), 100.0);
    let other = dir.path().join("other.safetensors");
    let list: Vec<(String, &distc_runtime::core::value::Tensor)> =
        weights.iter().map(|(k, t)| (k.clone(), t)).collect();
    checkpoint::save(&other, &list, meta).expect("writes the weights");
    let changed = eval(&other);
    assert_ne!(
        changed["eval_loss"], got["eval_loss"],
        "evaluation ignored the running variance"
    );
    // Issue 60, item 7: a running variance below 0 evaluated to NaN with exit 0; it
    // is refused by name, by `eval` and by `train --init` alike.
    let var = weights.get_mut("g_running_var").expect("running variance");
    *var = distc_runtime::core::value::Tensor::filled(&var.tensor_type(), -0.5);
    let negative = dir.path().join("negative.safetensors");
    let list: Vec<(String, &distc_runtime::core::value::Tensor)> =
        weights.iter().map(|(k, t)| (k.clone(), t)).collect();
    checkpoint::save(&negative, &list, std::collections::HashMap::new())
        .expect("writes the weights");
    for args in [vec!["eval"], vec!["train", "--steps", "1"]] {
        let cmd = args[0];
        let mut args = args.clone();
        args.extend([s(&m), "--init", s(&negative)]);
        let o = distc(&args);
        assert!(!o.status.success(), "{cmd}: {}", text(&o));
        assert!(
            text(&o).contains("`g_running_var` holds -0.5: a running variance is 0 or more"),
            "{cmd}: {}",
            text(&o)
        );
    }
}

/// Issue 67, item 8: after one step, the running statistics are PyTorch's
/// (`F.batch_norm(training=True, momentum=0.1)`): the mean moved by 0.1 of the batch
/// mean, the variance by 0.1 of the batch's unbiased variance (divided by n - 1), with
/// n the global batch under `sync = true`, computed here from the data. A variance
/// left biased changed only IR snapshots; one worker's n instead of the global batch's
/// is a different number too.
#[test]
fn running_statistics_after_one_step_are_pytorchs_with_the_global_count() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (n, c) = (8, 3);
    // Columns of different scales, so that every channel has its own variance.
    let x: Vec<f32> = (0..n * c)
        .map(|i| (((i * 29 + 3) % 13) as f32 - 6.0) * (1 + i % c) as f32 / 4.0)
        .collect();
    let labels: Vec<i32> = (0..n as i32).map(|i| i % 2).collect();
    let (xb, lb): (Vec<u8>, Vec<u8>) = (
        x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        labels.iter().flat_map(|v| v.to_le_bytes()).collect(),
    );
    let views = vec![
        (
            "x",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![n, c], &xb),
        ),
        (
            "label",
            safetensors::tensor::TensorView::new(safetensors::Dtype::I32, vec![n], &lb),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k, v.expect("view")));
    safetensors::serialize_to_file(views, None, &dir.path().join("d.safetensors")).expect("writes");
    let m = dir.path().join("bn.dsl");
    std::fs::write(
        &m,
        "model bn {\n  input x: f32[B, 3]\n  input label: i32[B]\n  \
         param g: f32[3] = ones\n  param beta: f32[3] = zeros\n  param w: f32[3, 2] = glorot\n  \
         minimize softmax_cross_entropy(batch_norm(x, g, beta, sync = true) @ w, label)\n}\n\
         train {\n  data = tensors(path = \"d.safetensors\", shuffle = false)\n  batch = 8\n  \
         optimizer = sgd(lr = 0.1)\n  steps = 1\n  seed = 2\n}\n",
    )
    .expect("writes");
    let column = |k: usize| -> Vec<f64> { (0..n).map(|i| f64::from(x[i * c + k])).collect() };
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    for (workers, batch) in [("1", "8"), ("2", "4")] {
        let w = dir.path().join(format!("w{workers}.safetensors"));
        let o = distc(&[
            "train",
            s(&m),
            "-q",
            "--data",
            s(dir.path()),
            "--batch",
            batch,
            "--workers",
            workers,
            "--strategy",
            "allreduce",
            "--save",
            s(&w),
        ]);
        assert!(o.status.success(), "{}", text(&o));
        let (saved, _) = checkpoint::load(&w).expect("weights");
        let (rm, rv) = (
            saved["g_running_mean"].to_f64_vec(),
            saved["g_running_var"].to_f64_vec(),
        );
        for k in 0..c {
            let v = column(k);
            let mu = mean(&v);
            let unbiased = v.iter().map(|a| (a - mu).powi(2)).sum::<f64>() / (n - 1) as f64;
            let (want_mean, want_var) = (0.1 * mu, 0.9 + 0.1 * unbiased);
            assert!(
                (rm[k] - want_mean).abs() < 1e-5 && (rv[k] - want_var).abs() < 1e-5 * want_var,
                "{workers} worker(s), channel {k}: running mean {} and variance {}, PyTorch's \
                 {want_mean} and {want_var}",
                rm[k],
                rv[k]
            );
        }
    }
}
