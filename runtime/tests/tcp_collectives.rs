//! Every collective x world sizes 1-5 x every dtype x sizes 0, 1, odd and many-chunk, with
//! ranks as threads, against closed-form expected values (compared bit for bit).

mod common;

use common::{run_ranks, WAIT};
use rekindle_runtime::collectives::check::{reduce_expected, reduce_input, value};
use rekindle_runtime::{segment, Buffer, DType, ProcessGroup, ReduceOp, TcpOptions};

const SIZES: [usize; 4] = [0, 1, 7, 1003];

fn assert_bits(what: &str, got: &Buffer, want: &Buffer) {
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(got.len(), want.len(), "{what}: length");
    if got.as_bytes() != want.as_bytes() {
        let i = (0..got.len())
            .find(|&i| got.get_f64(i) != want.get_f64(i))
            .unwrap_or(0);
        panic!(
            "{what}: element {i} is {:?}, expected {:?}",
            got.get_f64(i),
            want.get_f64(i)
        );
    }
}

fn check_all(rank: usize, pg: ProcessGroup) {
    let n = pg.world_size();
    for dtype in DType::ALL {
        for len in SIZES {
            let tag = |op: &str| format!("rank {rank}/{n} {op} {dtype} x{len}");
            for op in ReduceOp::ALL {
                let input = Buffer::from_fn(dtype, len, |i| reduce_input(op, rank, i));
                let want = Buffer::from_fn(dtype, len, |i| reduce_expected(op, dtype, n, i));
                let got = pg.all_reduce(input.clone(), op).wait(WAIT).unwrap();
                assert_bits(&tag(&format!("all_reduce({op})")), &got, &want);

                let got = pg.reduce_scatter(input.clone(), op).wait(WAIT).unwrap();
                let seg = segment(len, n, rank);
                let want_rs = Buffer::from_fn(dtype, seg.len(), |t| {
                    reduce_expected(op, dtype, n, seg.start + t)
                });
                assert_bits(&tag(&format!("reduce_scatter({op})")), &got, &want_rs);

                let root = (len + 1) % n;
                let got = pg.reduce(input, op, root).wait(WAIT).unwrap();
                if rank == root {
                    assert_bits(&tag(&format!("reduce({op}) root {root}")), &got, &want);
                }
            }

            let root = len % n;
            let mine = Buffer::from_fn(dtype, len, |i| value(rank, i));
            let got = pg.broadcast(mine.clone(), root).wait(WAIT).unwrap();
            assert_bits(
                &tag("broadcast"),
                &got,
                &Buffer::from_fn(dtype, len, |i| value(root, i)),
            );

            let got = pg.all_gather(mine.clone()).wait(WAIT).unwrap();
            let want = Buffer::from_fn(dtype, n * len, |k| value(k / len.max(1), k % len.max(1)));
            assert_bits(&tag("all_gather"), &got, &want);

            let got = pg.gather(mine.clone(), root).wait(WAIT).unwrap();
            if rank == root {
                assert_bits(&tag("gather"), &got, &want);
            } else {
                assert_bits(&tag("gather (non-root keeps its buffer)"), &got, &mine);
            }

            let seg = segment(len, n, rank);
            let input = if rank == root {
                Buffer::from_fn(dtype, len, |i| value(root, i))
            } else {
                Buffer::zeros(dtype, seg.len())
            };
            let got = pg.scatter(input, root).wait(WAIT).unwrap();
            let want = Buffer::from_fn(dtype, seg.len(), |t| value(root, seg.start + t));
            assert_bits(&tag("scatter"), &got, &want);

            let got = pg.all_to_all(mine.clone()).wait(WAIT).unwrap();
            let block = seg.len();
            let want = Buffer::from_fn(dtype, n * block, |k| {
                value(k / block.max(1), seg.start + k % block.max(1))
            });
            assert_bits(&tag("all_to_all"), &got, &want);

            if n > 1 {
                // A ring of point-to-point transfers; even ranks send first so that no cycle
                // of blocked sends can form.
                let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
                let recv_buf = Buffer::zeros(dtype, len);
                let got = if rank % 2 == 0 {
                    pg.send(mine.clone(), next).wait(WAIT).unwrap();
                    pg.recv(recv_buf, prev).wait(WAIT).unwrap()
                } else {
                    let got = pg.recv(recv_buf, prev).wait(WAIT).unwrap();
                    pg.send(mine.clone(), next).wait(WAIT).unwrap();
                    got
                };
                assert_bits(
                    &tag("send/recv"),
                    &got,
                    &Buffer::from_fn(dtype, len, |i| value(prev, i)),
                );
            }
            pg.barrier().wait(WAIT).unwrap();
        }
    }
    assert!(pg.error().is_none());
}

/// Tiny segments and no direct all-reduce: every ring and chain runs over many chunks.
fn many_chunks() -> TcpOptions {
    TcpOptions {
        max_segment_bytes: 24,
        small_message_bytes: 0,
        ..TcpOptions::default()
    }
}

#[test]
fn every_op_dtype_and_size_world_1_to_5_many_chunks() {
    for world in 1..=5 {
        run_ranks(&format!("chunks-{world}"), world, many_chunks(), check_all);
    }
}

#[test]
fn every_op_dtype_and_size_world_1_to_5_default_options() {
    for world in 1..=5 {
        run_ranks(
            &format!("default-{world}"),
            world,
            TcpOptions::default(),
            check_all,
        );
    }
}

/// The same matrix with shared memory off: every byte crosses TCP sockets.
#[test]
fn every_op_dtype_and_size_world_1_to_5_tcp_only() {
    for world in 1..=5 {
        let opts = TcpOptions {
            shared_memory: false,
            ..many_chunks()
        };
        run_ranks(&format!("tcp-{world}"), world, opts, check_all);
    }
}

/// The same over TCP in the encrypted wire mode: every frame is sealed with AES-256-GCM.
#[test]
fn every_op_dtype_and_size_world_2_and_3_tcp_only_encrypted() {
    for world in [2, 3] {
        let opts = TcpOptions {
            shared_memory: false,
            wire: Some(rekindle_runtime::WireMode::Encrypt),
            ..many_chunks()
        };
        run_ranks(&format!("tcp-enc-{world}"), world, opts, check_all);
    }
}

/// Tiny rings: every lane wraps its ring many times and waits on doorbells.
#[test]
fn every_op_dtype_and_size_world_1_to_5_tiny_rings() {
    for world in [2, 3, 5] {
        let opts = TcpOptions {
            shm_ring_bytes: 64,
            ..many_chunks()
        };
        run_ranks(&format!("rings-{world}"), world, opts, check_all);
    }
}

#[test]
fn large_all_reduce_crosses_the_small_message_threshold() {
    // 300 000 f32 = 1.2 MB: ring path with the default 512 KiB chunks on 3 ranks.
    let out = run_ranks("large", 3, TcpOptions::default(), |rank, pg| {
        let len = 300_000;
        let buf = Buffer::from_fn(DType::F32, len, |i| reduce_input(ReduceOp::Sum, rank, i));
        pg.all_reduce(buf, ReduceOp::Sum).wait(WAIT).unwrap()
    });
    let want = Buffer::from_fn(DType::F32, 300_000, |i| {
        reduce_expected(ReduceOp::Sum, DType::F32, 3, i)
    });
    for got in &out {
        assert_bits("large all_reduce", got, &want);
    }
}

#[test]
fn buffers_larger_than_the_cache_are_copied_out_of_the_rings_exactly() {
    // 8 400 001 f32 (33.6 MB, odd; all_gather blocks of 11.2 MB into a 33.6 MB output): above
    // the size from which received bytes are copied out of the shared-memory rings with
    // streaming stores, at unaligned tails and ring wraps.
    let len = 8_400_001;
    let out = run_ranks("beyond-cache", 3, TcpOptions::default(), move |rank, pg| {
        let input = |i: usize| reduce_input(ReduceOp::Sum, rank, i);
        let reduced = pg
            .all_reduce(Buffer::from_fn(DType::F32, len, input), ReduceOp::Sum)
            .wait(WAIT)
            .unwrap();
        let mine = move |i: usize| if rank == 1 { input(i) } else { -1.0 };
        let sent = pg
            .broadcast(Buffer::from_fn(DType::F32, len, mine), 1)
            .wait(WAIT)
            .unwrap();
        let gathered = pg
            .all_gather(Buffer::from_fn(DType::F32, len / 3 + 1, move |i| {
                (rank * 10 + i % 5) as f64
            }))
            .wait(WAIT)
            .unwrap();
        (reduced, sent, gathered)
    });
    let want = Buffer::from_fn(DType::F32, len, |i| {
        reduce_expected(ReduceOp::Sum, DType::F32, 3, i)
    });
    let root = Buffer::from_fn(DType::F32, len, |i| reduce_input(ReduceOp::Sum, 1, i));
    let block = len / 3 + 1;
    let gathered = Buffer::from_fn(DType::F32, 3 * block, |i| {
        ((i / block) * 10 + (i % block) % 5) as f64
    });
    for (reduced, sent, got) in &out {
        assert_bits("all_reduce beyond the cache", reduced, &want);
        assert_bits("broadcast beyond the cache", sent, &root);
        assert_bits("all_gather beyond the cache", got, &gathered);
    }
}

#[test]
fn large_lanes_are_exact_in_both_ring_write_modes() {
    // Each rank writes large shared-memory lanes with streaming and with ordinary stores on
    // alternate operations among its first eight of a size (it measures both and keeps the
    // faster), so twelve 2-rank all-reduces and broadcasts of 1.2 MB (300 001 f32, odd)
    // write in both modes, through ring wraps and unaligned tails.
    let len = 300_001;
    let out = run_ranks("write-modes", 2, TcpOptions::default(), move |rank, pg| {
        (0..12)
            .map(|k| {
                let input = move |i: usize| reduce_input(ReduceOp::Sum, rank, i + k);
                let reduced = pg
                    .all_reduce(Buffer::from_fn(DType::F32, len, input), ReduceOp::Sum)
                    .wait(WAIT)
                    .unwrap();
                let root = k % 2;
                let mine = move |i: usize| if rank == root { input(i) } else { -1.0 };
                let sent = pg
                    .broadcast(Buffer::from_fn(DType::F32, len, mine), root)
                    .wait(WAIT)
                    .unwrap();
                (reduced, sent)
            })
            .collect::<Vec<_>>()
    });
    for results in &out {
        for (k, (reduced, sent)) in results.iter().enumerate() {
            let want = Buffer::from_fn(DType::F32, len, |i| {
                reduce_expected(ReduceOp::Sum, DType::F32, 2, i + k)
            });
            assert_bits(&format!("all_reduce {k}"), reduced, &want);
            let root = Buffer::from_fn(DType::F32, len, |i| {
                reduce_input(ReduceOp::Sum, k % 2, i + k)
            });
            assert_bits(&format!("broadcast {k}"), sent, &root);
        }
    }
}

#[test]
fn results_are_bit_identical_across_ranks_and_runs() {
    // Inputs whose float sums depend on the order of addition.
    fn input(rank: usize, i: usize) -> f64 {
        let x = ((rank * 7919 + i * 104_729) % 1_000_003) as f64;
        (x * 1e-3).sin() * 10f64.powi((i % 9) as i32 - 4)
    }
    let run = |opts: TcpOptions| {
        run_ranks("determinism", 4, opts, |rank, pg| {
            let buf = Buffer::from_fn(DType::F32, 20_011, |i| input(rank, i));
            let a = pg
                .all_reduce(buf.clone(), ReduceOp::Sum)
                .wait(WAIT)
                .unwrap();
            let b = pg.reduce_scatter(buf, ReduceOp::Avg).wait(WAIT).unwrap();
            (a, b)
        })
    };
    for opts in [
        many_chunks(),
        TcpOptions {
            max_segment_bytes: 4096,
            ..TcpOptions::default()
        },
    ] {
        let first = run(opts.clone());
        for r in 1..4 {
            assert_eq!(
                first[r].0.as_bytes(),
                first[0].0.as_bytes(),
                "rank {r} differs from rank 0"
            );
        }
        for _ in 0..3 {
            let again = run(opts.clone());
            for r in 0..4 {
                assert_eq!(
                    again[r].0.as_bytes(),
                    first[r].0.as_bytes(),
                    "all_reduce run differs"
                );
                assert_eq!(
                    again[r].1.as_bytes(),
                    first[r].1.as_bytes(),
                    "reduce_scatter run differs"
                );
            }
        }
    }
}

#[test]
fn operations_run_in_issue_order_asynchronously() {
    let out = run_ranks("async", 3, many_chunks(), |rank, pg| {
        // Issue many operations before waiting on any of them.
        let works: Vec<_> = (0..20)
            .map(|k| pg.all_reduce(Buffer::from(vec![(rank + k) as i64; 50]), ReduceOp::Sum))
            .collect();
        works
            .into_iter()
            .map(|w| w.wait(WAIT).unwrap().into_vec::<i64>().unwrap()[0])
            .collect::<Vec<_>>()
    });
    let want: Vec<i64> = (0..20).map(|k| (3 * k + 3) as i64).collect();
    for got in out {
        assert_eq!(got, want);
    }
}

#[test]
fn mismatched_operations_fail_with_a_mismatch_error() {
    let out = run_ranks("mismatch", 2, TcpOptions::default(), |rank, pg| {
        let len = if rank == 0 { 10 } else { 11 };
        pg.all_reduce(Buffer::from(vec![1.0f32; len]), ReduceOp::Sum)
            .wait(WAIT)
    });
    for r in out {
        let e = r.unwrap_err();
        assert!(matches!(e, rekindle_runtime::Error::Mismatch { .. }), "{e}");
    }
}

#[test]
fn bad_arguments_are_rejected_and_leave_the_group_usable() {
    run_ranks("badargs", 2, TcpOptions::default(), |rank, pg| {
        let e = pg
            .broadcast(Buffer::from(vec![1u8]), 5)
            .wait(WAIT)
            .unwrap_err();
        assert!(
            matches!(e, rekindle_runtime::Error::InvalidArgument { .. }),
            "{e}"
        );
        let e = pg
            .send(Buffer::from(vec![1u8]), rank)
            .wait(WAIT)
            .unwrap_err();
        assert!(
            matches!(e, rekindle_runtime::Error::InvalidArgument { .. }),
            "{e}"
        );
        let got = pg
            .all_reduce(Buffer::from(vec![2i32]), ReduceOp::Sum)
            .wait(WAIT)
            .unwrap();
        assert_eq!(got.into_vec::<i32>().unwrap(), vec![4]);
    });
}

#[test]
fn into_variants_write_the_callers_buffers_and_check_their_shape() {
    run_ranks("into", 3, many_chunks(), |rank, pg| {
        let mine = Buffer::from_fn(DType::I32, 5, |i| value(rank, i));
        let out = Buffer::from_fn(DType::I32, 15, |_| -1.0);
        let got = pg.all_gather_into(mine.clone(), out).wait(WAIT).unwrap();
        assert_bits(
            "all_gather_into",
            &got,
            &Buffer::from_fn(DType::I32, 15, |k| value(k / 5, k % 5)),
        );
        let seg = segment(5, 3, rank);
        let got = pg
            .reduce_scatter_into(
                mine.clone(),
                ReduceOp::Max,
                Buffer::zeros(DType::I32, seg.len()),
            )
            .wait(WAIT)
            .unwrap();
        let want = Buffer::from_fn(DType::I32, seg.len(), |t| {
            (0..3).map(|r| value(r, seg.start + t)).fold(0.0, f64::max)
        });
        assert_bits("reduce_scatter_into", &got, &want);
        let got = pg
            .all_to_all_into(mine.clone(), Buffer::zeros(DType::I32, 3 * seg.len()))
            .wait(WAIT)
            .unwrap();
        let b = seg.len();
        assert_bits(
            "all_to_all_into",
            &got,
            &Buffer::from_fn(DType::I32, 3 * b, |k| value(k / b, seg.start + k % b)),
        );
        let out = if rank == 1 {
            Buffer::zeros(DType::I32, 15)
        } else {
            Buffer::zeros(DType::I32, 0)
        };
        let got = pg.gather_into(mine.clone(), 1, out).wait(WAIT).unwrap();
        if rank == 1 {
            assert_bits(
                "gather_into",
                &got,
                &Buffer::from_fn(DType::I32, 15, |k| value(k / 5, k % 5)),
            );
        }
        // A wrong shape is an argument error found before anything is sent.
        let e = pg
            .all_gather_into(mine.clone(), Buffer::zeros(DType::I32, 14))
            .wait(WAIT)
            .unwrap_err();
        assert!(
            matches!(e, rekindle_runtime::Error::InvalidArgument { .. }),
            "{e}"
        );
        let e = pg
            .all_gather_into(mine, Buffer::zeros(DType::F32, 15))
            .wait(WAIT)
            .unwrap_err();
        assert!(
            matches!(e, rekindle_runtime::Error::InvalidArgument { .. }),
            "{e}"
        );
        pg.barrier().wait(WAIT).unwrap();
    });
}
