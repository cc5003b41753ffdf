"""How fast a PyTorch job restarts after a worker is SIGKILLed, under `rekindle run` and
under torchrun: a 2-rank ddp_train.py run with --max-restarts, one worker killed per round
once it trains. Timed from the kill: the launcher's restart decision (rekindle prints it), the
start of the replacement process (its start time in /proc, on the same clock as the kill:
the launcher's share), and the replacement's first line, printed after ``import torch`` (the
difference is Python's start-up). The restarted workers must train again for a round to
count.

    python examples/torch/restart_bench.py --rekindle target/release/rekindle --rounds 3 --csv restart.csv

Prints a table of medians; ``--csv`` writes every measurement.
"""

import argparse
import csv
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "ddp_train.py")


def startup_seconds(python):
    t0 = time.monotonic()
    subprocess.run([python, "-c", "import torch, torch.distributed"], check=True)
    return time.monotonic() - t0


class Job:
    """A launcher process whose output lines are timestamped as they arrive."""

    def __init__(self, argv, env, log=None):
        self.p = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.lines = queue.Queue()
        self.seen = []
        self.log = open(log, "w") if log else None
        # The restart count of the newest worker seen to start.
        self.restart = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            if self.log:
                self.log.write(line)
                self.log.flush()
            self.lines.put((time.monotonic(), line.rstrip("\n")))
        self.lines.put((time.monotonic(), None))

    def wait_for(self, needle, timeout, also=""):
        """Returns (arrival time, line) of the first line from now on containing needle (and
        ``also``)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no line with {needle!r}; last lines: {self.seen[-20:]}")
            try:
                t, line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"exited before {needle!r}; last lines: {self.seen[-20:]}")
            self.seen.append(line)
            # torchrun does not prefix its workers' lines, which can run together.
            counts = [int(c) for c in re.findall(r"started rank=\d+ pid=\d+ restart=(\d+)", line)]
            if counts:
                self.restart = max(counts)
            if needle in line and also in line:
                return t, line

    def stop(self):
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()


def pid_of(line, rank=None):
    """The pid in a "started" line (of ``rank`` if given; lines can run together)."""
    who = r"\d+" if rank is None else str(rank)
    return int(re.search(rf"started rank={who} pid=(\d+)", line).group(1))


def boottime():
    """Now, in seconds since boot (the clock of /proc/<pid>/stat's start time)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def started_at(pid):
    """When process ``pid`` started, in seconds since boot."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # Field 22 of the file; the split starts at field 3.
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


def measure(launcher, argv, env, rounds, timeout, log):
    job = Job(argv, env, log)
    rows = []
    try:
        _, line = job.wait_for("started rank=1 ", timeout)
        for r in range(rounds):
            print(f"{launcher}: round {r}", flush=True)
            pid = pid_of(line, rank=1)
            job.wait_for("step ", timeout)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                raise RuntimeError(f"rank 1 (pid {pid}) exited before the kill") from None
            killed = time.monotonic()
            killed_boot = boottime()
            decided = None
            if launcher == "rekindle":
                decided, _ = job.wait_for("restarting workers", timeout)
            restarted = f"restart={r + 1}"
            up, first = job.wait_for(restarted, timeout)
            line = first
            if "started rank=1 " not in first:
                _, line = job.wait_for("started rank=1 ", timeout, also=restarted)
            spawned = started_at(pid_of(first)) - killed_boot
            # The restarted workers must train again, not just start, after one restart.
            job.wait_for("step ", timeout)
            if job.restart != r + 1:
                raise RuntimeError(
                    f"one kill took {job.restart - r} restarts to train again "
                    "(the first restarted workers failed)"
                )
            rows.append(
                {
                    "launcher": launcher,
                    "round": r,
                    "kill_to_decision_s": (decided - killed) if decided else "",
                    "kill_to_spawn_s": spawned,
                    "kill_to_first_line_s": up - killed,
                }
            )
    except (TimeoutError, RuntimeError) as e:
        print(f"{launcher}: {e}", file=sys.stderr, flush=True)
        rows.append({"launcher": launcher, "round": len(rows), "failed": str(e)[:200]})
    finally:
        job.stop()
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rekindle", required=True, help="the rekindle binary")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--rounds", type=int, default=3, help="kills per launcher")
    p.add_argument("--no-torchrun", action="store_true")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--csv")
    p.add_argument("--logs", help="a directory for each launcher's whole output")
    args = p.parse_args()

    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    train = [SCRIPT, "--steps", "100000", "--min-step-time", "0.2"]
    restarts = str(args.rounds)
    launchers = {
        "rekindle": [
            args.rekindle, "run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", restarts, "--monitor-interval", "0.1", args.python, *train,
        ],
        "torchrun": [
            args.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", "--max-restarts", restarts, "--monitor-interval", "0.1", *train,
        ],
    }
    if args.no_torchrun:
        del launchers["torchrun"]

    startups = [startup_seconds(args.python) for _ in range(3)]
    startup = statistics.median(startups)
    rows = []
    for name, argv in launchers.items():
        log = os.path.join(args.logs, f"{name}.log") if args.logs else None
        if args.logs:
            os.makedirs(args.logs, exist_ok=True)
        rows += measure(name, argv, env, args.rounds, args.timeout, log)

    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    print(f"python -c 'import torch' alone (median of 3): {startup:.3f} s")
    print("medians over the rounds, seconds from the SIGKILL:")
    print(f"{'launcher':<10} {'decision':>9} {'new process':>12} {'first line':>11} {'python start-up':>16}")
    for name in launchers:
        mine = [r for r in rows if r["launcher"] == name and "failed" not in r]
        failed = [r for r in rows if r["launcher"] == name and "failed" in r]
        if mine:
            dec = [r["kill_to_decision_s"] for r in mine if r["kill_to_decision_s"] != ""]
            dec_s = f"{statistics.median(dec):.3f}" if dec else "-"
            spawn = statistics.median(r["kill_to_spawn_s"] for r in mine)
            up = statistics.median(r["kill_to_first_line_s"] for r in mine)
            print(f"{name:<10} {dec_s:>9} {spawn:>12.3f} {up:>11.3f} {up - spawn:>16.3f}")
        if failed:
            print(f"{name:<10} round {failed[0]['round']} did not recover: {failed[0]['failed']}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(
                f,
                [
                    "launcher",
                    "round",
                    "kill_to_decision_s",
                    "kill_to_spawn_s",
                    "kill_to_first_line_s",
                    "startup_s",
                    "failed",
                ],
            )
            w.writeheader()
            for r in rows:
                w.writerow(dict(r, startup_s=f"{startup:.3f}"))


if __name__ == "__main__":
    main()
