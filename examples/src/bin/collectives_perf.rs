//! collectives_perf: bandwidth and latency of rekindle's collectives, modelled on nccl-tests.
//!
//! `collectives_perf --op all_reduce --nranks 2 -b 4K -e 256M -f 4 -n 20 -w 5 -c 1` spawns two
//! local rank processes (bootstrapping through a `FileStore` in a temp dir), runs each size
//! `-w` times untimed and `-n` times timed, and prints, like nccl-tests:
//! `size count type time_us algbw busbw #wrong`. `time_us` is the median over iterations of
//! the slowest rank's time; bandwidths are in GB/s; busbw uses nccl-tests' factors
//! (all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all, scatter, gather (n-1)/n;
//! broadcast, reduce 1). `size` is the largest buffer of the operation (the gathered output,
//! the scattered input). `-c 1` checks every result against closed-form values. `--no-shm`
//! moves every byte over TCP; `--wire mac|encrypt` (or `REKINDLE_WIRE`) chooses how TCP frames
//! are sealed; `--csv` rows record both (`transport`, `wire` columns).

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use rekindle_runtime::collectives::check::{reduce_expected, reduce_input, value};
use rekindle_runtime::store::{FileStore, Store};
use rekindle_runtime::{
    segment, Buffer, DType, GroupConfig, JobSecret, ProcessGroup, ReduceOp, TcpOptions, WireMode,
};

#[derive(Parser, Debug, Clone)]
#[command(about = "Collective bandwidth/latency benchmark (nccl-tests style)")]
struct Args {
    /// all_reduce, broadcast, reduce, all_gather, reduce_scatter, scatter, gather, all_to_all,
    /// sendrecv, or `all` for every one.
    #[arg(long, default_value = "all_reduce")]
    op: String,
    /// Number of local rank processes to spawn.
    #[arg(long, default_value_t = 2)]
    nranks: usize,
    /// Smallest size in bytes (suffixes K, M, G).
    #[arg(short = 'b', long = "minbytes", default_value = "4K", value_parser = parse_size)]
    min_bytes: usize,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = parse_size)]
    max_bytes: usize,
    /// Size multiplication factor between steps.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 4)]
    factor: usize,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    iters: usize,
    /// Untimed warm-up iterations per size.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    warmup: usize,
    /// Check results (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    check: u8,
    /// Element type.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Reduction for reducing ops.
    #[arg(long, default_value = "sum")]
    redop: String,
    /// Append the rows to this CSV file (written by rank 0).
    #[arg(long)]
    csv: Option<std::path::PathBuf>,
    /// TCP backend chunk size in bytes.
    #[arg(long, value_parser = parse_size)]
    max_segment: Option<usize>,
    /// TCP backend threshold of the direct all-reduce, in bytes.
    #[arg(long, value_parser = parse_size)]
    small_bytes: Option<usize>,
    /// Kernel socket buffer size to request, in bytes.
    #[arg(long, value_parser = parse_size)]
    sockbuf: Option<usize>,
    /// Move every byte over TCP sockets, never through shared memory.
    #[arg(long)]
    no_shm: bool,
    /// Shared-memory ring size per direction, in bytes.
    #[arg(long, value_parser = parse_size)]
    ring: Option<usize>,
    /// How TCP frames are protected: `mac` (authenticated, the default) or `encrypt`
    /// (AES-256-GCM). Frames through shared-memory rings are never sealed.
    #[arg(long, env = "REKINDLE_WIRE", default_value = "mac")]
    wire: WireMode,
    /// Pin rank r (and the threads it starts) to CPU r mod the number of CPUs this process may
    /// use, so ring neighbours sit on different cores when ranks outnumber cores.
    #[arg(long)]
    bind: bool,
}

fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .map(|n| n * mult)
        .map_err(|_| format!("invalid size {s:?}: expected a number with an optional K, M or G"))
}

const OPS: [&str; 9] = [
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "scatter",
    "gather",
    "all_to_all",
    "sendrecv",
];

fn bus_factor(op: &str, n: usize) -> f64 {
    let n_f = n as f64;
    match op {
        "all_reduce" => 2.0 * (n_f - 1.0) / n_f,
        "all_gather" | "reduce_scatter" | "all_to_all" | "scatter" | "gather" => (n_f - 1.0) / n_f,
        _ => 1.0,
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Ok(rank) = std::env::var("REKINDLE_PERF_RANK") {
        return rank_main(args, rank.parse().context("REKINDLE_PERF_RANK")?);
    }
    if args.nranks == 0 {
        bail!("--nranks must be at least 1");
    }
    if args.factor < 2 {
        bail!("-f must be at least 2");
    }
    if args.min_bytes > args.max_bytes {
        bail!("-b must not exceed -e");
    }
    let ops: Vec<&str> = if args.op == "all" {
        OPS.to_vec()
    } else {
        vec![args.op.as_str()]
    };
    for op in &ops {
        if !OPS.contains(op) {
            bail!("unknown --op {op:?}: expected one of {OPS:?} or all");
        }
    }
    args.dtype.parse::<DType>()?;
    args.redop.parse::<ReduceOp>()?;
    let dir = tempfile::tempdir().context("creating the store directory")?;
    let exe = std::env::current_exe().context("locating this executable")?;
    let mut children = Vec::new();
    for rank in 0..args.nranks {
        let child = Command::new(&exe)
            .args(std::env::args_os().skip(1))
            .env("REKINDLE_PERF_RANK", rank.to_string())
            .env("REKINDLE_PERF_WORLD", args.nranks.to_string())
            .env("REKINDLE_PERF_STORE", dir.path())
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("spawning rank {rank}"))?;
        children.push(child);
    }
    let mut failed = Vec::new();
    for (rank, mut c) in children.into_iter().enumerate() {
        let status = c
            .wait()
            .with_context(|| format!("waiting for rank {rank}"))?;
        if !status.success() {
            failed.push((rank, status));
        }
    }
    if !failed.is_empty() {
        bail!("ranks failed: {failed:?}");
    }
    Ok(())
}

fn input(op: &str, dtype: DType, redop: ReduceOp, rank: usize, len: usize) -> Buffer {
    match op {
        "all_reduce" | "reduce" | "reduce_scatter" => {
            Buffer::from_fn(dtype, len, |i| reduce_input(redop, rank, i))
        }
        _ => Buffer::from_fn(dtype, len, |i| value(rank, i)),
    }
}

/// Elements per rank buffer for an op whose largest buffer is `bytes`.
fn count_for(op: &str, bytes: usize, w: usize, n: usize) -> usize {
    match op {
        "all_gather" | "gather" => bytes / w / n,
        _ => bytes / w,
    }
}

/// The buffers this rank passes to `op`, built outside the timed region: the input, and for
/// `sendrecv` the receive buffer.
fn prepare(
    pg: &ProcessGroup,
    op: &str,
    dtype: DType,
    redop: ReduceOp,
    count: usize,
) -> (Buffer, Buffer) {
    let (rank, n) = (pg.rank(), pg.world_size());
    let input = if op == "scatter" && rank != 0 {
        Buffer::zeros(dtype, segment(count, n, rank).len())
    } else {
        input(op, dtype, redop, rank, count)
    };
    // The receive buffer of sendrecv, or the output of an op that writes a new shape.
    let seg = segment(count, n, rank).len();
    let out_len = match op {
        "sendrecv" => count,
        "all_gather" => count * n,
        "gather" if rank == 0 => count * n,
        "reduce_scatter" => seg,
        "all_to_all" => seg * n,
        _ => 0,
    };
    let spare = Buffer::from_fn(dtype, out_len, |_| 0.0);
    (input, spare)
}

/// Buffers an iteration hands back for the next: (input, output or receive buffer).
type Spare = (Option<Buffer>, Option<Buffer>);

/// One iteration on buffers from [`prepare`]; returns the number of wrong elements when
/// `check`.
fn run_once(
    pg: &ProcessGroup,
    op: &str,
    dtype: DType,
    redop: ReduceOp,
    count: usize,
    (buf, rbuf): (Buffer, Buffer),
    check: bool,
) -> Result<(usize, Spare)> {
    let (rank, n) = (pg.rank(), pg.world_size());
    let wait = Duration::from_secs(120);
    let mut wrong = 0;
    // Buffers are handed back for the next iteration, as nccl-tests reuses its buffers: the
    // in-place ops return both, the others their output (written through the `_into` calls);
    // a consumed input is cloned afresh outside the timed region.
    let mut reuse: Spare = (None, None);
    let mut cmp = |got: &Buffer, want: &dyn Fn(usize) -> f64| {
        if check {
            wrong += (0..got.len())
                .filter(|&i| got.get_f64(i) != Some(want(i)))
                .count();
        }
    };
    match op {
        "all_reduce" => {
            let got = pg.all_reduce(buf, redop).wait(wait)?;
            cmp(&got, &|i| reduce_expected(redop, dtype, n, i));
            reuse = (Some(got), Some(rbuf));
        }
        "reduce" => {
            let got = pg.reduce(buf, redop, 0).wait(wait)?;
            if rank == 0 {
                cmp(&got, &|i| reduce_expected(redop, dtype, n, i));
            }
            reuse = (Some(got), Some(rbuf));
        }
        "reduce_scatter" => {
            let got = pg.reduce_scatter_into(buf, redop, rbuf).wait(wait)?;
            let s = segment(count, n, rank);
            cmp(&got, &|t| reduce_expected(redop, dtype, n, s.start + t));
            reuse.1 = Some(got);
        }
        "broadcast" => {
            let got = pg.broadcast(buf, 0).wait(wait)?;
            cmp(&got, &|i| value(0, i));
            reuse = (Some(got), Some(rbuf));
        }
        "all_gather" => {
            let got = pg.all_gather_into(buf, rbuf).wait(wait)?;
            cmp(&got, &|k| value(k / count.max(1), k % count.max(1)));
            reuse.1 = Some(got);
        }
        "gather" => {
            if rank == 0 {
                let got = pg.gather_into(buf, 0, rbuf).wait(wait)?;
                cmp(&got, &|k| value(k / count.max(1), k % count.max(1)));
                reuse.1 = Some(got);
            } else {
                reuse.0 = Some(pg.gather(buf, 0).wait(wait)?);
            }
        }
        "scatter" => {
            let s = segment(count, n, rank);
            let got = pg.scatter(buf, 0).wait(wait)?;
            cmp(&got, &|t| value(0, s.start + t));
            if rank != 0 {
                reuse.0 = Some(got);
            }
        }
        "all_to_all" => {
            let got = pg.all_to_all_into(buf, rbuf).wait(wait)?;
            let s = segment(count, n, rank);
            let block = s.len().max(1);
            cmp(&got, &|k| value(k / block, s.start + k % block));
            reuse.1 = Some(got);
        }
        "sendrecv" => {
            // Each rank sends to the next and receives from the previous, in an order that
            // cannot deadlock.
            let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
            let got = if n == 1 {
                buf
            } else if rank % 2 == 0 {
                pg.send(buf, next).wait(wait)?;
                pg.recv(rbuf, prev).wait(wait)?
            } else {
                let got = pg.recv(rbuf, prev).wait(wait)?;
                pg.send(buf, next).wait(wait)?;
                got
            };
            cmp(&got, &|i| value(if n == 1 { rank } else { prev }, i));
        }
        other => bail!("unknown op {other}"),
    }
    Ok((wrong, reuse))
}

/// Pins this process to the `rank mod n`-th of the n CPUs it may run on.
fn bind_to_cpu(rank: usize) -> Result<()> {
    // SAFETY: cpu_set_t is plain data; the calls get and set this process's own affinity.
    unsafe {
        let mut allowed: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut allowed) != 0 {
            bail!("sched_getaffinity: {}", std::io::Error::last_os_error());
        }
        let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &allowed))
            .collect();
        if cpus.is_empty() {
            bail!("no CPU in this process's affinity mask");
        }
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpus[rank % cpus.len()], &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            bail!("sched_setaffinity: {}", std::io::Error::last_os_error());
        }
    }
    Ok(())
}

fn rank_main(args: Args, rank: usize) -> Result<()> {
    if args.bind {
        bind_to_cpu(rank)?;
    }
    let world: usize = std::env::var("REKINDLE_PERF_WORLD")?.parse()?;
    let dir = std::env::var("REKINDLE_PERF_STORE")?;
    let store: Arc<dyn Store> = Arc::new(FileStore::new(dir)?);
    let dtype: DType = args.dtype.parse()?;
    let redop: ReduceOp = args.redop.parse()?;
    let mut opts = TcpOptions::default();
    if let Some(m) = args.max_segment {
        opts.max_segment_bytes = m;
    }
    if let Some(s) = args.small_bytes {
        opts.small_message_bytes = s;
    }
    opts.socket_buffer_bytes = args.sockbuf;
    opts.shared_memory = !args.no_shm;
    if let Some(r) = args.ring {
        opts.shm_ring_bytes = r;
    }
    opts.wire = Some(args.wire);
    let cfg = GroupConfig {
        job: "collectives-perf".into(),
        round: 0,
        rank,
        world_size: world,
        store,
        secret: JobSecret::from_env()?,
        op_timeout: Duration::from_secs(120),
        bootstrap_timeout: Duration::from_secs(60),
    };
    let pg = ProcessGroup::tcp(cfg, opts)?;
    let wait = Duration::from_secs(120);
    let ops: Vec<&str> = if args.op == "all" {
        OPS.to_vec()
    } else {
        vec![args.op.as_str()]
    };
    let w = dtype.size_in_bytes();
    let mut csv = match (&args.csv, rank) {
        (Some(path), 0) => {
            let exists = path.exists();
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("opening {}", path.display()))?;
            if !exists {
                writeln!(
                    f,
                    "op,nranks,size,count,type,redop,time_us,algbw_gbps,busbw_gbps,wrong,transport,wire"
                )?;
            }
            Some(f)
        }
        _ => None,
    };
    for op in ops {
        if rank == 0 {
            println!(
                "# {op}  nranks {world}  dtype {dtype}  redop {redop}  iters {}  warmup {}  wire {}",
                args.iters, args.warmup, args.wire
            );
            println!(
                "{:>12} {:>12} {:>6} {:>10} {:>8} {:>8} {:>7}",
                "size", "count", "type", "time_us", "algbw", "busbw", "#wrong"
            );
        }
        let mut size = args.min_bytes.max(w * world);
        while size <= args.max_bytes {
            let count = count_for(op, size, w, world);
            let template = prepare(&pg, op, dtype, redop, count);
            let mut spare: Spare = (None, None);
            let next = |spare: &mut Spare| {
                (
                    spare.0.take().unwrap_or_else(|| template.0.clone()),
                    spare.1.take().unwrap_or_else(|| template.1.clone()),
                )
            };
            for _ in 0..args.warmup {
                let bufs = next(&mut spare);
                spare = run_once(&pg, op, dtype, redop, count, bufs, false)?.1;
            }
            let mut times = Vec::with_capacity(args.iters);
            for _ in 0..args.iters {
                let bufs = next(&mut spare);
                pg.barrier().wait(wait)?;
                let t = Instant::now();
                spare = run_once(&pg, op, dtype, redop, count, bufs, false)?.1;
                times.push(t.elapsed().as_secs_f64());
            }
            times.sort_by(|a, b| a.total_cmp(b));
            let median = if times.is_empty() {
                0.0
            } else {
                times[times.len() / 2]
            };
            let slowest = pg
                .all_reduce(Buffer::from(vec![median]), ReduceOp::Max)
                .wait(wait)?;
            let t = slowest
                .into_vec::<f64>()
                .map_err(|_| anyhow::anyhow!("dtype"))?[0];
            let wrong = if args.check == 1 {
                let wr = run_once(&pg, op, dtype, redop, count, template, true)?.0;
                let all = pg
                    .all_reduce(Buffer::from(vec![wr as i64]), ReduceOp::Sum)
                    .wait(wait)?;
                all.into_vec::<i64>()
                    .map_err(|_| anyhow::anyhow!("dtype"))?[0]
            } else {
                -1
            };
            if rank == 0 {
                let bytes = (count_for(op, size, w, world)
                    * w
                    * if matches!(op, "all_gather" | "gather") {
                        world
                    } else {
                        1
                    }) as f64;
                let algbw = if t > 0.0 { bytes / t / 1e9 } else { 0.0 };
                let busbw = algbw * bus_factor(op, world);
                let wrong_s = if wrong < 0 {
                    "N/A".to_string()
                } else {
                    wrong.to_string()
                };
                println!(
                    "{:>12} {:>12} {:>6} {:>10.1} {:>8.2} {:>8.2} {:>7}",
                    bytes as usize,
                    count,
                    dtype.as_str(),
                    t * 1e6,
                    algbw,
                    busbw,
                    wrong_s
                );
                if let Some(f) = csv.as_mut() {
                    let transport = if args.no_shm { "tcp" } else { "shm" };
                    writeln!(f, "{op},{world},{},{count},{dtype},{redop},{:.2},{algbw:.4},{busbw:.4},{wrong},{transport},{}", bytes as usize, t * 1e6, args.wire)?;
                }
            }
            if wrong > 0 {
                bail!("{op}: {wrong} wrong elements at size {size}");
            }
            size *= args.factor;
        }
    }
    // Peak resident memory, against the largest user buffer: the backend's own memory is the
    // difference (staging chunks, rings).
    let peak = peak_rss_bytes();
    let all = pg
        .all_reduce(Buffer::from(vec![peak as i64]), ReduceOp::Max)
        .wait(wait)?;
    if rank == 0 {
        let max = all
            .into_vec::<i64>()
            .map_err(|_| anyhow::anyhow!("dtype"))?[0];
        println!(
            "# peak RSS of the largest rank: {:.1} MiB (largest buffer {:.1} MiB)",
            max as f64 / (1 << 20) as f64,
            args.max_bytes as f64 / (1 << 20) as f64
        );
    }
    pg.barrier().wait(wait)?;
    Ok(())
}

fn peak_rss_bytes() -> u64 {
    // SAFETY: getrusage fills the struct we pass.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return 0;
    }
    u.ru_maxrss.max(0) as u64 * 1024
}
