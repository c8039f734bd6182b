"""A small data-parallel regression trained with torch DistributedDataParallel.

Nothing here knows TunePlane: the script reads what torch.distributed reads (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, which the Node sets for every rank), takes --steps and
--learning_rate as the pytorch/process-group recipe passes them, and logs with torch's own
SummaryWriter into a directory of its choosing under $TUNEPLANE_OUT_DIR. The Node's collector
finds those event files there and ships them, so the curves reach `tp metrics` unwrapped.

Run it without TunePlane too, on one machine:
    torchrun --nproc-per-node 2 train.py --steps 50
(it then logs to ./runs/ddp).
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.tensorboard import SummaryWriter

FEATURES = 32
HIDDEN = 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--learning_rate", type=float, default=0.01, help="peak learning rate")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per rank and step")
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="where rank 0 writes TensorBoard event files "
        "(default: $TUNEPLANE_OUT_DIR/tb, or ./runs/ddp outside TunePlane)",
    )
    return parser.parse_args()


def pick_device(local_rank: int) -> tuple[torch.device, str]:
    """CUDA with NCCL when this process sees a GPU, else the CPU with gloo.

    On a TunePlane Node each rank's CUDA_VISIBLE_DEVICES names only its own GPU, so that GPU is
    device 0; under torchrun on one machine every rank sees them all and takes its LOCAL_RANK-th.
    A Node with simulated GPUs (and the CPU-only torch wheel) has no CUDA device at all: the
    script then really trains on the CPU, with gloo, and says so on stdout.
    """
    if torch.cuda.is_available():
        index = 0 if torch.cuda.device_count() == 1 else local_rank
        torch.cuda.set_device(index)
        return torch.device("cuda", index), "nccl"
    # Ranks on one machine share its cores; without this each would start one thread per core.
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return torch.device("cpu"), "gloo"


def default_log_dir() -> Path:
    out_dir = os.environ.get("TUNEPLANE_OUT_DIR")
    return Path(out_dir) / "tb" if out_dir else Path("runs") / "ddp"


def synthetic_batches(
    rank: int, batch_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of a fixed regression problem: y = tanh(x @ w) + noise.

    Every rank draws the same true weights (seed 0) and its own inputs (seed 1 + rank), as a
    DistributedSampler would hand each rank its own part of one dataset.
    """
    truth = torch.Generator().manual_seed(0)
    weights = torch.randn(FEATURES, 1, generator=truth)
    own = torch.Generator().manual_seed(1 + rank)
    inputs = torch.randn(batch_size * 16, FEATURES, generator=own)
    targets = torch.tanh(inputs @ weights) + 0.05 * torch.randn(batch_size * 16, 1, generator=own)
    return inputs.to(device), targets.to(device)


def main() -> None:
    args = parse_args()
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device, backend = pick_device(local_rank)
    dist.init_process_group(backend, timeout=timedelta(minutes=5))
    if rank == 0:
        print(f"training on {world_size} ranks, {device.type}, backend {backend}", flush=True)

    torch.manual_seed(0)  # the same initial weights everywhere; DDP also broadcasts rank 0's
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1)).to(device),
        device_ids=[device.index] if device.type == "cuda" else None,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate, momentum=0.9)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    inputs, targets = synthetic_batches(rank, args.batch_size, device)
    loss_fn = nn.MSELoss()

    # Only rank 0 writes: one curve per Job, as with any DDP script.
    writer = None
    if rank == 0:
        log_dir = args.log_dir or default_log_dir()
        writer = SummaryWriter(log_dir=str(log_dir), flush_secs=5)
        print(f"TensorBoard event files in {log_dir}", flush=True)

    mean_loss = torch.zeros(1, device=device)
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        first = (step - 1) * args.batch_size % len(inputs)
        batch = slice(first, first + args.batch_size)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs[batch]), targets[batch])
        loss.backward()  # DDP averages the gradients of every rank here
        learning_rate = schedule.get_last_lr()[0]
        optimizer.step()
        schedule.step()
        # The curve shows the loss of the whole global batch, not only rank 0's share.
        mean_loss.copy_(loss.detach())
        dist.all_reduce(mean_loss)
        mean_loss /= world_size
        elapsed = time.perf_counter() - started
        if writer is not None:
            writer.add_scalar("train/loss", mean_loss.item(), step)
            writer.add_scalar("train/learning_rate", learning_rate, step)
            writer.add_scalar("train/samples_per_s", args.batch_size * world_size / elapsed, step)
            if step % 10 == 0 or step == args.steps:
                print(f"step {step} loss {mean_loss.item():.4f} lr {learning_rate:.5f}", flush=True)

    if writer is not None:
        # The hparams plugin's record: `tp job show` lists these beside the run's final loss.
        writer.add_hparams(
            {
                "learning_rate": args.learning_rate,
                "steps": args.steps,
                "batch_size": args.batch_size,
                "world_size": world_size,
                "backend": backend,
            },
            {"hparam/final_loss": mean_loss.item()},
            run_name="hparams",
        )
        writer.close()
        out_dir = os.environ.get("TUNEPLANE_OUT_DIR")
        if out_dir:  # only $TUNEPLANE_OUT_DIR survives the Job (and can start another)
            torch.save(model.module.state_dict(), Path(out_dir) / "model.pt")
    # Tear down in order while Python is fully alive. No rank closes its connections while
    # another (rank 0, still writing) may use them; then DDP, which holds the process group, is
    # freed before the group is destroyed. A group left to interpreter shutdown can take the
    # process down with SIGABRT ("terminate called without an active exception") after a
    # successful run.
    dist.barrier()
    del model, optimizer, schedule
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
