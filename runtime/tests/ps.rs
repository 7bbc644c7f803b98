//! Parameter servers: sync/async/stale semantics, sharding, byte counts, errors.

use distc_ir::{DType, Init, TensorType};
use distc_runtime::core::init::init_param;
use distc_runtime::cpu::optim::Optimizer;
use distc_runtime::ps::{self, PsConfig, PsSync, ShardSpec};
use distc_runtime::{OptimizerSpec, Slices, Tensor, Value};
use ndarray::{ArrayD, Axis, IxDyn};
use std::sync::mpsc;
use std::time::Duration;

const SEED: u64 = 7;

fn spec(var: &str, dims: &[usize], start: usize, end: usize) -> ShardSpec {
    ShardSpec {
        var: var.into(),
        full: TensorType::f32(dims.to_vec()),
        init: Init::Uniform { lo: -1.0, hi: 1.0 },
        start,
        end,
    }
}

fn init(var: &str, dims: &[usize]) -> ArrayD<f32> {
    let t = init_param(
        var,
        &TensorType::f32(dims.to_vec()),
        &Init::Uniform { lo: -1.0, hi: 1.0 },
        SEED,
    );
    t.as_f32().cloned().expect("f32")
}

fn arr(dims: &[usize], f: impl Fn(usize) -> f32) -> ArrayD<f32> {
    let n: usize = dims.iter().product();
    ArrayD::from_shape_vec(IxDyn(dims), (0..n).map(f).collect()).expect("shape")
}

fn slices(ids: &[i32], rows: usize, width: usize, f: impl Fn(usize) -> f32) -> Slices {
    Slices {
        indices: ids.to_vec(),
        values: Tensor::F32(arr(&[ids.len(), width], f)),
        dense_shape: vec![rows, width],
    }
}

fn f32s(t: &Tensor) -> &ArrayD<f32> {
    t.as_f32().expect("f32")
}

fn close(a: &ArrayD<f32>, b: &ArrayD<f32>, tol: f32) {
    assert_eq!(a.shape(), b.shape());
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= tol, "{x} vs {y}\n{a}\n{b}");
    }
}

fn sgd(lr: f64) -> OptimizerSpec {
    OptimizerSpec::Sgd { lr, momentum: 0.0 }
}

/// Table `emb` [6,4] on servers 0 (rows 0..3) and 1 (rows 3..6); `w` [3,2] whole on 1.
fn two_servers() -> Vec<Vec<ShardSpec>> {
    vec![
        vec![spec("emb", &[6, 4], 0, 3)],
        vec![spec("emb", &[6, 4], 3, 6), spec("w", &[3, 2], 0, 3)],
    ]
}
const EMB: &[(usize, usize, usize)] = &[(1, 3, 6), (0, 0, 3)];
const W: &[(usize, usize, usize)] = &[(1, 0, 3)];

fn cfg(sync: PsSync, optimizer: OptimizerSpec) -> PsConfig {
    PsConfig {
        workers: 2,
        sync,
        optimizer,
        lr_schedule: Default::default(),
        total_steps: 1,
        no_decay: Vec::new(),
        lazy_updates: false,
        seed: SEED,
        resume: None,
    }
}

#[test]
fn sync_sgd_mean_of_workers() {
    let mut cluster = ps::start(two_servers(), cfg(PsSync::Sync, sgd(0.1))).expect("start");
    let (mut c0, mut c1) = (cluster.client(0), cluster.client(1));
    let w0 = c0.pull("w", W, 1).expect("pull");
    assert_eq!(f32s(&w0), &init("w", &[3, 2]));
    let e0 = c1.pull("emb", EMB, 1).expect("pull");
    assert_eq!(f32s(&e0), &init("emb", &[6, 4]));

    let g0 = arr(&[3, 2], |i| i as f32 * 0.5);
    let g1 = arr(&[3, 2], |i| 1.0 - i as f32);
    // Worker 0 touches rows 0, 4, 4 (a duplicate), worker 1 rows 4, 2.
    let s0 = slices(&[0, 4, 4], 6, 4, |i| 0.1 * i as f32);
    let s1 = slices(&[4, 2], 6, 4, |i| 1.0 + i as f32);
    c0.push("w", W, &Tensor::F32(g0.clone()), 1).expect("push");
    c0.sparse_push("emb", EMB, &s0, 1).expect("push");

    // Worker 0's pull of step 2 waits for worker 1's pushes of step 1.
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        let w = c0.pull("w", W, 2);
        let e = c0.pull("emb", EMB, 2);
        tx.send(()).expect("send");
        (w, e, c0)
    });
    assert!(
        rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "pull of step 2 did not wait"
    );
    c1.push("w", W, &Tensor::F32(g1.clone()), 1).expect("push");
    c1.sparse_push("emb", EMB, &s1, 1).expect("push");
    rx.recv_timeout(Duration::from_secs(10))
        .expect("pull of step 2 returned");
    let (w, e, _c0) = h.join().expect("join");

    let lr = 0.1f32;
    let want_w = init("w", &[3, 2]) - (&g0 + &g1).mapv(|g| lr * (g * 0.5));
    close(f32s(&w.expect("pull w")), &want_w, 1e-6);

    let mut want_e = init("emb", &[6, 4]);
    let (v0, v1) = (f32s(&s0.values), f32s(&s1.values));
    let mut gsum = ArrayD::<f32>::zeros(IxDyn(&[6, 4]));
    for (k, &i) in s0.indices.iter().enumerate() {
        for j in 0..4 {
            gsum[[i as usize, j]] += v0[[k, j]];
        }
    }
    for (k, &i) in s1.indices.iter().enumerate() {
        for j in 0..4 {
            gsum[[i as usize, j]] += v1[[k, j]];
        }
    }
    want_e = want_e - gsum.mapv(|g| lr * (g * 0.5));
    let e = e.expect("pull emb");
    close(f32s(&e), &want_e, 1e-6);

    // sparse_pull: rows in id order, repeats allowed.
    let ids = [4, 0, 4, 5, 1];
    let rows = c1.sparse_pull("emb", EMB, &ids, 2).expect("sparse_pull");
    assert_eq!(rows.shape(), &[5, 4]);
    for (k, &i) in ids.iter().enumerate() {
        for j in 0..4 {
            assert_eq!(f32s(&rows)[[k, j]], f32s(&e)[[i as usize, j]]);
        }
    }

    let all = cluster.shutdown().expect("shutdown");
    close(f32s(&all["w"]), &want_w, 1e-6);
    close(f32s(&all["emb"]), &want_e, 1e-6);
}

#[test]
fn shard_init_matches_full_variable() {
    let shards = vec![
        vec![spec("emb", &[10, 3], 0, 4), spec("b", &[5], 0, 5)],
        vec![spec("emb", &[10, 3], 4, 7)],
        vec![spec("emb", &[10, 3], 7, 10), spec("s", &[], 0, 1)],
    ];
    let mut cluster = ps::start(shards, cfg(PsSync::Sync, sgd(0.1))).expect("start");
    let mut c = cluster.client(0);
    let emb = c
        .pull("emb", &[(2, 7, 10), (0, 0, 4), (1, 4, 7)], 1)
        .expect("pull");
    assert_eq!(f32s(&emb), &init("emb", &[10, 3]));
    let s = c.pull("s", &[(2, 0, 1)], 1).expect("pull scalar");
    assert_eq!(f32s(&s), &init("s", &[]));
    let all = cluster.shutdown().expect("shutdown");
    assert_eq!(all.len(), 3);
    assert_eq!(f32s(&all["emb"]), &init("emb", &[10, 3]));
    assert_eq!(f32s(&all["b"]), &init("b", &[5]));
    assert_eq!(f32s(&all["s"]), &init("s", &[]));
}

#[test]
fn sync_adam_equals_single_device_mean() {
    let adam = OptimizerSpec::Adam {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    let shards = vec![
        vec![spec("a", &[5, 3], 0, 2), spec("t", &[6, 4], 0, 4)],
        vec![spec("a", &[5, 3], 2, 5), spec("t", &[6, 4], 4, 6)],
    ];
    let a_sh = [(0, 0, 2), (1, 2, 5)];
    let t_sh = [(0, 0, 4), (1, 4, 6)];
    let mut cluster = ps::start(shards, cfg(PsSync::Sync, adam.clone())).expect("start");
    let mut clients = [cluster.client(0), cluster.client(1)];
    let mut reference = Optimizer::new(&adam);
    let mut a_ref = Tensor::F32(init("a", &[5, 3]));
    let mut t_ref = Tensor::F32(init("t", &[6, 4]));
    for step in 1..=4u64 {
        let mut dense_sum: Option<ArrayD<f32>> = None;
        let mut idx = Vec::new();
        let mut vals = Vec::new();
        for (r, c) in clients.iter_mut().enumerate() {
            c.pull("a", &a_sh, step).expect("pull");
            let s = step as f32;
            let g = arr(&[5, 3], |i| ((i + r) as f32 * 0.37 + s).sin());
            // Rows touched vary by step; step 3 touches only the first shard.
            let ids: Vec<i32> = match (step, r) {
                (3, _) => vec![1, 3, 1],
                (_, 0) => vec![0, 5, 5, 2],
                _ => vec![5, step as i32 % 6],
            };
            let sl = slices(&ids, 6, 4, |i| ((i + 3 * r) as f32 * 0.11 - s).cos());
            c.push("a", &a_sh, &Tensor::F32(g.clone()), step)
                .expect("push");
            c.sparse_push("t", &t_sh, &sl, step).expect("push");
            dense_sum = Some(match dense_sum {
                None => g,
                Some(acc) => acc + &g,
            });
            idx.extend_from_slice(&sl.indices);
            vals.extend(f32s(&sl.values).iter().copied());
        }
        let dense = Value::Tensor(Tensor::F32(dense_sum.expect("sum")));
        reference
            .apply("a", &mut a_ref, &dense, 0.5)
            .expect("apply");
        let n = idx.len();
        let sparse = Value::Slices(Slices {
            indices: idx,
            values: Tensor::F32(ArrayD::from_shape_vec(IxDyn(&[n, 4]), vals).expect("shape")),
            dense_shape: vec![6, 4],
        });
        reference
            .apply("t", &mut t_ref, &sparse, 0.5)
            .expect("apply");
        reference.end_step();
    }
    let got = clients[1].pull("a", &a_sh, 5).expect("pull");
    assert_eq!(f32s(&got), f32s(&a_ref));
    let all = cluster.shutdown().expect("shutdown");
    assert_eq!(f32s(&all["a"]), f32s(&a_ref));
    assert_eq!(f32s(&all["t"]), f32s(&t_ref));
}

#[test]
fn async_applies_on_arrival() {
    let mut cluster = ps::start(two_servers(), cfg(PsSync::Async, sgd(0.05))).expect("start");
    let mut c0 = cluster.client(0);
    let mut c1 = cluster.client(1);
    let mut want = init("w", &[3, 2]);
    let g = |r: usize, s: u64| arr(&[3, 2], move |i| (i * (r + 1)) as f32 + s as f32);
    // Worker 0 runs three steps ahead without waiting for worker 1.
    for s in 1..=3 {
        c0.pull("w", W, s).expect("pull never waits");
        c0.push("w", W, &Tensor::F32(g(0, s)), s).expect("push");
        want = want - g(0, s).mapv(|x| 0.05 * (x * 0.5));
    }
    // Applied on arrival: worker 1 sees worker 0's three updates.
    let seen = c1.pull("w", W, 1).expect("pull");
    close(f32s(&seen), &want, 1e-5);
    c1.push("w", W, &Tensor::F32(g(1, 1)), 1).expect("push");
    want = want - g(1, 1).mapv(|x| 0.05 * (x * 0.5));
    let all = cluster.shutdown().expect("shutdown");
    close(f32s(&all["w"]), &want, 1e-5);
    assert_eq!(f32s(&all["emb"]), &init("emb", &[6, 4]));
}

#[test]
fn stale_bounds_the_lead() {
    let mut cluster = ps::start(two_servers(), cfg(PsSync::Stale(1), sgd(0.1))).expect("start");
    let mut a = cluster.client(0);
    let mut b = cluster.client(1);
    let g = Tensor::F32(arr(&[3, 2], |_| 1.0));
    b.pull("w", W, 1).expect("pull");
    b.push("w", W, &g, 1).expect("push");
    for s in 1..=3 {
        // Step 3 needs everyone's step 1: b has pushed it, so no wait.
        a.pull("w", W, s).expect("pull");
        a.push("w", W, &g, s).expect("push");
    }
    // Step 4 needs everyone's step 2: a blocks until b pushes it.
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        let r = a.pull("w", W, 4);
        tx.send(()).expect("send");
        r
    });
    assert!(
        rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "pull of step 4 did not wait"
    );
    b.pull("w", W, 2).expect("pull");
    b.push("w", W, &g, 2).expect("push");
    rx.recv_timeout(Duration::from_secs(10))
        .expect("pull of step 4 returned");
    let seen = h.join().expect("join").expect("pull");
    // 5 pushes of ones, each scaled by 1/2.
    let mut want = init("w", &[3, 2]);
    for _ in 0..5 {
        want = want.mapv(|x| x - 0.1 * 0.5);
    }
    close(f32s(&seen), &want, 1e-6);
    cluster.shutdown().expect("shutdown");
}

#[test]
fn byte_counts_of_sparse_traffic() {
    let shards = vec![
        vec![spec("tab", &[100, 128], 0, 50)],
        vec![spec("tab", &[100, 128], 50, 100)],
    ];
    let sh = [(0, 0, 50), (1, 50, 100)];
    let mut cluster = ps::start(shards, cfg(PsSync::Async, sgd(0.1))).expect("start");
    let mut c = cluster.client(0);
    let ids = [3, 77, 3, 51, 0, 77, 77];
    let d = 4u64;
    let rows = c.sparse_pull("tab", &sh, &ids, 1).expect("sparse_pull");
    assert_eq!(rows.shape(), &[7, 128]);
    assert_eq!(c.bytes(), (8 * d, 512 * d));
    let grad = slices(&ids, 100, 128, |i| i as f32);
    c.sparse_push("tab", &sh, &grad, 1).expect("sparse_push");
    assert_eq!(c.bytes(), (8 * d + (8 + 512) * d, 512 * d));
    let mut c1 = cluster.client(1);
    c1.push(
        "tab",
        &sh,
        &Tensor::F32(ArrayD::zeros(IxDyn(&[100, 128]))),
        1,
    )
    .expect("push");
    assert_eq!(c1.bytes(), (100 * 512, 0));
    c1.pull("tab", &sh, 2).expect("pull");
    assert_eq!(c1.bytes(), (100 * 512, 100 * 512));
    let busy = cluster.stop().expect("shutdown").busy;
    assert_eq!(busy.len(), 2);
    assert!(busy.iter().all(|b| *b > Duration::ZERO), "{busy:?}");
}

/// A float64 copy of a model (`--dtype f64`) keeps float64 on the servers: rows pulled
/// as the variable's f64 initial values, a sparse push's duplicate rows summed in f64,
/// and the wire counting 8 bytes an element.
#[test]
fn float64_shards_pull_and_push_in_float64() {
    let ty = TensorType::new(DType::F64, vec![10, 3]);
    let shard = |start, end| ShardSpec {
        full: ty.clone(),
        ..spec("tab", &[10, 3], start, end)
    };
    let sh = [(0, 0, 4), (1, 4, 10)];
    let mut cluster = ps::start(
        vec![vec![shard(0, 4)], vec![shard(4, 10)]],
        PsConfig {
            workers: 1,
            ..cfg(PsSync::Sync, sgd(0.5))
        },
    )
    .expect("start");
    let mut c = cluster.client(0);
    let whole = init_param("tab", &ty, &Init::Uniform { lo: -1.0, hi: 1.0 }, SEED);
    let whole = whole.as_f64().expect("f64 init").clone();
    let ids = [8, 1, 8];
    let rows = c.sparse_pull("tab", &sh, &ids, 1).expect("sparse_pull");
    let rows = rows.as_f64().expect("f64 rows");
    for (k, &id) in ids.iter().enumerate() {
        assert_eq!(
            rows.index_axis(Axis(0), k),
            whole.index_axis(Axis(0), id as usize)
        );
    }
    assert_eq!(c.bytes(), (8 * 2, 8 * 3 * 2));
    // 1e-12 is below f32's resolution at 1 (6e-8): it survives only in f64.
    let grad = Slices {
        indices: ids.to_vec(),
        values: Tensor::F64(ArrayD::from_elem(IxDyn(&[3, 3]), 1.0 + 1e-12)),
        dense_shape: vec![10, 3],
    };
    c.sparse_push("tab", &sh, &grad, 1).expect("sparse_push");
    assert_eq!(c.bytes(), (8 * 2 + 2 * (8 + 8 * 3), 8 * 3 * 2));
    let after = c.pull("tab", &sh, 2).expect("pull");
    let after = after.as_f64().expect("f64 pull");
    let step = |n: f64| 0.5 * n * (1.0 + 1e-12);
    for col in 0..3 {
        assert_eq!(after[[8, col]], whole[[8, col]] - step(2.0));
        assert_eq!(after[[1, col]], whole[[1, col]] - step(1.0));
        assert_eq!(after[[0, col]], whole[[0, col]]);
    }
    cluster.shutdown().expect("shutdown");
}

#[test]
// `expect_err` needs the cluster to be `Debug`; it holds threads and links.
#[allow(clippy::err_expect)]
fn errors_name_server_variable_and_id() {
    // 16-bit variables are refused: masters are f32 (or f64 for a float64 copy).
    let mut half_spec = spec("d", &[4], 0, 4);
    half_spec.full = TensorType::new(DType::BF16, vec![4]);
    let e = ps::start(vec![vec![half_spec]], cfg(PsSync::Sync, sgd(0.1)))
        .err()
        .expect("bf16 refused")
        .to_string();
    assert!(e.contains("bf16 variables are not served"), "{e}");
    // Rows on no server.
    let e = ps::start(
        vec![vec![spec("x", &[6, 2], 0, 4)]],
        cfg(PsSync::Sync, sgd(0.1)),
    )
    .err()
    .expect("gap refused")
    .to_string();
    assert!(e.contains("`x`") && e.contains("4..6"), "{e}");

    let mut cluster = ps::start(two_servers(), cfg(PsSync::Sync, sgd(0.1))).expect("start");
    let mut c = cluster.client(0);
    let e = c
        .pull("nope", &[(0, 0, 3)], 1)
        .expect_err("unknown")
        .to_string();
    assert!(e.contains("`nope`") && e.contains("server 0"), "{e}");
    let e = c
        .sparse_pull("emb", EMB, &[1, 6], 1)
        .expect_err("range")
        .to_string();
    assert!(e.contains("`emb`") && e.contains("id 6"), "{e}");
    let e = c
        .sparse_pull("emb", EMB, &[-1], 1)
        .expect_err("range")
        .to_string();
    assert!(e.contains("id -1"), "{e}");
    // A push the server rejects: the next call names the server and the variable.
    let mut bad = cluster.client(1);
    let odd = Slices {
        indices: vec![0],
        values: Tensor::F32(arr(&[1, 4], |_| 1.0)),
        dense_shape: vec![6, 4],
    };
    bad.sparse_push("emb", EMB, &odd, 1).expect("sent");
    bad.sparse_push("emb", EMB, &odd, 1).expect("sent");
    c.sparse_push("emb", EMB, &odd, 1).expect("sent");
    // Worker 1's second push of step 1 is accumulated; step 1 completes with
    // worker 0's. A third push of step 1 arrives late and fails the server.
    bad.sparse_push("emb", EMB, &odd, 1).expect("sent");
    let e = c
        .pull("emb", EMB, 2)
        .expect_err("failed server")
        .to_string();
    assert!(e.contains("parameter server") && e.contains("`emb`"), "{e}");
    let e = c.pull("w", W, 1).expect_err("failed server").to_string();
    assert!(e.contains("parameter server") && e.contains("`emb`"), "{e}");
    let e = cluster
        .shutdown()
        .expect_err("shutdown reports")
        .to_string();
    assert!(e.contains("`emb`"), "{e}");
}

#[test]
fn incomplete_sync_step_is_reported() {
    let mut cluster = ps::start(two_servers(), cfg(PsSync::Sync, sgd(0.1))).expect("start");
    let mut c = cluster.client(0);
    c.push("w", W, &Tensor::F32(arr(&[3, 2], |_| 1.0)), 1)
        .expect("push");
    let e = cluster.shutdown().expect_err("incomplete").to_string();
    assert!(e.contains("1 of 2 workers") && e.contains("`w`"), "{e}");
    let mut bad = ps::start(two_servers(), cfg(PsSync::Sync, sgd(0.1)))
        .expect("start")
        .client(5);
    assert!(bad.pull("w", W, 1).is_err());
}

#[test]
fn the_wire_format_round_trips_and_refuses_damaged_messages() {
    use distc_runtime::ps::wire::{Reply, Request};
    let grad = Slices {
        indices: vec![3, 0, 3],
        values: Tensor::F32(arr(&[3, 2], |i| i as f32 - 1.5)),
        dense_shape: vec![5, 2],
    };
    let requests = [
        Request::Pull {
            tag: 7,
            var: "emb".into(),
            start: 2,
            end: 9,
            ids: Some(vec![0, 4]),
            step: 3,
        },
        Request::Pull {
            tag: 8,
            var: "w".into(),
            start: 0,
            end: 3,
            ids: None,
            step: 1,
        },
        Request::Push {
            var: "emb".into(),
            start: 0,
            end: 5,
            step: 2,
            grad: Value::Slices(grad),
        },
        Request::Push {
            var: "w".into(),
            start: 0,
            end: 3,
            step: 2,
            grad: Value::Tensor(Tensor::F32(arr(&[3, 2], |i| i as f32))),
        },
        Request::Shutdown {
            tag: 9,
            collect: true,
        },
        Request::Abort {
            reason: "worker 1: id 99 is not in 0..50".into(),
        },
        Request::Snapshot { tag: 10, step: 4 },
    ];
    for r in &requests {
        let bytes = r.encode();
        assert_eq!(&Request::decode(&bytes).expect("decodes"), r);
        // Every prefix is refused with a reason, never a panic.
        for cut in 0..bytes.len() {
            assert!(
                Request::decode(&bytes[..cut]).is_err(),
                "{r:?} cut at {cut}"
            );
        }
    }
    let replies = [
        Reply::Rows {
            tag: 1,
            result: Ok(Tensor::F32(arr(&[2, 2], |i| i as f32))),
        },
        Reply::Rows {
            tag: 2,
            result: Err("no such shard".into()),
        },
        Reply::Failed {
            tag: 3,
            error: "server failed".into(),
        },
        Reply::Shards {
            tag: 4,
            result: Ok(vec![(
                "w".into(),
                0,
                Tensor::F32(arr(&[3, 2], |i| i as f32)),
            )]),
        },
    ];
    for r in &replies {
        let bytes = r.encode();
        assert_eq!(&Reply::decode(&bytes).expect("decodes"), r);
        for cut in 0..bytes.len() {
            assert!(Reply::decode(&bytes[..cut]).is_err(), "{r:?} cut at {cut}");
        }
    }
    // A huge announced count is refused before anything is allocated.
    let mut evil = vec![1u8];
    evil.extend_from_slice(&7u64.to_le_bytes());
    evil.extend_from_slice(&u64::MAX.to_le_bytes());
    assert!(Request::decode(&evil).is_err());
}
