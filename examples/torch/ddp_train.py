"""A plain PyTorch DDP training script, as torchrun runs it: identity from the environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), ``init_process_group`` with
``env://``, gloo on CPU or nccl on GPUs. Nothing in it knows about rekindle:

    rekindle run --standalone --nproc-per-node 2 python examples/torch/ddp_train.py
    torchrun --standalone --nproc-per-node 2 examples/torch/ddp_train.py

The batches of step ``s`` depend only on ``s`` and the world size, and rank 0 checkpoints the
model and the optimizer every ``--checkpoint-every`` steps (written to a temporary file, then
renamed), so a run that is killed and restarted from its newest checkpoint ends with the same
parameters as one that was not. At the end rank 0 prints ``fingerprint <sha256>`` of the
parameters.
"""

import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

IN, HIDDEN, OUT = 16, 32, 4


def batch(step, rank, world, per_rank):
    """This rank's share of step ``step``'s global batch: a linear target plus noise."""
    g = torch.Generator().manual_seed(1000 + step)
    w = torch.linspace(-1.0, 1.0, IN * OUT).reshape(IN, OUT)
    x = torch.randn(world * per_rank, IN, generator=g)
    y = x @ w + 0.01 * torch.randn(world * per_rank, OUT, generator=g)
    lo = rank * per_rank
    return x[lo : lo + per_rank], y[lo : lo + per_rank]


def latest_checkpoint(directory):
    if not directory or not os.path.isdir(directory):
        return None
    steps = [
        int(n[len("step-") : -len(".pt")])
        for n in os.listdir(directory)
        if n.startswith("step-") and n.endswith(".pt")
    ]
    return os.path.join(directory, f"step-{max(steps)}.pt") if steps else None


def save_checkpoint(directory, step, model, opt):
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"step-{step}.pt")
    tmp = path + f".tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument(
        "--min-step-time",
        type=float,
        default=0.0,
        help="seconds each step takes at least (to have time to interrupt a short run)",
    )
    args = p.parse_args()

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    print(f"started rank={rank} pid={os.getpid()} restart={restart}", flush=True)

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method="env://")
    print(f"joined rank={rank} world={world} backend={backend}", flush=True)

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT)
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start = 0
    ckpt = latest_checkpoint(args.checkpoint_dir)
    if ckpt:
        state = torch.load(ckpt, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        print(f"resumed rank={rank} step={start}", flush=True)
    ddp = DDP(model, device_ids=[local_rank] if backend == "nccl" else None)

    for step in range(start, args.steps):
        t0 = time.monotonic()
        x, y = batch(step, rank, world, args.batch)
        loss = torch.nn.functional.mse_loss(ddp(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} rank {rank} loss {loss.item():.6f}", flush=True)
        done = step + 1
        if args.checkpoint_dir and rank == 0 and done % args.checkpoint_every == 0:
            save_checkpoint(args.checkpoint_dir, done, model, opt)
        left = args.min_step_time - (time.monotonic() - t0)
        if left > 0:
            time.sleep(left)

    flat = torch.cat([p.detach().cpu().flatten() for p in model.parameters()])
    if rank == 0:
        digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
        print(f"fingerprint {digest}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
