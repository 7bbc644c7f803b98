//! In-process communicator: ring collectives against sequential references, byte
//! counts, and failure behaviour (errors, not hangs).

use distc_runtime::comm::{chunk_range, in_process, ByteCount, Communicator, InProcessComm};
use distc_runtime::RuntimeError;
use std::time::Duration;

/// Runs `f` on every rank of an `n`-rank in-process group, one thread each; results in
/// rank order.
fn on_ranks<T: Send>(n: usize, f: impl Fn(InProcessComm) -> T + Sync) -> Vec<T> {
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = in_process(n)
            .into_iter()
            .map(|c| s.spawn(move || f(c)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

/// Rank `r`'s deterministic test data of length `len`.
fn data(r: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 31 + r * 17 + 5) % 97) as f32 * 0.37 - 13.1 + (r as f32) * 1e-3)
        .collect()
}

fn close(a: f32, b: f64) -> bool {
    (a as f64 - b).abs() <= 1e-5 * b.abs().max(1.0)
}

/// The text of a communicator's error: a peer's failure (hung up, silent, another
/// operation), ranks whose calls disagree (the plan), a setting that does not fit the
/// ranks, or a misuse of the communicator itself.
fn message(e: RuntimeError) -> String {
    match e {
        RuntimeError::Config(m) | RuntimeError::Plan(m) => m,
        e @ (RuntimeError::Peer { .. } | RuntimeError::Internal { .. }) => e.to_string(),
        other => panic!("expected a Config, Plan, Internal or Peer error, got {other:?}"),
    }
}

#[test]
fn all_reduce_matches_sequential_sum_and_is_identical_on_every_rank() {
    for n in 1..=4 {
        for len in [0, 1, 3, 10, 12, 1001] {
            for mean in [false, true] {
                let results = on_ranks(n, |mut c| {
                    let mut buf = data(c.rank(), len);
                    c.all_reduce(&mut buf, mean).expect("all_reduce");
                    (buf, c.bytes())
                });
                for i in 0..len {
                    let mut want: f64 = (0..n).map(|r| data(r, len)[i] as f64).sum();
                    if mean {
                        want /= n as f64;
                    }
                    assert!(close(results[0].0[i], want), "n={n} len={len} i={i}");
                }
                for (r, (buf, bytes)) in results.iter().enumerate() {
                    let bits: Vec<u32> = buf.iter().map(|x| x.to_bits()).collect();
                    let bits0: Vec<u32> = results[0].0.iter().map(|x| x.to_bits()).collect();
                    assert_eq!(
                        bits, bits0,
                        "rank {r} differs from rank 0 (n={n} len={len})"
                    );
                    // 2(N-1)/N of the buffer, within one chunk's rounding per step.
                    let ideal = 2.0 * (n as f64 - 1.0) / n as f64 * 4.0 * len as f64;
                    let slack = if len % n == 0 {
                        0.0
                    } else {
                        2.0 * (n as f64 - 1.0) * 4.0
                    };
                    assert!(
                        (bytes.sent as f64 - ideal).abs() <= slack,
                        "n={n} len={len} rank {r}: sent {} vs {ideal}",
                        bytes.sent
                    );
                    assert!((bytes.received as f64 - ideal).abs() <= slack);
                }
                // Every byte sent is received by someone.
                let sent: u64 = results.iter().map(|(_, b)| b.sent).sum();
                let received: u64 = results.iter().map(|(_, b)| b.received).sum();
                assert_eq!(sent, received);
            }
        }
    }
}

#[test]
fn all_reduce_bytes_exact_when_divisible_and_zero_for_one_rank() {
    let len = 1200;
    for n in 1..=4 {
        let bytes = on_ranks(n, |mut c| {
            let mut buf = data(c.rank(), len);
            c.all_reduce(&mut buf, false).expect("all_reduce");
            c.bytes()
        });
        let want = (2 * (n - 1) * 4 * len / n) as u64;
        for b in bytes {
            assert_eq!(
                b,
                ByteCount {
                    sent: want,
                    received: want
                },
                "n={n}"
            );
        }
    }
}

#[test]
fn all_reduce_f64_matches_and_counts_eight_bytes() {
    for n in 1..=4 {
        let len = 24;
        let results = on_ranks(n, |mut c| {
            let mut buf: Vec<f64> = data(c.rank(), len)
                .iter()
                .map(|&x| x as f64 * 1.5)
                .collect();
            c.all_reduce_f64(&mut buf, true).expect("all_reduce_f64");
            (buf, c.bytes())
        });
        for i in 0..len {
            let want: f64 = (0..n).map(|r| data(r, len)[i] as f64 * 1.5).sum::<f64>() / n as f64;
            assert!((results[0].0[i] - want).abs() <= 1e-12 * want.abs().max(1.0));
        }
        for (buf, bytes) in &results {
            assert_eq!(buf, &results[0].0);
            assert_eq!(bytes.sent, (2 * (n - 1) * 8 * len / n) as u64);
        }
    }
}

#[test]
fn all_gather_with_different_lengths() {
    for n in 1..=4 {
        let results = on_ranks(n, |mut c| {
            let r = c.rank();
            let mine = vec![r as u8; r * 3 + 1];
            (c.all_gather(mine).expect("all_gather"), c.bytes())
        });
        let want: Vec<Vec<u8>> = (0..n).map(|r| vec![r as u8; r * 3 + 1]).collect();
        let total: u64 = want.iter().map(|b| b.len() as u64).sum();
        for (r, (got, bytes)) in results.iter().enumerate() {
            assert_eq!(got, &want, "n={n} rank {r}");
            // Each rank forwards every block except its successor's, and receives every
            // block except its own.
            let succ = if n == 1 {
                0
            } else {
                want[(r + 1) % n].len() as u64
            };
            let expected_sent = if n == 1 { 0 } else { total - succ };
            let expected_received = if n == 1 {
                0
            } else {
                total - want[r].len() as u64
            };
            assert_eq!(bytes.sent, expected_sent, "n={n} rank {r}");
            assert_eq!(bytes.received, expected_received, "n={n} rank {r}");
        }
    }
}

#[test]
fn reduce_scatter_returns_this_ranks_reduced_chunk() {
    for n in 1..=4 {
        for len in [0, 2, 7, 12] {
            for mean in [false, true] {
                let results = on_ranks(n, |mut c| {
                    c.reduce_scatter(&data(c.rank(), len), mean)
                        .expect("reduce_scatter")
                });
                for (r, chunk) in results.iter().enumerate() {
                    let range = chunk_range(len, n, r);
                    assert_eq!(chunk.len(), range.len(), "n={n} len={len} rank {r}");
                    for (k, i) in range.enumerate() {
                        let mut want: f64 = (0..n).map(|q| data(q, len)[i] as f64).sum();
                        if mean {
                            want /= n as f64;
                        }
                        assert!(close(chunk[k], want), "n={n} len={len} rank {r} i={i}");
                    }
                }
                let total: usize = results.iter().map(Vec::len).sum();
                assert_eq!(total, len);
            }
        }
    }
    // First len % n chunks are one longer.
    assert_eq!(chunk_range(10, 4, 0), 0..3);
    assert_eq!(chunk_range(10, 4, 1), 3..6);
    assert_eq!(chunk_range(10, 4, 2), 6..8);
    assert_eq!(chunk_range(10, 4, 3), 8..10);
}

#[test]
fn broadcast_from_non_zero_root() {
    for n in 1..=4 {
        let root = n - 1;
        let results = on_ranks(n, |mut c| {
            let mut buf = if c.rank() == root {
                b"hello ring".to_vec()
            } else {
                vec![0; 10]
            };
            c.broadcast(&mut buf, root).expect("broadcast");
            (buf, c.bytes())
        });
        for (r, (buf, bytes)) in results.iter().enumerate() {
            assert_eq!(buf, b"hello ring");
            // Passed along the ring: everyone but the root's predecessor forwards once.
            let forwards = n > 1 && (r + 1) % n != root;
            assert_eq!(bytes.sent, if forwards { 10 } else { 0 }, "n={n} rank {r}");
        }
    }
}

#[test]
fn broadcast_length_mismatch_and_bad_root_are_errors() {
    let results = on_ranks(3, |mut c| {
        let mut buf = vec![7; if c.rank() == 2 { 5 } else { 4 }];
        let r = c.broadcast(&mut buf, 0);
        (r.map_err(message), buf)
    });
    assert!(results[0].0.is_ok());
    assert_eq!(results[1], (Ok(()), vec![7; 4]));
    let e = results[2].0.clone().expect_err("length mismatch");
    assert!(e.contains("rank 2") && e.contains("4 bytes"), "{e}");

    let mut c = in_process(2).remove(0);
    let e = message(c.broadcast(&mut vec![], 5).expect_err("bad root"));
    assert!(e.contains("out of range"), "{e}");
}

#[test]
fn barrier_waits_for_every_rank() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    for n in 1..=4 {
        let arrived = AtomicUsize::new(0);
        let seen = on_ranks(n, |mut c| {
            if c.rank() == 0 {
                std::thread::sleep(Duration::from_millis(50));
            }
            arrived.fetch_add(1, Ordering::SeqCst);
            c.barrier().expect("barrier");
            let seen = arrived.load(Ordering::SeqCst);
            assert_eq!(
                c.bytes(),
                ByteCount::default(),
                "a barrier moves no payload"
            );
            seen
        });
        assert!(seen.iter().all(|&s| s == n), "n={n}: {seen:?}");
    }
}

#[test]
fn send_recv_point_to_point() {
    let results = on_ranks(3, |mut c| match c.rank() {
        0 => {
            c.send(2, vec![1, 2, 3]).expect("send");
            c.send(2, vec![4]).expect("send");
            c.recv(1).expect("recv")
        }
        1 => {
            c.send(0, b"from one".to_vec()).expect("send");
            Vec::new()
        }
        _ => {
            let mut a = c.recv(0).expect("recv");
            a.extend(c.recv(0).expect("recv"));
            a
        }
    });
    assert_eq!(
        results,
        vec![b"from one".to_vec(), vec![], vec![1, 2, 3, 4]]
    );
}

#[test]
fn mismatched_lengths_are_reported_by_every_rank() {
    let results = on_ranks(3, |mut c| {
        let mut buf = vec![1.0f32; if c.rank() == 1 { 7 } else { 6 }];
        let first = c.all_reduce(&mut buf, false).map_err(message);
        // The group is still usable afterwards: the mismatch was caught consistently.
        let mut ok = vec![1.0f32; 5];
        c.all_reduce(&mut ok, false)
            .expect("all_reduce after mismatch");
        (first, ok)
    });
    for (r, (first, ok)) in results.into_iter().enumerate() {
        let e = first.expect_err("mismatch must be an error");
        assert!(
            e.contains(&format!("rank {r}")) && e.contains("differ"),
            "{e}"
        );
        assert_eq!(ok, vec![3.0; 5]);
    }
}

#[test]
fn a_dropped_rank_makes_the_others_fail_instead_of_hanging() {
    for (n, dead) in [(2, 1), (4, 3), (4, 1)] {
        let results = on_ranks(n, |mut c| {
            if c.rank() == dead {
                drop(c);
                return None;
            }
            let mut buf = vec![1.0f32; 64];
            let e = c.all_reduce(&mut buf, true).expect_err("peer is gone");
            // Later calls fail too (the communicator closed itself).
            let again = c.barrier().expect_err("closed");
            Some((message(e), message(again)))
        });
        for (r, res) in results.into_iter().enumerate() {
            if r == dead {
                continue;
            }
            let (e, again) = res.expect("live rank result");
            assert!(
                e.starts_with(&format!("rank {r}: ")) && e.contains("hung up"),
                "{e}"
            );
            assert!(again.contains("closed"), "{again}");
        }
    }
}

#[test]
fn a_silent_peer_times_out_when_a_timeout_is_set() {
    let mut comms = in_process(2);
    let _silent = comms.pop();
    let mut c = comms.pop().expect("rank 0");
    c.set_timeout(Some(Duration::from_millis(100)));
    let e = c.all_reduce(&mut [1.0, 2.0], false).expect_err("timeout");
    // A peer's failure is its own kind of error, naming the peer and the operation.
    match &e {
        RuntimeError::Peer { rank, peer, op, .. } => {
            assert_eq!((*rank, *peer), (0, 1), "{e}");
            assert_eq!(op, "all_reduce", "{e}");
        }
        other => panic!("expected a Peer error, got {other:?}"),
    }
    let e = message(e);
    assert!(e.contains("rank 0") && e.contains("within"), "{e}");
}

#[test]
fn different_operations_on_different_ranks_are_errors() {
    let results = on_ranks(2, |mut c| {
        if c.rank() == 0 {
            c.all_gather(vec![1, 2]).map(|_| ()).map_err(message)
        } else {
            c.barrier().map_err(message)
        }
    });
    for r in results {
        let e = r.expect_err("mismatched operations");
        assert!(e.contains("different operations"), "{e}");
    }
}

#[test]
fn usable_as_trait_object() {
    let comms: Vec<Box<dyn Communicator>> = in_process(2)
        .into_iter()
        .map(|c| Box::new(c) as Box<dyn Communicator>)
        .collect();
    let sums = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                s.spawn(move || {
                    let mut v = vec![c.rank() as f32 + 1.0];
                    c.all_reduce(&mut v, false).expect("all_reduce");
                    v[0]
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("join"))
            .collect::<Vec<_>>()
    });
    assert_eq!(sums, vec![3.0, 3.0]);
}

/// The hierarchical all-reduce (issue 25, item 1) over nodes of 2 and 3 ranks gives the
/// sum (or mean) of every rank's buffer, the same bits on every rank; each rank's bytes
/// per link are what `hierarchical_bytes` predicts, and the communicator counted their
/// sum; fewer bytes cross nodes than a flat ring sends.
#[test]
fn hierarchical_all_reduce_sums_like_the_ring_and_sends_what_is_predicted() {
    use distc_runtime::comm::{hierarchical_all_reduce, hierarchical_bytes};
    for (n, local) in [(2, 2), (4, 2), (6, 3), (6, 2), (8, 4)] {
        for len in [1, 7, 12, 1001] {
            for mean in [false, true] {
                let results = on_ranks(n, |mut c| {
                    let mut buf = data(c.rank(), len);
                    let links =
                        hierarchical_all_reduce(&mut c, &mut buf, mean, local).expect("runs");
                    (buf, links, c.bytes())
                });
                for i in 0..len {
                    let mut want: f64 = (0..n).map(|r| data(r, len)[i] as f64).sum();
                    if mean {
                        want /= n as f64;
                    }
                    assert!(
                        close(results[0].0[i], want),
                        "n={n} L={local} len={len} i={i}"
                    );
                }
                for (r, (buf, links, bytes)) in results.iter().enumerate() {
                    let what = format!("n={n} L={local} len={len} rank {r}");
                    assert_eq!(
                        buf.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        results[0].0.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        "{what}: differs from rank 0"
                    );
                    assert_eq!(*links, hierarchical_bytes(len, n, local, r), "{what}");
                    assert_eq!(bytes.sent, links.intra_node + links.inter_node, "{what}");
                    if n > local && len >= n {
                        let flat = 2.0 * (n as f64 - 1.0) / n as f64 * 4.0 * len as f64;
                        assert!((links.inter_node as f64) < flat, "{what}");
                    }
                }
            }
        }
    }
    let e = on_ranks(3, |mut c| {
        let mut buf = vec![1.0; 4];
        hierarchical_all_reduce(&mut c, &mut buf, false, 2).expect_err("3 ranks, nodes of 2")
    });
    assert!(message(e.into_iter().next().expect("rank 0")).contains("multiple of 2"));
}

#[test]
fn worker_hosts_are_checked_against_the_plans_nodes() {
    use distc_runtime::comm::check_nodes;
    let check = |names: &[&str], local: usize| {
        let hosts: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        check_nodes(&hosts, local)
    };
    let refused = |names: &[&str], local: usize| match check(names, local) {
        Err(e) => e,
        Ok(note) => panic!("{names:?} in nodes of {local} accepted ({note:?})"),
    };
    let noted = |names: &[&str], local: usize| match check(names, local) {
        Ok(Some(note)) => note,
        other => panic!("{names:?} in nodes of {local}: no note ({other:?})"),
    };
    // Nodes of 2 on hosts of 2, in rank order: as planned.
    assert_eq!(check(&["a", "a", "b", "b"], 2), Ok(None));
    // Round-robin placement: a node of the plan spans two hosts.
    let e = refused(&["a", "b", "a", "b"], 2);
    assert!(
        e.contains("worker 0 on a, worker 1 on b, worker 2 on a, worker 3 on b"),
        "{e}"
    );
    assert!(e.contains("--map-by ppr:2:node"), "{e}");
    // Hosts of 4 for a plan of nodes of 2: the flag that fits is named.
    let e = refused(&["a", "a", "a", "a", "b", "b", "b", "b"], 2);
    assert!(e.contains("workers 0-3 on a, workers 4-7 on b"), "{e}");
    assert!(e.contains("compile with --ranks-per-node 4"), "{e}");
    // One host for everything: nodes emulated on one machine, allowed with a note.
    let note = noted(&["a", "a", "a", "a"], 2);
    assert!(note.contains("all 4 workers run on a"), "{note}");
    // No hierarchy in the plan: a hint where the hosts come in equal blocks, else none.
    assert!(noted(&["a", "a", "b", "b"], 0).contains("--ranks-per-node 2"));
    assert_eq!(check(&["a", "a", "a"], 0), Ok(None));
    assert_eq!(check(&["a", "b", "a"], 0), Ok(None));
    assert_eq!(check(&["a", "a", "b"], 0), Ok(None));
}
