#!/usr/bin/python3
"""PyTorch DDP baseline for the Lockstep reference workload.

Workload: MLP 784-512-512-10 (ReLU, nn.Linear default init), softmax
cross-entropy, SGD lr 0.05 momentum 0.9 (no weight decay), GLOBAL batch 256
(256 / WORLD_SIZE per rank), Fashion-MNIST read from the gz IDX files
(pixels / 255.0 as float32, no other normalisation), DistributedSampler
(shuffle=True, seed, drop_last=True) with set_epoch every epoch, one intra-op
thread per process, gloo backend on CPU.

Launch with torchrun (see run_torchrun.sh next to this file); it also runs
without torchrun as a single process (WORLD_SIZE 1, gloo on a local store).

Machine-readable lines, printed by rank 0 only, to stdout, flushed:
  START_UNIX_MS <ms>                 process start (before data/model setup)
  RESUMED_FROM_STEP <s>              only when a checkpoint was loaded
  FIRST_STEP_UNIX_MS <ms>            right after the first optimizer step of
                                     this process completes
  STEP <step> <unix_ms> <loss>       step = global step (1-based, continues
                                     across resumes); loss = mean training
                                     loss of that step over all ranks (one
                                     scalar all_reduce, only on logged steps).
                                     Logged on step 1 of this process, every
                                     --log_every steps, and on the last step.
  CHECKPOINT <step> <unix_ms>        after a checkpoint file is written
  RESULT {json}                      at the end
"""

import argparse
import gzip
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

GLOBAL_BATCH = 256
DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
CKPT_NAME = "latest.pt"


def now_ms():
    return int(time.time() * 1000)


def emit(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def read_idx_images(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    magic, n, rows, cols = np.frombuffer(raw, dtype=">u4", count=4, offset=0)
    if magic != 2051:
        raise ValueError(f"{path}: bad IDX image magic {magic}")
    pixels = np.frombuffer(raw, dtype=np.uint8, count=n * rows * cols, offset=16)
    return (pixels.reshape(n, rows * cols).astype(np.float32) / 255.0)


def read_idx_labels(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    magic, n = np.frombuffer(raw, dtype=">u4", count=2, offset=0)
    if magic != 2049:
        raise ValueError(f"{path}: bad IDX label magic {magic}")
    return np.frombuffer(raw, dtype=np.uint8, count=n, offset=8).astype(np.int64)


def load_split(data_dir, prefix):
    x = read_idx_images(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz"))
    y = read_idx_labels(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz"))
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"{prefix}: {x.shape[0]} images but {y.shape[0]} labels")
    return torch.from_numpy(x), torch.from_numpy(y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 512)
        self.fc2 = nn.Linear(512, 512)
        self.fc3 = nn.Linear(512, 10)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max_steps", type=int, default=0,
                   help="stop at this global step (0 = run all epochs)")
    p.add_argument("--data_dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--checkpoint_dir", default="",
                   help="directory for latest.pt (empty = no checkpointing/resume)")
    p.add_argument("--checkpoint_every", type=int, default=0,
                   help="save a checkpoint every N global steps (0 = never)")
    p.add_argument("--dataloader", action="store_true",
                   help="feed batches through torch DataLoader (per-sample indexing + "
                        "collate) instead of slicing the in-memory tensors with the "
                        "sampler's indices; same sample order either way")
    p.add_argument("--eval_batch", type=int, default=1000)
    return p.parse_args()


def save_checkpoint(ckpt_dir, model, optimizer, step, epoch, args, world_size):
    os.makedirs(ckpt_dir, exist_ok=True)
    final = os.path.join(ckpt_dir, CKPT_NAME)
    tmp = final + f".tmp.{os.getpid()}"
    torch.save({
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "epoch": epoch,
        "seed": args.seed,
        "world_size": world_size,
    }, tmp)
    os.replace(tmp, final)  # atomic: a reader sees the old or the new file


def evaluate(model, x, y, rank, world, batch):
    """Full test set, sharded rank::world, reduced with all_reduce."""
    model.eval()
    idx = torch.arange(rank, x.shape[0], world)
    xs, ys = x[idx], y[idx]
    loss_sum = 0.0
    correct = 0
    with torch.no_grad():
        for i in range(0, xs.shape[0], batch):
            logits = model(xs[i:i + batch])
            loss_sum += F.cross_entropy(logits, ys[i:i + batch], reduction="sum").item()
            correct += (logits.argmax(1) == ys[i:i + batch]).sum().item()
    t = torch.tensor([loss_sum, float(correct), float(xs.shape[0])], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    model.train()
    return t[1].item() / t[2].item(), t[0].item() / t[2].item(), int(t[2].item())


def main():
    start_ms = now_ms()
    args = parse_args()
    torch.set_num_threads(1)

    if "RANK" not in os.environ:  # plain single-process run without torchrun
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29577")
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    world = dist.get_world_size()
    is0 = rank == 0
    if is0:
        emit(f"START_UNIX_MS {start_ms}")
    if GLOBAL_BATCH % world != 0:
        raise SystemExit(f"global batch {GLOBAL_BATCH} not divisible by world size {world}")
    local_batch = GLOBAL_BATCH // world

    x_train, y_train = load_split(args.data_dir, "train")
    x_test, y_test = load_split(args.data_dir, "t10k")
    train_ds = TensorDataset(x_train, y_train)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank,
                                 shuffle=True, seed=args.seed, drop_last=True)
    steps_per_epoch = len(sampler) // local_batch  # DataLoader drop_last=True
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps > 0:
        total_steps = min(total_steps, args.max_steps)

    torch.manual_seed(args.seed)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    start_step = 0
    ckpt_path = os.path.join(args.checkpoint_dir, CKPT_NAME) if args.checkpoint_dir else ""
    if ckpt_path and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        start_step = int(ck["step"])
        if is0:
            emit(f"RESUMED_FROM_STEP {start_step}")

    ddp = DDP(model)  # broadcasts rank 0's parameters to all ranks
    ddp.train()

    step = start_step
    first_step_ms = None
    first_step_t = None
    last_step_t = None
    steps_this_run = 0
    log_every = max(1, args.log_every)

    start_epoch = start_step // steps_per_epoch
    skip = start_step % steps_per_epoch
    for epoch in range(start_epoch, args.epochs):
        if step >= total_steps:
            break
        sampler.set_epoch(epoch)
        if args.dataloader:
            loader = torch.utils.data.DataLoader(train_ds, batch_size=local_batch,
                                                 sampler=sampler, drop_last=True)
            batches = iter(loader)
        else:
            order = torch.tensor(list(iter(sampler)), dtype=torch.long)
            batches = ((x_train[b], y_train[b]) for b in
                       (order[i * local_batch:(i + 1) * local_batch]
                        for i in range(steps_per_epoch)))
        for i, (xb, yb) in enumerate(batches):
            if epoch == start_epoch and i < skip:
                continue  # resume inside an epoch: same order, skip done steps
            if step >= total_steps:
                break
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(xb), yb)
            loss.backward()
            optimizer.step()
            step += 1
            steps_this_run += 1
            t = time.time()
            last_step_t = t
            if first_step_ms is None:
                first_step_t = t
                first_step_ms = int(t * 1000)
                if is0:
                    emit(f"FIRST_STEP_UNIX_MS {first_step_ms}")
            if steps_this_run == 1 or step % log_every == 0 or step == total_steps:
                lt = loss.detach().clone()
                dist.all_reduce(lt, op=dist.ReduceOp.SUM)
                if is0:
                    emit(f"STEP {step} {int(t * 1000)} {lt.item() / world:.6f}")
            if (ckpt_path and args.checkpoint_every > 0
                    and step % args.checkpoint_every == 0 and is0):
                save_checkpoint(args.checkpoint_dir, model, optimizer, step,
                                epoch, args, world)
                emit(f"CHECKPOINT {step} {now_ms()}")

    acc, test_loss, n_test = evaluate(model, x_test, y_test, rank, world, args.eval_batch)
    if is0:
        train_seconds = (last_step_t - first_step_t) if steps_this_run > 1 else 0.0
        sps = ((steps_this_run - 1) * GLOBAL_BATCH / train_seconds) if train_seconds > 0 else 0.0
        result = {
            "world_size": world,
            "epochs": args.epochs,
            "steps": steps_this_run,
            "final_step": step,
            "start_step": start_step,
            "steps_per_epoch": steps_per_epoch,
            "global_batch": GLOBAL_BATCH,
            "train_seconds": round(train_seconds, 4),
            "samples_per_second": round(sps, 1),
            "test_accuracy": acc,
            "test_loss": test_loss,
            "test_examples": n_test,
            "start_to_first_step_seconds":
                round((first_step_ms - start_ms) / 1000.0, 3) if first_step_ms else None,
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "data_path": "dataloader" if args.dataloader else "index",
            "seed": args.seed,
            "torch_version": torch.__version__,
        }
        emit("RESULT " + json.dumps(result, sort_keys=True))
    # Leave without running destructors. With torch 1.13 + gloo, tearing down
    # DDP/ProcessGroupGloo at exit can deadlock: the main thread holds the GIL
    # while ~ProcessGroupGloo joins its worker thread, and that thread is
    # freeing a tensor with a Python object (e.g. an all_reduce input), which
    # needs the GIL. Seen here once in ~10 runs (rank 1 hung at 100% CPU after
    # rank 0 had printed RESULT; torchrun waited forever). The barrier makes
    # sure every rank is past its last collective before any rank leaves.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
