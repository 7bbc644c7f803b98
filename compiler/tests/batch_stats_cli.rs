//! Issue 37: statistics over the batch axis written by hand (a batch norm's mean and
//! variance) are each data-parallel worker's own; `compile` says so under data
//! parallelism, naming the nodes, and stays quiet on one device.

mod common;

use common::{distc, s, text};

const MODEL: &str = "model m {
  input x: f32[B, 8]
  input label: i32[B]
  param w: f32[8, 4] = glorot
  param g: f32[4] = ones
  h = x @ w
  mu = mean(h, axes = [0], keep_dims = true)
  var = mean((h - mu) * (h - mu), axes = [0], keep_dims = true)
  minimize softmax_cross_entropy((h - mu) * rsqrt(var + 1e-5) * g, label)
}
train {
  data = gaussian_classes(features = 8, classes = 4)
  batch = 8
  optimizer = sgd(lr = 0.1)
  steps = 3
}
";

#[test]
fn hand_written_batch_statistics_are_a_warning_under_data_parallelism() {
    let dir = tempfile::tempdir().expect("temp dir");
    let m = dir.path().join("bn.dsl");
    std::fs::write(&m, MODEL).expect("writes");
    let plan = dir.path().join("bn.plan.json");
    let o = distc(&["compile", s(&m), "-o", s(&plan)]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(!text(&o).contains("warning"), "{}", text(&o));
    for flags in [
        vec!["--strategy", "allreduce", "--workers", "2"],
        vec!["--strategy", "hybrid", "--workers", "2", "--servers", "1"],
    ] {
        let mut args = vec!["compile", s(&m), "-o", s(&plan)];
        args.extend(flags.iter().copied());
        let o = distc(&args);
        let t = text(&o);
        assert!(o.status.success(), "{t}");
        assert!(
            t.contains("warning: 2 data-parallel replicas"),
            "{flags:?}: {t}"
        );
        assert_eq!(
            t.matches("computes a statistic over the batch axis")
                .count(),
            2,
            "{flags:?}: the mean and the variance: {t}"
        );
    }
}
