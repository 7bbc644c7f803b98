//! Optimizers on tiny hand-computed cases, sparse versus dense updates, parameter
//! initialisation, and checkpoint round trips.

use distc_ir::{Init, TensorType};
use distc_runtime::core::checkpoint;
use distc_runtime::core::init::{fans, init_param};
use distc_runtime::cpu::optim::{Optimizer, STEP_KEY};
use distc_runtime::{OptimizerSpec, Slices, Tensor, Value};
use ndarray::{ArrayD, IxDyn};
use std::collections::HashMap;

fn t32(shape: &[usize], v: &[f32]) -> Tensor {
    Tensor::F32(ArrayD::from_shape_vec(IxDyn(shape), v.to_vec()).expect("shape"))
}

fn vals(t: &Tensor) -> Vec<f64> {
    t.to_f64_vec()
}

fn close(a: &[f64], b: &[f64], tol: f64) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= tol, "{a:?} vs {b:?}");
    }
}

fn sgd(lr: f64, momentum: f64) -> OptimizerSpec {
    OptimizerSpec::Sgd { lr, momentum }
}

fn adam() -> OptimizerSpec {
    OptimizerSpec::Adam {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    }
}

fn slices(idx: &[i32], row: usize, v: &[f32], dense: &[usize]) -> Value {
    Value::Slices(Slices {
        indices: idx.to_vec(),
        values: t32(&[idx.len(), row], v),
        dense_shape: dense.to_vec(),
    })
}

#[test]
fn plain_sgd() {
    let mut o = Optimizer::new(&sgd(0.1, 0.0));
    let mut w = t32(&[2], &[1.0, 2.0]);
    o.apply("w", &mut w, &t32(&[2], &[0.5, -1.0]).into(), 1.0)
        .expect("apply");
    close(&vals(&w), &[0.95, 2.1], 1e-7);
    // scale multiplies the gradient first.
    o.apply("w", &mut w, &t32(&[2], &[1.0, 1.0]).into(), 0.5)
        .expect("apply");
    o.end_step();
    close(&vals(&w), &[0.9, 2.05], 1e-6);
    // No slots, just the step count.
    let state = o.state();
    assert_eq!(state.len(), 1);
    assert_eq!(state[0].0, STEP_KEY);
}

#[test]
fn sgd_momentum() {
    let mut o = Optimizer::new(&sgd(0.1, 0.9));
    let mut w = t32(&[2], &[1.0, 2.0]);
    let g: Value = t32(&[2], &[0.5, -1.0]).into();
    o.apply("w", &mut w, &g, 1.0).expect("apply");
    o.end_step();
    // v = g; w = w - 0.1 g
    close(&vals(&w), &[0.95, 2.1], 1e-6);
    o.apply("w", &mut w, &g, 1.0).expect("apply");
    o.end_step();
    // v = 0.9 g + g = 1.9 g; w -= 0.19 g
    close(&vals(&w), &[0.855, 2.29], 1e-6);
    let state = o.state();
    assert_eq!(state[0].0, "w/momentum");
    close(&vals(state[0].1), &[0.95, -1.9], 1e-6);
}

#[test]
fn adam_two_steps() {
    let mut o = Optimizer::new(&adam());
    let mut w = t32(&[2], &[1.0, -2.0]);
    o.apply("w", &mut w, &t32(&[2], &[0.5, -1.0]).into(), 1.0)
        .expect("apply");
    o.end_step();
    close(&vals(&w), &[0.9, -1.9], 1e-6);
    o.apply("w", &mut w, &t32(&[2], &[0.25, 2.0]).into(), 1.0)
        .expect("apply");
    o.end_step();
    close(&vals(&w), &[0.806_782_04, -1.936_610_35], 1e-6);
    let state: HashMap<String, Vec<f64>> =
        o.state().into_iter().map(|(k, t)| (k, vals(t))).collect();
    close(&state["w/m"], &[0.07, 0.11], 1e-6);
    close(&state["w/v"], &[0.000_312_25, 0.004_999], 1e-8);
    close(&state[STEP_KEY], &[2.0], 0.0);
}

#[test]
fn adam_f64() {
    let mut o = Optimizer::new(&adam());
    let mut w = Tensor::F64(ArrayD::from_shape_vec(IxDyn(&[1]), vec![1.0]).expect("shape"));
    let g = Value::Tensor(Tensor::F64(
        ArrayD::from_shape_vec(IxDyn(&[1]), vec![0.5]).expect("s"),
    ));
    o.apply("w", &mut w, &g, 1.0).expect("apply");
    o.end_step();
    close(&vals(&w), &[0.900_000_002], 1e-12);
}

/// AdamW as torch.optim.AdamW: w *= 1 - lr wd, then Adam's step; an exempt variable
/// (and its tensor-parallel part and ZeRO chunk) takes Adam's step alone.
#[test]
fn adamw_decays_decoupled_except_exempt_variables() {
    let spec = OptimizerSpec::Adam {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.5,
    };
    assert_eq!(spec.name(), "adamw");
    let mut o = Optimizer::new(&spec);
    o.exempt_from_decay(&["b".to_string()]);
    let g = Value::Tensor(Tensor::F64(
        ArrayD::from_shape_vec(IxDyn(&[1]), vec![0.5]).expect("s"),
    ));
    let one = || Tensor::F64(ArrayD::from_shape_vec(IxDyn(&[1]), vec![2.0]).expect("shape"));
    let (mut w, mut b, mut b_tp, mut b_zero) = (one(), one(), one(), one());
    o.apply("w", &mut w, &g, 1.0).expect("apply");
    o.apply("b", &mut b, &g, 1.0).expect("apply");
    o.apply("b.tp", &mut b_tp, &g, 1.0).expect("apply");
    o.apply("b.zero", &mut b_zero, &g, 1.0).expect("apply");
    o.end_step();
    // First step: m^ = g, v^ = g^2, so Adam's step is lr * g / (|g| + eps) ~ 0.1.
    let adam_step = 0.1 * 0.5 / (0.5 + 1e-8);
    close(&vals(&w), &[2.0 * (1.0 - 0.1 * 0.5) - adam_step], 1e-12);
    for t in [&b, &b_tp, &b_zero] {
        close(&vals(t), &[2.0 - adam_step], 1e-12);
    }
}

#[test]
fn sparse_sgd_equals_dense_of_scatter() {
    let (rows, row) = (6, 3);
    let idx = [4, 1, 4, 0, 1, 4];
    let v: Vec<f32> = (0..idx.len() * row)
        .map(|k| (k as f32 * 0.37).sin())
        .collect();
    let mut dense = vec![0f32; rows * row];
    for (k, &i) in idx.iter().enumerate() {
        for j in 0..row {
            dense[i as usize * row + j] += v[k * row + j];
        }
    }
    let w0: Vec<f32> = (0..rows * row).map(|k| k as f32 * 0.1 - 0.5).collect();
    let (mut wd, mut ws) = (t32(&[rows, row], &w0), t32(&[rows, row], &w0));
    let (mut od, mut os) = (
        Optimizer::new(&sgd(0.3, 0.0)),
        Optimizer::new(&sgd(0.3, 0.0)),
    );
    for _ in 0..3 {
        od.apply("e", &mut wd, &t32(&[rows, row], &dense).into(), 0.5)
            .expect("dense");
        os.apply("e", &mut ws, &slices(&idx, row, &v, &[rows, row]), 0.5)
            .expect("sparse");
        od.end_step();
        os.end_step();
    }
    assert_eq!(wd, ws);
    // Untouched rows are unchanged.
    assert_eq!(
        vals(&ws)[2 * row..4 * row],
        vals(&t32(&[rows, row], &w0))[2 * row..4 * row]
    );
}

/// Issue 67, item 4: by default a row-sparse gradient of momentum, Adam and AdamW is
/// the dense gradient it stands for, as `torch.optim` applies an `nn.Embedding`'s
/// gradient: bitwise the dense update of the scattered rows, rows the later steps do
/// not touch moving on their slots (AdamW decaying them). It was the lazy update
/// (TensorFlow's LazyAdam), now `set_lazy(true)`, which keeps those rows as they were.
#[test]
fn sparse_gradients_of_stateful_optimizers_take_the_dense_update() {
    let (rows, row) = (6, 3);
    // Step 1 touches rows 0, 1 and 4; the next steps row 4 only.
    let steps: [&[i32]; 3] = [&[4, 1, 4, 0], &[4], &[4, 4]];
    let w0: Vec<f32> = (0..rows * row).map(|k| k as f32 * 0.1 - 0.5).collect();
    let adamw = OptimizerSpec::Adam {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    for spec in [sgd(0.3, 0.9), adam(), adamw] {
        let (mut wd, mut ws, mut wl) = (
            t32(&[rows, row], &w0),
            t32(&[rows, row], &w0),
            t32(&[rows, row], &w0),
        );
        let (mut od, mut os, mut ol) = (
            Optimizer::new(&spec),
            Optimizer::new(&spec),
            Optimizer::new(&spec),
        );
        ol.set_lazy(true);
        for (t, idx) in steps.iter().enumerate() {
            let v: Vec<f32> = (0..idx.len() * row)
                .map(|k| ((k + t * 5) as f32 * 0.37).sin())
                .collect();
            let mut dense = vec![0f32; rows * row];
            for (k, &i) in idx.iter().enumerate() {
                for j in 0..row {
                    dense[i as usize * row + j] += v[k * row + j];
                }
            }
            let g = slices(idx, row, &v, &[rows, row]);
            od.apply("e", &mut wd, &t32(&[rows, row], &dense).into(), 0.5)
                .expect("dense");
            os.apply("e", &mut ws, &g, 0.5).expect("sparse");
            ol.apply("e", &mut wl, &g, 0.5).expect("lazy");
            for o in [&mut od, &mut os, &mut ol] {
                o.end_step();
            }
        }
        assert_eq!(wd, ws, "{spec:?}: the sparse update is not the dense one");
        assert_eq!(od.state(), os.state(), "{spec:?}: slots");
        // Rows 0 and 1, last touched at step 1, moved on after it; lazily they kept
        // their step-1 values, which differ.
        let (dense, lazy) = (vals(&ws), vals(&wl));
        assert!(
            (0..2 * row).all(|k| dense[k] != lazy[k]),
            "{spec:?}: rows 0 and 1 did not move after step 1: {dense:?} and {lazy:?}"
        );
        // Rows 2, 3 and 5 were never touched: lazily they keep their start.
        for r in [2, 3, 5] {
            assert_eq!(
                lazy[r * row..(r + 1) * row],
                vals(&t32(&[rows, row], &w0))[r * row..(r + 1) * row]
            );
        }
    }
}

#[test]
fn duplicate_rows_are_summed() {
    let mut o = Optimizer::new(&sgd(1.0, 0.0));
    let mut w = t32(&[3, 1], &[0.0, 0.0, 0.0]);
    o.apply(
        "e",
        &mut w,
        &slices(&[1, 1, 2], 1, &[1.0, 2.0, 4.0], &[3, 1]),
        1.0,
    )
    .expect("apply");
    close(&vals(&w), &[0.0, -3.0, -4.0], 0.0);
    // Momentum sums first too: v = 3 on row 1 (not 1 then 0.9*1+2).
    let mut o = Optimizer::new(&sgd(1.0, 0.9));
    let mut w = t32(&[3, 1], &[0.0, 0.0, 0.0]);
    o.apply("e", &mut w, &slices(&[1, 1], 1, &[1.0, 2.0], &[3, 1]), 1.0)
        .expect("apply");
    close(&vals(&w), &[0.0, -3.0, 0.0], 0.0);
}

#[test]
fn lazy_sparse_momentum_and_adam() {
    // Momentum: the slot of an untouched row neither decays nor moves its row.
    let mut o = Optimizer::new(&sgd(0.1, 0.9));
    o.set_lazy(true);
    let mut w = t32(&[2, 1], &[1.0, 1.0]);
    o.apply("e", &mut w, &slices(&[0, 1], 1, &[1.0, 1.0], &[2, 1]), 1.0)
        .expect("a");
    o.end_step();
    o.apply("e", &mut w, &slices(&[0], 1, &[1.0], &[2, 1]), 1.0)
        .expect("a");
    o.end_step();
    // row 0: v = 1.9, w = 1 - 0.1 - 0.19; row 1: only the first step.
    close(&vals(&w), &[0.71, 0.9], 1e-6);
    close(&vals(o.state()[0].1), &[1.9, 1.0], 1e-6);
    // Adam: touched rows update like the dense rule with the global t.
    let mut o = Optimizer::new(&adam());
    o.set_lazy(true);
    let mut w = t32(&[3, 2], &[1.0, -2.0, 5.0, 5.0, 7.0, 7.0]);
    o.apply("e", &mut w, &slices(&[0], 2, &[0.5, -1.0], &[3, 2]), 1.0)
        .expect("a");
    o.end_step();
    o.apply("e", &mut w, &slices(&[0], 2, &[0.25, 2.0], &[3, 2]), 1.0)
        .expect("a");
    o.end_step();
    close(
        &vals(&w),
        &[0.806_782_04, -1.936_610_35, 5.0, 5.0, 7.0, 7.0],
        1e-6,
    );
}

#[test]
fn sparse_update_touches_only_rows() {
    // A 100000 x 128 table, 2048 lookups: the update must not pass over the table.
    let (rows, row, nnz) = (100_000, 128, 2048);
    let mut w = Tensor::F32(ArrayD::zeros(IxDyn(&[rows, row])));
    let idx: Vec<i32> = (0..nnz).map(|k| ((k * 7919) % rows) as i32).collect();
    let g = slices(&idx, row, &vec![1.0; nnz * row], &[rows, row]);
    let mut o = Optimizer::new(&sgd(0.1, 0.0));
    o.apply("emb", &mut w, &g, 1.0).expect("warm");
    let start = std::time::Instant::now();
    for _ in 0..20 {
        o.apply("emb", &mut w, &g, 1.0).expect("apply");
    }
    let per = start.elapsed() / 20;
    println!("sparse SGD, {nnz} rows of {row}: {per:?} per apply");
    // A full pass over 12.8M floats takes milliseconds; 2048 rows take microseconds.
    assert!(per < std::time::Duration::from_millis(20), "{per:?}");
    let a = w.as_f32().expect("f32");
    assert!((a[[idx[5] as usize, 3]] + 2.1).abs() < 1e-5);
    assert_eq!(a[[1, 0]], 0.0);
}

#[test]
fn bad_gradients_are_errors() {
    let mut o = Optimizer::new(&sgd(0.1, 0.0));
    let mut w = t32(&[2, 2], &[0.0; 4]);
    let err = o
        .apply("w", &mut w, &t32(&[4], &[0.0; 4]).into(), 1.0)
        .expect_err("shape");
    assert!(err.to_string().contains("`w`"), "{err}");
    let err = o
        .apply("w", &mut w, &slices(&[2], 2, &[1.0, 1.0], &[2, 2]), 1.0)
        .expect_err("index");
    assert!(err.to_string().contains("row index 2"), "{err}");
    let g = Value::Tensor(Tensor::F64(ArrayD::zeros(IxDyn(&[2, 2]))));
    assert!(o.apply("w", &mut w, &g, 1.0).is_err());
}

#[test]
fn optimizer_state_round_trip() {
    let mut o = Optimizer::new(&adam());
    let mut w = t32(&[2], &[1.0, -2.0]);
    o.apply("w", &mut w, &t32(&[2], &[0.5, -1.0]).into(), 1.0)
        .expect("apply");
    o.end_step();
    let saved: HashMap<String, Tensor> =
        o.state().into_iter().map(|(k, t)| (k, t.clone())).collect();
    let mut resumed = Optimizer::new(&adam());
    resumed.load_state(&saved).expect("load");
    assert_eq!(resumed.steps(), 1);
    let mut w2 = w.clone();
    let g: Value = t32(&[2], &[0.25, 2.0]).into();
    o.apply("w", &mut w, &g, 1.0).expect("apply");
    resumed.apply("w", &mut w2, &g, 1.0).expect("apply");
    assert_eq!(w, w2);
}

#[test]
fn init_is_deterministic_per_name() {
    let ty = TensorType::f32(vec![300, 200]);
    let a = init_param("W1", &ty, &Init::Glorot, 7);
    assert_eq!(a, init_param("W1", &ty, &Init::Glorot, 7));
    assert_ne!(a, init_param("W2", &ty, &Init::Glorot, 7));
    assert_ne!(a, init_param("W1", &ty, &Init::Glorot, 8));
    let bound = (6.0f64 / 500.0).sqrt();
    let v = vals(&a);
    assert!(v.iter().all(|x| x.abs() <= bound));
    let var = v.iter().map(|x| x * x).sum::<f64>() / v.len() as f64;
    assert!((var - bound * bound / 3.0).abs() < 0.05 * bound * bound / 3.0);
    // He normal: std sqrt(2/fan_in); conv fans.
    assert_eq!(fans(&[16, 3, 5, 5]), (75, 400));
    assert_eq!(fans(&[10]), (10, 10));
    let h = vals(&init_param(
        "c",
        &TensorType::f32(vec![64, 8, 3, 3]),
        &Init::He,
        1,
    ));
    let var = h.iter().map(|x| x * x).sum::<f64>() / h.len() as f64;
    assert!((var - 2.0 / 72.0).abs() < 0.1 * 2.0 / 72.0, "{var}");
    // f64 variables, constants, uniform bounds.
    let d = init_param(
        "W1",
        &TensorType::new(distc_ir::DType::F64, vec![300, 200]),
        &Init::Glorot,
        7,
    );
    close(&vals(&d), &v, 1e-7);
    assert!(
        vals(&init_param("b", &TensorType::f32(vec![5]), &Init::Zeros, 1))
            .iter()
            .all(|&x| x == 0.0)
    );
    assert!(
        vals(&init_param("g", &TensorType::f32(vec![5]), &Init::Ones, 1))
            .iter()
            .all(|&x| x == 1.0)
    );
    let u = vals(&init_param(
        "e",
        &TensorType::f32(vec![1000]),
        &Init::Uniform {
            lo: -0.05,
            hi: 0.05,
        },
        1,
    ));
    assert!(u.iter().all(|x| (-0.05..=0.05).contains(x)));
    let n = vals(&init_param(
        "n",
        &TensorType::f32(vec![10000]),
        &Init::Normal {
            mean: 3.0,
            std: 0.5,
        },
        1,
    ));
    let mean = n.iter().sum::<f64>() / n.len() as f64;
    assert!((mean - 3.0).abs() < 0.03);
}

#[test]
fn checkpoint_round_trip() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path();
    let path = dir.join("sub").join("model.safetensors");
    let a = t32(&[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.5]);
    let b = Tensor::F64(ArrayD::from_shape_vec(IxDyn(&[2]), vec![0.1, -1e300]).expect("s"));
    let c = Tensor::I32(ArrayD::from_shape_vec(IxDyn(&[3]), vec![-1, 0, i32::MAX]).expect("s"));
    let s = Tensor::F32(ndarray::arr0(2.5f32).into_dyn());
    let meta = HashMap::from([("step".to_string(), "42".to_string())]);
    let params = vec![
        ("a".to_string(), &a),
        ("b".to_string(), &b),
        ("c".to_string(), &c),
        ("emb/m".to_string(), &s),
    ];
    checkpoint::save(&path, &params, meta.clone()).expect("save");
    let (t, m) = checkpoint::load(&path).expect("load");
    assert_eq!(m, meta);
    assert_eq!(t.len(), 4);
    assert_eq!(t["a"], a);
    assert_eq!(t["b"], b);
    assert_eq!(t["c"], c);
    assert_eq!(t["emb/m"], s);
    // Overwriting replaces the file atomically and leaves no temporary behind.
    checkpoint::save(&path, &params[..1], HashMap::new()).expect("save again");
    let (t, m) = checkpoint::load(&path).expect("load");
    assert_eq!((t.len(), m.len()), (1, 0));
    let left: Vec<_> = std::fs::read_dir(path.parent().expect("dir"))
        .expect("ls")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(left.len(), 1, "{left:?}");
    // Errors name the file.
    let missing = dir.join("nope.safetensors");
    let err = checkpoint::load(&missing).expect_err("missing");
    assert!(err.to_string().contains("nope.safetensors"), "{err}");
    std::fs::write(&missing, b"garbage").expect("write");
    let err = checkpoint::load(&missing).expect_err("garbage");
    assert!(err.to_string().contains("nope.safetensors"), "{err}");
    let dup = vec![("a".to_string(), &a), ("a".to_string(), &a)];
    assert!(checkpoint::save(&path, &dup, HashMap::new()).is_err());
}

/// The learning-rate schedules against their formulas written out by hand (issue 25,
/// item 2): warm-up 4 of a 14-update run, then each decay.
#[test]
fn schedule_factors_match_their_formulas() {
    use distc_runtime::{Decay, LrSchedule};
    let s = |decay| LrSchedule { warmup: 4, decay };
    let total = 14;
    let warm = s(Decay::Constant);
    let f: Vec<f64> = (0..6).map(|t| warm.factor(t, total)).collect();
    close(&f, &[0.25, 0.5, 0.75, 1.0, 1.0, 1.0], 1e-15);
    // Cosine to 0: half-way through the 10 updates after the warm-up (t = 9) is 0.5.
    let cos = s(Decay::Cosine { final_factor: 0.0 });
    close(
        &[
            cos.factor(4, total),
            cos.factor(9, total),
            cos.factor(6, total),
        ],
        &[1.0, 0.5, 0.5 * (1.0 + (std::f64::consts::PI * 0.2).cos())],
        1e-12,
    );
    // Quadratic to 0.1: 0.1 + 0.9 * (1 - 0.5)^2 at t = 9.
    let poly = s(Decay::Poly {
        power: 2.0,
        final_factor: 0.1,
    });
    close(&[poly.factor(9, total)], &[0.325], 1e-12);
    // Halved every 3 updates after the warm-up.
    let step = s(Decay::Step {
        every: 3,
        gamma: 0.5,
    });
    let f: Vec<f64> = [4, 6, 7, 10, 13]
        .iter()
        .map(|&t| step.factor(t, total))
        .collect();
    close(&f, &[1.0, 1.0, 0.5, 0.25, 0.125], 1e-15);
    assert!(LrSchedule::default().is_constant() && !warm.is_constant());
    for bad in [
        Decay::Step {
            every: 0,
            gamma: 0.5,
        },
        Decay::Step {
            every: 1,
            gamma: 1.5,
        },
        Decay::Cosine { final_factor: -0.1 },
        Decay::Poly {
            power: 0.0,
            final_factor: 0.0,
        },
    ] {
        assert!(s(bad.clone()).check().is_err(), "{bad:?} accepted");
    }
}

/// SGD with momentum following a schedule: each update is `v = mu v + g; w -= lr_t v`
/// with `lr_t = lr * factor(t)`, computed here step by step; a second optimizer that
/// resumes from the first's state after 3 updates goes on at update 3 of the schedule.
#[test]
fn an_optimizer_follows_its_schedule_and_resumes_mid_schedule() {
    use distc_runtime::{Decay, LrSchedule};
    let schedule = LrSchedule {
        warmup: 2,
        decay: Decay::Cosine { final_factor: 0.1 },
    };
    let (lr, mu, total) = (0.5, 0.9, 6u64);
    let grads = [1.0, -2.0, 0.5, 3.0, -1.0, 2.0];
    let (mut w, mut v) = (1.0f64, 0.0f64);
    let mut want = Vec::new();
    for (t, g) in grads.iter().enumerate() {
        v = mu * v + g;
        w -= lr * schedule.factor(t as u64, total) * v;
        want.push(w);
    }
    let mut opt = Optimizer::new(&sgd(lr, mu));
    opt.follow(&schedule, total);
    let mut p = t32(&[1], &[1.0]);
    let mut got = Vec::new();
    let mut resumed = None;
    for (t, g) in grads.iter().enumerate() {
        if t == 3 {
            let state: HashMap<String, Tensor> = opt
                .state()
                .into_iter()
                .map(|(k, v)| (k, v.clone()))
                .collect();
            let mut o = Optimizer::new(&sgd(lr, mu));
            o.follow(&schedule, total);
            o.load_state(&state).expect("state");
            resumed = Some((o, p.clone()));
        }
        let g = Value::Tensor(t32(&[1], &[*g as f32]));
        opt.apply("w", &mut p, &g, 1.0).expect("apply");
        opt.end_step();
        got.push(vals(&p)[0]);
    }
    close(&got, &want, 1e-5);
    let (mut o, mut q) = resumed.expect("resumed");
    assert!((o.lr() - lr * schedule.factor(3, total)).abs() < 1e-12);
    for g in &grads[3..] {
        o.apply("w", &mut q, &Value::Tensor(t32(&[1], &[*g as f32])), 1.0)
            .expect("apply");
        o.end_step();
    }
    assert_eq!(
        vals(&q),
        vals(&p),
        "the resumed optimizer left its schedule"
    );
}

/// LARS and LAMB (issue 25, item 2) against their papers' updates written out here in
/// f64, over three steps of a 3-element variable, the first from a zero variable (a
/// zero norm: trust ratio 1) for LAMB; a sparse gradient updates as its dense form.
#[test]
fn lars_and_lamb_match_their_formulas() {
    let norm = |x: &[f64]| x.iter().map(|v| v * v).sum::<f64>().sqrt();
    let grads = [[0.5, -1.0, 2.0], [1.5, 0.25, -0.5], [-1.0, 1.0, 0.75]];
    // LARS: d = g + wd w; trust = eta |w| / (|g| + wd |w|); v = mu v + lr trust d; w -= v.
    let (lr, mu, wd, eta) = (0.5, 0.9, 0.01, 0.02);
    let mut w = vec![1.0, -2.0, 0.5];
    let mut v = [0.0; 3];
    let mut want = Vec::new();
    for g in &grads {
        let (nw, ng) = (norm(&w), norm(g));
        let trust = eta * nw / (ng + wd * nw);
        for i in 0..3 {
            v[i] = mu * v[i] + lr * trust * (g[i] + wd * w[i]);
            w[i] -= v[i];
        }
        want.push(w.clone());
    }
    let spec = OptimizerSpec::Lars {
        lr,
        momentum: mu,
        weight_decay: wd,
        trust: eta,
    };
    check_steps(&spec, &[1.0, -2.0, 0.5], &grads, &want);
    // LAMB: Adam's moments with bias correction, r = m^/(sqrt(v^)+eps) + wd w,
    // w -= lr (|w| / |r|) r, with ratio 1 when |w| = 0.
    let (lr, b1, b2, eps, wd) = (0.1, 0.9, 0.999, 1e-6, 0.01);
    let mut w = vec![0.0; 3];
    let (mut m, mut v) = (vec![0.0; 3], vec![0.0; 3]);
    let mut want = Vec::new();
    for (t, g) in grads.iter().enumerate() {
        let t = (t + 1) as i32;
        let mut r = vec![0.0; 3];
        for i in 0..3 {
            m[i] = b1 * m[i] + (1.0 - b1) * g[i];
            v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
            let (mh, vh) = (m[i] / (1.0 - b1.powi(t)), v[i] / (1.0 - b2.powi(t)));
            r[i] = mh / (vh.sqrt() + eps) + wd * w[i];
        }
        let (nw, nr) = (norm(&w), norm(&r));
        let trust = if nw > 0.0 && nr > 0.0 { nw / nr } else { 1.0 };
        for i in 0..3 {
            w[i] -= lr * trust * r[i];
        }
        want.push(w.clone());
    }
    let spec = OptimizerSpec::Lamb {
        lr,
        beta1: b1,
        beta2: b2,
        eps,
        weight_decay: wd,
    };
    check_steps(&spec, &[0.0; 3], &grads, &want);
}

/// Runs `spec` from `w0` over `grads`, one step each, against `want` after each step
/// (f32 variables: within 1e-6 of the f64 reference, relative to its largest element).
fn check_steps(spec: &OptimizerSpec, w0: &[f32], grads: &[[f64; 3]], want: &[Vec<f64>]) {
    let mut opt = Optimizer::new(spec);
    let mut p = t32(&[3], w0);
    for (g, want) in grads.iter().zip(want) {
        let g: Vec<f32> = g.iter().map(|&x| x as f32).collect();
        opt.apply("w", &mut p, &Value::Tensor(t32(&[3], &g)), 1.0)
            .expect("apply");
        opt.end_step();
        let scale = want.iter().fold(0.0f64, |a, b| a.max(b.abs()));
        close(&vals(&p), want, 1e-6 * scale.max(1.0));
    }
    // Rows (repeated ones summed) update as the dense gradient they stand for.
    let rows = Value::Slices(Slices {
        indices: vec![2, 0, 2],
        values: t32(&[3, 1], &[1.0, -2.0, 0.5]),
        dense_shape: vec![3, 1],
    });
    let dense = Value::Tensor(t32(&[3, 1], &[-2.0, 0.0, 1.5]));
    let (mut a, mut b) = (Optimizer::new(spec), Optimizer::new(spec));
    let (mut pa, mut pb) = (
        t32(&[3, 1], &[1.0, 2.0, 3.0]),
        t32(&[3, 1], &[1.0, 2.0, 3.0]),
    );
    for _ in 0..2 {
        a.apply("w", &mut pa, &rows, 1.0).expect("rows");
        b.apply("w", &mut pb, &dense, 1.0).expect("dense");
        a.end_step();
        b.end_step();
    }
    assert_eq!(vals(&pa), vals(&pb), "rows and their dense gradient differ");
}
