//! NCCL with several ranks, run where a GPU is: ranks as threads and as processes, sharing one
//! GPU when NCCL allows it (2.30.3 or newer with `NCCL_MULTI_RANK_GPU_ENABLE=1`) or one GPU
//! each. A killed rank process, an abort in flight, a round that never completes, and 20
//! create/abort rounds with flat thread and memory counts.
//!
//! Without a GPU and such an NCCL each test prints "not run" and returns; with
//! `REKINDLE_REQUIRE_GPU=1` (set by `scripts/gpu-check.sh`) it fails instead.
#![cfg(feature = "nccl")]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rekindle_runtime::store::{FileStore, InMemoryStore, Store};
use rekindle_runtime::{
    cuda_device_count, Buffer, DType, Device, Error, GroupConfig, NcclBackend, ProcessGroup,
    ReduceOp,
};

const WAIT: Duration = Duration::from_secs(60);

/// How many ranks to run and how many GPUs they share, or `None` (after saying why) when
/// several ranks cannot run here.
fn ranks_here(want: usize) -> Option<(usize, usize)> {
    let required = std::env::var_os("REKINDLE_REQUIRE_GPU").is_some();
    let not_run = |why: String| {
        assert!(!required, "REKINDLE_REQUIRE_GPU is set but {why}");
        eprintln!("not run: {why}");
        None
    };
    let gpus = cuda_device_count();
    if gpus == 0 {
        return not_run("no CUDA device or driver".into());
    }
    if let Err(e) = NcclBackend::library_version() {
        return not_run(e.to_string());
    }
    if gpus >= want || NcclBackend::several_ranks_per_gpu() {
        Some((want, gpus))
    } else {
        not_run(format!(
            "{want} ranks need {want} GPUs ({gpus} here) or NCCL 2.30.3+ with \
             NCCL_MULTI_RANK_GPU_ENABLE=1"
        ))
    }
}

fn config(job: &str, round: u64, rank: usize, world: usize, store: Arc<dyn Store>) -> GroupConfig {
    let mut cfg = GroupConfig::new(job, round, rank, world, store).expect("config");
    cfg.op_timeout = Duration::from_secs(8);
    cfg.bootstrap_timeout = Duration::from_secs(60);
    cfg
}

/// Runs `body(rank, group)` on `world` threads; rank r uses GPU `r % gpus`.
fn on_threads<T: Send + 'static>(
    job: &str,
    round: u64,
    world: usize,
    gpus: usize,
    store: Arc<InMemoryStore>,
    body: impl Fn(usize, ProcessGroup) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let body = Arc::new(body);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (store, body, job) = (store.clone(), body.clone(), job.to_string());
            std::thread::spawn(move || {
                let cfg = config(&job, round, rank, world, store);
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

#[test]
fn grouped_point_to_point_scatter_gather_and_all_to_all() {
    let Some((world, gpus)) = ranks_here(4) else {
        return;
    };
    on_threads(
        "nccl-multi-p2p",
        0,
        world,
        gpus,
        Arc::new(InMemoryStore::new()),
        move |rank, pg| {
            let n = 1000 + 7;
            // Everyone sends to every other rank at once: the sends and receives of one op are
            // grouped, so issue order cannot deadlock. Encoded as an all-to-all of rank-tagged data.
            let input = Buffer::from_fn(DType::I64, n * world, |i| (rank * 1_000_000 + i) as f64);
            let out = pg.all_to_all(input).wait(WAIT).unwrap();
            let seg = rekindle_runtime::segment(n * world, world, rank);
            for (j, v) in out.into_vec::<i64>().unwrap().into_iter().enumerate() {
                let (from, k) = (j / seg.len(), j % seg.len());
                assert_eq!(
                    v,
                    (from * 1_000_000 + seg.start + k) as i64,
                    "all_to_all [{j}]"
                );
            }
            let root = world - 1;
            let whole = Buffer::from_fn(DType::F32, n, |i| i as f64);
            let mine = rekindle_runtime::segment(n, world, rank);
            let b = if rank == root {
                whole
            } else {
                Buffer::zeros(DType::F32, mine.len())
            };
            let got = pg.scatter(b, root).wait(WAIT).unwrap();
            let want: Vec<f32> = mine.clone().map(|i| i as f32).collect();
            assert_eq!(got.into_vec::<f32>().unwrap(), want, "scatter");
            let got = pg
                .gather(Buffer::from(vec![rank as u8; 5]), 0)
                .wait(WAIT)
                .unwrap();
            if rank == 0 {
                let want: Vec<u8> = (0..world).flat_map(|r| [r as u8; 5]).collect();
                assert_eq!(got.into_vec::<u8>().unwrap(), want, "gather");
            }
            pg.barrier().wait(WAIT).unwrap();
        },
    );
}

#[test]
fn a_collective_without_one_rank_times_out_naming_nobody_and_abort_is_fast() {
    let Some((world, gpus)) = ranks_here(2) else {
        return;
    };
    // Rank 1 issues nothing after the first barrier: it waits (in this process) until rank 0
    // is done, then aborts. Rank 0's all-reduce is aborted in flight after 1 s.
    let done = Arc::new(std::sync::Barrier::new(world));
    let results = on_threads(
        "nccl-multi-abort",
        0,
        world,
        gpus,
        Arc::new(InMemoryStore::new()),
        move |rank, pg| {
            pg.barrier().wait(WAIT).unwrap();
            if rank == 1 {
                done.wait();
                pg.abort();
                return None;
            }
            let work = pg.all_reduce(Buffer::zeros(DType::F32, 1 << 20), ReduceOp::Sum);
            let aborter = {
                let pg = pg.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_secs(1));
                    let started = Instant::now();
                    pg.abort();
                    started.elapsed()
                })
            };
            let err = work.wait(WAIT).unwrap_err();
            let abort_took = aborter.join().unwrap();
            done.wait();
            Some((err, abort_took))
        },
    );
    let (err, abort_took) = results[0].clone().expect("rank 0");
    assert!(matches!(err, Error::Aborted { rank: 0 }), "{err}");
    assert!(
        abort_took < Duration::from_secs(1),
        "abort took {abort_took:?}"
    );
    eprintln!("abort in flight returned in {abort_took:?}");

    // The op deadline, not an abort: the timeout names nobody (NCCL cannot say who is late).
    let done = Arc::new(std::sync::Barrier::new(world));
    let results = on_threads(
        "nccl-multi-timeout",
        0,
        world,
        gpus,
        Arc::new(InMemoryStore::new()),
        move |rank, pg| {
            pg.barrier().wait(WAIT).unwrap();
            if rank == 1 {
                done.wait();
                pg.abort();
                return None;
            }
            let started = Instant::now();
            let err = pg
                .all_reduce(Buffer::zeros(DType::F32, 1024), ReduceOp::Sum)
                .wait(WAIT)
                .unwrap_err();
            let took = started.elapsed();
            pg.abort();
            done.wait();
            Some((err, took))
        },
    );
    let (err, took) = results[0].clone().expect("rank 0");
    assert!(
        matches!(&err, Error::Timeout { waiting_on, .. } if waiting_on.is_empty()),
        "{err}"
    );
    assert!(
        took < Duration::from_secs(30),
        "the 20 s deadline took {took:?}"
    );
}

#[test]
fn a_round_that_never_completes_fails_in_time_and_releases_the_root() {
    let Some((_, _)) = ranks_here(2) else {
        return;
    };
    // Rank 0 of 2 alone: the communicator cannot form.
    let store = Arc::new(InMemoryStore::new());
    let mut cfg = config("nccl-multi-alone", 0, 0, 2, store.clone());
    cfg.bootstrap_timeout = Duration::from_secs(3);
    let started = Instant::now();
    let err = ProcessGroup::nccl(cfg, Device::Cuda(0)).unwrap_err();
    assert!(matches!(err, Error::Bootstrap { .. }), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    // The id rank 0 published names the root; nothing listens there any more.
    let id = store
        .get("rekindle/nccl-multi-alone/round/0/pg/nccl/unique_id")
        .unwrap()
        .expect("the published id");
    let port = u16::from_be_bytes([id[10], id[11]]);
    let ip = std::net::Ipv4Addr::new(id[12], id[13], id[14], id[15]);
    if u16::from_ne_bytes([id[8], id[9]]) == 2 {
        let addr = std::net::SocketAddr::from((ip, port));
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok() {
            assert!(
                Instant::now() < deadline,
                "the bootstrap root at {addr} still listens"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Threads and resident memory of this process.
fn footprint() -> (usize, u64) {
    let threads = std::fs::read_dir("/proc/self/task")
        .map(|d| d.count())
        .unwrap_or(0);
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    (threads, pages * 4096)
}

#[test]
fn twenty_create_abort_rounds_leave_threads_and_memory_flat() {
    let Some((world, gpus)) = ranks_here(2) else {
        return;
    };
    let store = Arc::new(InMemoryStore::new());
    let mut marks = Vec::new();
    for round in 0..20u64 {
        on_threads(
            "nccl-multi-rounds",
            round,
            world,
            gpus,
            store.clone(),
            |rank, pg| {
                let out = pg
                    .all_reduce(Buffer::from(vec![rank as f32 + 1.0; 4096]), ReduceOp::Sum)
                    .wait(WAIT)
                    .unwrap();
                assert_eq!(out.into_vec::<f32>().unwrap(), vec![3.0; 4096]);
                let started = Instant::now();
                pg.abort();
                assert!(
                    started.elapsed() < Duration::from_secs(1),
                    "{:?}",
                    started.elapsed()
                );
            },
        );
        let (threads, rss) = footprint();
        eprintln!(
            "round {round}: {threads} threads, {} MiB resident",
            rss >> 20
        );
        marks.push((threads, rss));
    }
    let (t3, m3) = marks[3];
    let (t19, m19) = marks[19];
    assert!(
        t19 <= t3 + 2,
        "threads grew from {t3} (round 3) to {t19} (round 19)"
    );
    assert!(
        m19 <= m3 + (64 << 20),
        "resident memory grew from {} MiB to {} MiB",
        m3 >> 20,
        m19 >> 20
    );
}

/// The environment variable that makes this binary a rank process of
/// [`a_killed_rank_process_fails_the_survivors`]: `rank,world,store dir`.
const CHILD_ENV: &str = "REKINDLE_NCCL_TEST_CHILD";

/// One rank process: joins, reports, runs an all-reduce (rank `world - 1` never does and waits
/// to be killed), reports the error and how long abort took.
#[test]
fn child_rank() {
    let Some(spec) = std::env::var(CHILD_ENV).ok() else {
        return;
    };
    let mut parts = spec.splitn(3, ',');
    let rank: usize = parts.next().unwrap().parse().unwrap();
    let world: usize = parts.next().unwrap().parse().unwrap();
    let dir = parts.next().unwrap().to_string();
    let store: Arc<dyn Store> = Arc::new(FileStore::new(&dir).unwrap());
    let mut cfg = config("nccl-multi-kill", 0, rank, world, store);
    cfg.op_timeout = Duration::from_secs(10);
    let gpus = cuda_device_count().max(1);
    let pg = ProcessGroup::nccl(cfg, Device::Cuda(rank % gpus)).expect("NCCL group");
    pg.barrier().wait(WAIT).unwrap();
    println!("JOINED {rank}");
    if rank == world - 1 {
        // Wait to be killed (the parent's deadline bounds this).
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
        return;
    }
    let started = Instant::now();
    let err = pg
        .all_reduce(Buffer::zeros(DType::F32, 1 << 16), ReduceOp::Sum)
        .wait(WAIT)
        .unwrap_err();
    let kind = match &err {
        Error::PeerLost { .. } => "peer_lost",
        Error::PeerLostUnidentified { .. } => "peer_lost_unidentified",
        Error::Timeout { .. } => "timeout",
        _ => "other",
    };
    println!(
        "ERROR {rank} {kind} {} {err}",
        started.elapsed().as_millis()
    );
    let started = Instant::now();
    pg.abort();
    println!("ABORTED {rank} {}", started.elapsed().as_millis());
}

fn spawn_rank(rank: usize, world: usize, dir: &Path) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_rank", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, format!("{rank},{world},{}", dir.display()))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn a rank process")
}

#[test]
fn a_killed_rank_process_fails_the_survivors() {
    let Some((world, _)) = ranks_here(3) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (tx, rx) = mpsc::channel::<String>();
    let mut children: Vec<Child> = (0..world)
        .map(|r| spawn_rank(r, world, dir.path()))
        .collect();
    for child in &mut children {
        let out = child.stdout.take().unwrap();
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut lines = Vec::new();
    let mut next = |what: &str| -> String {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("no {what} line; got {lines:?}"));
        lines.push(line.clone());
        line
    };
    let mut joined = 0;
    while joined < world {
        if next("JOINED").starts_with("JOINED") {
            joined += 1;
        }
    }
    let victim = &mut children[world - 1];
    victim.kill().unwrap();
    victim.wait().unwrap();
    let mut errors = Vec::new();
    let mut aborts = Vec::new();
    while errors.len() < world - 1 || aborts.len() < world - 1 {
        let line = next("ERROR/ABORTED");
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.first() {
            Some(&"ERROR") => errors.push((f[2].to_string(), f[3].parse::<u64>().unwrap())),
            Some(&"ABORTED") => aborts.push(f[2].parse::<u64>().unwrap()),
            _ => {}
        }
    }
    for child in &mut children[..world - 1] {
        assert!(child.wait().unwrap().success());
    }
    eprintln!("survivors: {errors:?}, abort ms {aborts:?}");
    for (kind, ms) in &errors {
        assert!(
            ["peer_lost", "peer_lost_unidentified", "timeout"].contains(&kind.as_str()),
            "{kind}"
        );
        assert!(*ms < 15_000, "the survivor's error took {ms} ms");
    }
    assert!(
        aborts.iter().all(|&ms| ms < 1000),
        "abort took {aborts:?} ms"
    );
}
