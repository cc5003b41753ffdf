//! NCCL backend smoke tests, run where a GPU is available: a single-rank group on `cuda:0`
//! with closed-form values for every op and dtype, abort and rebuild, issue order; and a
//! multi-rank group with ranks as threads, including a hung peer, where two or more GPUs are
//! visible or NCCL lets ranks share one (2.30.3+ with `NCCL_MULTI_RANK_GPU_ENABLE=1`).
//! Without a CUDA device or an NCCL library each test prints "not run" and returns; with
//! `REKINDLE_REQUIRE_GPU=1` (set by `scripts/gpu-check.sh`) it fails instead.
//! `REKINDLE_NCCL_LIBRARY` points at a `libnccl.so.2` the search does not find.
#![cfg(feature = "nccl")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use rekindle_runtime::store::InMemoryStore;
use rekindle_runtime::{
    cuda_device_count, segment, Buffer, DType, Device, Error, GroupConfig, NcclBackend,
    ProcessGroup, ReduceOp,
};

const WAIT: Duration = Duration::from_secs(60);

/// Says why a test cannot run here; a failure instead when `REKINDLE_REQUIRE_GPU` is set.
fn not_run<T>(why: impl std::fmt::Display) -> Option<T> {
    assert!(
        std::env::var_os("REKINDLE_REQUIRE_GPU").is_none(),
        "REKINDLE_REQUIRE_GPU is set but {why}"
    );
    eprintln!("not run: {why}");
    None
}

/// The number of GPUs to use, or `None` (after saying why) when these tests cannot run here.
fn gpus() -> Option<usize> {
    let count = cuda_device_count();
    if count == 0 {
        return not_run("no CUDA device or driver on this machine");
    }
    match NcclBackend::library_version() {
        Ok((version, path)) => {
            eprintln!("NCCL {version} from {path}, {count} CUDA device(s)");
            Some(count)
        }
        Err(e) => not_run(e),
    }
}

fn config(
    job: &str,
    round: u64,
    rank: usize,
    world: usize,
    store: Arc<InMemoryStore>,
) -> GroupConfig {
    let mut cfg = GroupConfig::new(job, round, rank, world, store).expect("config");
    cfg.op_timeout = Duration::from_secs(20);
    cfg.bootstrap_timeout = Duration::from_secs(60);
    cfg
}

fn single(job: &str) -> ProcessGroup {
    let store = Arc::new(InMemoryStore::new());
    ProcessGroup::nccl(config(job, 0, 0, 1, store), Device::Cuda(0))
        .expect("single-rank NCCL group")
}

/// Small integers, exact in every dtype (bf16 holds integers up to 256 exactly).
fn value(i: usize) -> f64 {
    (i % 200) as f64
}

fn assert_values(got: &Buffer, dtype: DType, len: usize, f: impl Fn(usize) -> f64, what: &str) {
    assert_eq!(got.dtype(), dtype, "{what}");
    assert_eq!(got.len(), len, "{what}");
    for i in 0..len {
        assert_eq!(got.get_f64(i), Some(f(i)), "{what}: element {i}");
    }
}

#[test]
fn without_a_gpu_forming_a_group_is_a_typed_error() {
    if cuda_device_count() > 0 {
        eprintln!("not run: this machine has a CUDA device");
        return;
    }
    let store = Arc::new(InMemoryStore::new());
    let started = Instant::now();
    let err = ProcessGroup::nccl(config("nccl-smoke-nogpu", 0, 0, 1, store), Device::Cuda(0))
        .unwrap_err();
    assert!(
        matches!(err, Error::CudaUnavailable { ordinal: 0, .. }),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn single_rank_ops_give_closed_form_results() {
    if gpus().is_none() {
        return;
    }
    let pg = single("nccl-smoke-ops");
    assert_eq!(
        (pg.rank(), pg.world_size(), pg.backend().name()),
        (0, 1, "nccl")
    );
    for dtype in DType::ALL {
        for len in [0usize, 1, 1023, (1 << 20) + 3] {
            let input = || Buffer::from_fn(dtype, len, value);
            let what = |op: &str| format!("{op} {dtype} x{len}");
            // One rank: every reduction is the identity (avg divides by 1).
            for op in ReduceOp::ALL {
                let out = pg.all_reduce(input(), op).wait(WAIT).unwrap();
                assert_values(&out, dtype, len, value, &what(op.as_str()));
                let out = pg.reduce(input(), op, 0).wait(WAIT).unwrap();
                assert_values(&out, dtype, len, value, &what("reduce"));
            }
            let out = pg.broadcast(input(), 0).wait(WAIT).unwrap();
            assert_values(&out, dtype, len, value, &what("broadcast"));
            // These produce fresh buffers, so the values must have come back from the device.
            let out = pg.all_gather(input()).wait(WAIT).unwrap();
            assert_values(&out, dtype, len, value, &what("all_gather"));
            let out = pg
                .reduce_scatter(input(), ReduceOp::Sum)
                .wait(WAIT)
                .unwrap();
            assert_values(&out, dtype, len, value, &what("reduce_scatter"));
            let out = pg.scatter(input(), 0).wait(WAIT).unwrap();
            assert_values(&out, dtype, len, value, &what("scatter"));
            let out = pg.gather(input(), 0).wait(WAIT).unwrap();
            assert_values(&out, dtype, len, value, &what("gather"));
            let out = pg.all_to_all(input()).wait(WAIT).unwrap();
            assert_values(&out, dtype, len, value, &what("all_to_all"));
        }
    }
    pg.barrier().wait(WAIT).unwrap();
    assert!(pg.error().is_none());
}

#[test]
fn bad_arguments_are_refused_without_breaking_the_group() {
    if gpus().is_none() {
        return;
    }
    let pg = single("nccl-smoke-args");
    let b = || Buffer::from(vec![1.0f32, 2.0]);
    for work in [
        pg.broadcast(b(), 1),
        pg.send(b(), 0),
        pg.recv(b(), 0),
        pg.gather(b(), 3),
    ] {
        let err = work.wait(WAIT).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    }
    assert!(pg.error().is_none());
    let out = pg.all_reduce(b(), ReduceOp::Max).wait(WAIT).unwrap();
    assert_eq!(out.into_vec::<f32>().unwrap(), vec![1.0, 2.0]);
}

#[test]
fn ops_complete_in_issue_order_with_their_own_buffers() {
    if gpus().is_none() {
        return;
    }
    let pg = single("nccl-smoke-order");
    let works: Vec<_> = (0..64)
        .map(|k| pg.all_gather(Buffer::from(vec![k as i64; 1000 + k])))
        .collect();
    for (k, w) in works.into_iter().enumerate() {
        assert_eq!(
            w.wait(WAIT).unwrap().into_vec::<i64>().unwrap(),
            vec![k as i64; 1000 + k]
        );
    }
}

#[test]
fn abort_fails_everything_fast_and_the_next_round_builds() {
    if gpus().is_none() {
        return;
    }
    let store = Arc::new(InMemoryStore::new());
    let pg = ProcessGroup::nccl(
        config("nccl-smoke-abort", 0, 0, 1, store.clone()),
        Device::Cuda(0),
    )
    .unwrap();
    let queued: Vec<_> = (0..32)
        .map(|_| pg.all_reduce(Buffer::zeros(DType::F32, 1 << 20), ReduceOp::Sum))
        .collect();
    let started = Instant::now();
    pg.abort();
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "abort took {:?}",
        started.elapsed()
    );
    let mut aborted = 0;
    for w in queued {
        match w.wait(Duration::from_secs(5)) {
            Ok(_) => {}
            Err(Error::Aborted { rank: 0 }) => aborted += 1,
            Err(e) => panic!("unexpected {e}"),
        }
    }
    assert!(aborted > 0, "abort failed nothing");
    assert!(matches!(pg.error(), Some(Error::Aborted { .. })));
    let err = pg.barrier().wait(WAIT).unwrap_err();
    assert!(matches!(err, Error::Aborted { .. }), "{err}");
    drop(pg);

    let next =
        ProcessGroup::nccl(config("nccl-smoke-abort", 1, 0, 1, store), Device::Cuda(0)).unwrap();
    let out = next
        .all_gather(Buffer::from(vec![7u8; 5]))
        .wait(WAIT)
        .unwrap();
    assert_eq!(out.into_vec::<u8>().unwrap(), vec![7u8; 5]);
}

/// Runs `body(rank, group)` on `world` threads; rank r uses GPU `r % gpus`.
fn on_ranks<T: Send + 'static>(
    job: &str,
    world: usize,
    op_timeout: Duration,
    body: impl Fn(usize, ProcessGroup) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let store = Arc::new(InMemoryStore::new());
    let body = Arc::new(body);
    let gpus = cuda_device_count().max(1);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (store, body, job) = (store.clone(), body.clone(), job.to_string());
            std::thread::spawn(move || {
                let mut cfg = config(&job, 0, rank, world, store);
                cfg.op_timeout = op_timeout;
                let pg = ProcessGroup::nccl(cfg, Device::Cuda(rank % gpus)).expect("NCCL group");
                body(rank, pg)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

/// The largest power of two up to min(GPUs, 4), so that avg (1/n) is exact in every dtype;
/// 4 when ranks may share a GPU.
fn multi_world() -> Option<usize> {
    let n = gpus()?;
    if NcclBackend::several_ranks_per_gpu() || n >= 4 {
        return Some(4);
    }
    if n < 2 {
        return not_run(format!(
            "multi-rank NCCL tests need 2 or more GPUs (found {n}) or NCCL 2.30.3+ with \
             NCCL_MULTI_RANK_GPU_ENABLE=1"
        ));
    }
    Some(2)
}

#[test]
fn multi_rank_ops_give_closed_form_results() {
    let Some(world) = multi_world() else {
        return;
    };
    on_ranks(
        "nccl-smoke-multi",
        world,
        Duration::from_secs(30),
        move |rank, pg| {
            let n = world as f64;
            let k = |i: usize| (i % 5 + 1) as f64;
            for dtype in DType::ALL {
                let len = 7 * world + 3;
                let mine = |i: usize| (rank + 1) as f64 * k(i);
                let input = || Buffer::from_fn(dtype, len, mine);
                let sum = |i: usize| n * (n + 1.0) / 2.0 * k(i);
                let out = pg.all_reduce(input(), ReduceOp::Sum).wait(WAIT).unwrap();
                assert_values(&out, dtype, len, sum, "all_reduce sum");
                let out = pg.all_reduce(input(), ReduceOp::Max).wait(WAIT).unwrap();
                assert_values(&out, dtype, len, |i| n * k(i), "all_reduce max");
                let out = pg.all_reduce(input(), ReduceOp::Min).wait(WAIT).unwrap();
                assert_values(&out, dtype, len, k, "all_reduce min");
                let avg = |i: usize| {
                    let s = sum(i);
                    if dtype.is_float() {
                        s / n
                    } else {
                        (s as i64 / world as i64) as f64
                    }
                };
                let out = pg.all_reduce(input(), ReduceOp::Avg).wait(WAIT).unwrap();
                assert_values(&out, dtype, len, avg, "all_reduce avg");
                let out = pg
                    .reduce(input(), ReduceOp::Sum, world - 1)
                    .wait(WAIT)
                    .unwrap();
                if rank == world - 1 {
                    assert_values(&out, dtype, len, sum, "reduce");
                }
                let b = if rank == 1 {
                    input()
                } else {
                    Buffer::zeros(dtype, len)
                };
                let out = pg.broadcast(b, 1).wait(WAIT).unwrap();
                assert_values(&out, dtype, len, |i| 2.0 * k(i), "broadcast");
                let out = pg.all_gather(input()).wait(WAIT).unwrap();
                assert_values(
                    &out,
                    dtype,
                    len * world,
                    |j| ((j / len) + 1) as f64 * k(j % len),
                    "all_gather",
                );
                let seg = segment(len, world, rank);
                let out = pg
                    .reduce_scatter(input(), ReduceOp::Sum)
                    .wait(WAIT)
                    .unwrap();
                assert_values(
                    &out,
                    dtype,
                    seg.len(),
                    |i| sum(seg.start + i),
                    "reduce_scatter",
                );
                let b = if rank == 0 {
                    Buffer::from_fn(dtype, len, k)
                } else {
                    Buffer::zeros(dtype, seg.len())
                };
                let out = pg.scatter(b, 0).wait(WAIT).unwrap();
                assert_values(&out, dtype, seg.len(), |i| k(seg.start + i), "scatter");
                let out = pg.gather(input(), 0).wait(WAIT).unwrap();
                if rank == 0 {
                    assert_values(
                        &out,
                        dtype,
                        len * world,
                        |j| ((j / len) + 1) as f64 * k(j % len),
                        "gather",
                    );
                }
                // Rank r gets segment r of every rank's buffer, in rank order.
                let out = pg.all_to_all(input()).wait(WAIT).unwrap();
                let piece = seg.len();
                assert_values(
                    &out,
                    dtype,
                    piece * world,
                    |j| ((j / piece) + 1) as f64 * k(seg.start + j % piece),
                    "all_to_all",
                );
                // A ring of send/recv: everyone sends to the next rank and receives from the
                // previous; even ranks send first and odd ranks receive first, so the serial op
                // queues always pair up.
                let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
                let from_prev = |i: usize| (prev + 1) as f64 * k(i);
                if rank % 2 == 0 {
                    pg.send(input(), next).wait(WAIT).unwrap();
                    let got = pg.recv(Buffer::zeros(dtype, len), prev).wait(WAIT).unwrap();
                    assert_values(&got, dtype, len, from_prev, "recv");
                } else {
                    let got = pg.recv(Buffer::zeros(dtype, len), prev).wait(WAIT).unwrap();
                    assert_values(&got, dtype, len, from_prev, "recv");
                    pg.send(input(), next).wait(WAIT).unwrap();
                }
                pg.barrier().wait(WAIT).unwrap();
            }
        },
    );
}

#[test]
fn a_hung_peer_ends_in_a_timeout_not_a_hang() {
    let Some(world) = multi_world() else {
        return;
    };
    let results = on_ranks(
        "nccl-smoke-hang",
        world,
        Duration::from_secs(3),
        move |rank, pg| {
            pg.barrier().wait(WAIT).unwrap();
            if rank == world - 1 {
                // This rank never joins the all-reduce, as if it hung.
                std::thread::sleep(Duration::from_secs(6));
                pg.abort();
                return None;
            }
            let started = Instant::now();
            let err = pg
                .all_reduce(Buffer::zeros(DType::F32, 1024), ReduceOp::Sum)
                .wait(WAIT)
                .unwrap_err();
            let after = pg.barrier().wait(WAIT).unwrap_err();
            Some((err, started.elapsed(), after))
        },
    );
    for (rank, r) in results.into_iter().enumerate().take(world - 1) {
        let (err, elapsed, after) = r.expect("result");
        // NCCL cannot say which rank a collective waits on: the timeout names nobody.
        assert!(
            matches!(&err, Error::Timeout { waiting_on, .. } if waiting_on.is_empty()),
            "rank {rank}: {err}"
        );
        assert!(
            elapsed < Duration::from_secs(10),
            "rank {rank} took {elapsed:?}"
        );
        assert!(
            matches!(after, Error::GroupBroken { .. }),
            "rank {rank}: {after}"
        );
    }
}
