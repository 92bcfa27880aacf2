#!/usr/bin/env python3
"""A plain PyTorch DistributedDataParallel training script.

It is written the way a typical torchrun user writes one, and Lockstep runs it
unchanged as a "program job" (see job.json next to it). It also runs under

    torchrun --nproc_per_node=2 train.py --steps=200
    python -m torch.distributed.launch --nproc_per_node=2 train.py   # passes --local_rank=N

Task: synthetic token classification. Each sample is a sequence of token ids;
every token id belongs to one of NUM_CLASSES classes (id % NUM_CLASSES) and the
label is the class that occurs most often in the sequence.

The model has an auxiliary embedding that the forward pass never uses, so DDP
needs find_unused_parameters=True (without it the second step fails).

Deterministic: the same world size and seed give bit-identical losses, and a
run resumed from a checkpoint at step S ends exactly like an uninterrupted one
(the data order is derived from the step: epoch = step // batches_per_epoch,
and the batches of the current epoch that were already done are skipped).

At the end rank 0 prints `final_loss=<float>` (the last step's loss averaged
over ranks) and `final_step=<n>`, each on its own line.

With --timing (for bench/program_bench.py) rank 0 also prints machine-readable
lines `timing <name> <unix_time_s> [key=value ...]` to stdout: proc_start (the
process's start from /proc, 10 ms resolution), script_start (preloaded=1 when
torch was imported before the script ran: a warm start), import_torch,
import_lockstep, init_process_group, checkpoint_load, first_step, and `step`
(with step=N and save_s=S, the seconds spent in memory saves so far) at every --log-every
step. Nothing else changes with it.
"""

import sys
import time

_T_SCRIPT_START = time.time()  # before the imports: --timing reports it
_PRELOADED = "torch" in sys.modules  # started in a Lockstep worker's warm interpreter

import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

_T_IMPORT_TORCH = time.time()

try:
    import lockstep.torch as lt
except ImportError:
    lt = None

_T_IMPORT_LOCKSTEP = time.time()

NUM_SAMPLES = 4096
SEQ_LEN = 16
VOCAB = 64
NUM_CLASSES = 4
EMBED_DIM = 32
HIDDEN = 64
CHECKPOINT_NAME = "checkpoint.pt"


def log(*args):
    print(*args, flush=True)


def _proc_start_time():
    """This process's start (fork) as a unix time, from /proc (clock-tick resolution)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        # starttime counts clock ticks since boot (CLOCK_BOOTTIME); /proc/stat's btime is
        # whole seconds, too coarse, so convert through the clocks' current offset.
        since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since_start
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class Timing:
    """`timing <name> <unix_time> [key=value ...]` lines on rank 0 with --timing."""

    def __init__(self, enabled):
        self.enabled = enabled

    def mark(self, name, t=None, **fields):
        if not self.enabled:
            return
        t = time.time() if t is None else t
        extra = "".join(" %s=%s" % kv for kv in fields.items())
        print("timing %s %.6f%s" % (name, t, extra), flush=True)


def parse_args():
    p = argparse.ArgumentParser(description="PyTorch DDP example for Lockstep")
    p.add_argument("--local_rank", "--local-rank", type=int,
                   default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="local rank (torch.distributed.launch passes it; "
                        "default: $LOCAL_RANK)")
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps")
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--checkpoint-dir", default="",
                   help="directory for checkpoint.pt (empty: no checkpoints)")
    p.add_argument("--checkpoint-every", type=int, default=20,
                   help="save every N steps (0: only at the end)")
    p.add_argument("--memory-checkpoint-every", type=int, default=0,
                   help="under Lockstep, save to the worker's memory every N steps "
                        "(lockstep.torch.Checkpointer; 0: never); a restart resumes from the "
                        "newer of it and --checkpoint-dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo")
    p.add_argument("--sleep-ms", type=float, default=0.0,
                   help="artificial sleep per step (for tests that kill a run)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--timing", action="store_true",
                   help="rank 0 prints `timing <name> <unix_time>` lines (start-up phases, "
                        "first step, every --log-every step)")
    return p.parse_args()


def make_dataset(seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (NUM_SAMPLES, SEQ_LEN), generator=g)
    counts = F.one_hot(tokens % NUM_CLASSES, NUM_CLASSES).sum(dim=1)
    labels = counts.argmax(dim=1)
    return TensorDataset(tokens, labels)


class TokenClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED_DIM)
        # Auxiliary embedding (e.g. for an optional segment input) that this
        # task never feeds: it gets no gradient, hence find_unused_parameters.
        self.aux_embed = nn.Embedding(8, EMBED_DIM)
        self.fc1 = nn.Linear(EMBED_DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, NUM_CLASSES)

    def forward(self, tokens, segments=None):
        h = self.embed(tokens)
        if segments is not None:
            h = h + self.aux_embed(segments)
        h = h.mean(dim=1)
        return self.fc2(F.relu(self.fc1(h)))


def save_checkpoint(path, model, optimizer, step, loss):
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "loss": loss,
    }
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main():
    args = parse_args()
    # Rank 0 by the launcher's RANK (set before the process starts; a plain run is rank 0).
    timing = Timing(args.timing and os.environ.get("RANK", "0") == "0")
    if timing.enabled:
        proc_start = _proc_start_time()
        if proc_start is not None:
            timing.mark("proc_start", proc_start, pid=os.getpid(),
                        restart=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        timing.mark("script_start", _T_SCRIPT_START, pid=os.getpid(),
                    preloaded=int(_PRELOADED))
        timing.mark("import_torch", _T_IMPORT_TORCH)
        timing.mark("import_lockstep", _T_IMPORT_LOCKSTEP, loaded=int(lt is not None))

    # Plain `python train.py` (no launcher): run as a group of one.
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ["RANK"] = "0"
        os.environ["WORLD_SIZE"] = "1"

    use_cuda = args.backend == "nccl" and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(args.local_rank)
        device = torch.device("cuda", args.local_rank)
    else:
        device = torch.device("cpu")

    if lt is not None:
        # Under Lockstep the group forms over the coordinator's store (no rank-0 port whose
        # listener the others poll for); elsewhere this is dist.init_process_group itself.
        lt.init_process_group(args.backend)
    else:
        dist.init_process_group(args.backend)
    rank = dist.get_rank()
    world = dist.get_world_size()
    timing.mark("init_process_group", world=world)

    dataset = make_dataset(args.seed)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        shuffle=False, drop_last=True, num_workers=0)
    batches_per_epoch = len(loader)
    if batches_per_epoch == 0:
        raise SystemExit("batch size %d is larger than a rank's share of the data (%d)"
                         % (args.batch_size, len(sampler)))

    torch.manual_seed(args.seed)
    model = TokenClassifier().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    start_step = 0
    last_loss = None
    ckpt_path = None
    if args.checkpoint_dir:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        ckpt_path = os.path.join(args.checkpoint_dir, CHECKPOINT_NAME)
        if os.path.exists(ckpt_path):
            state = torch.load(ckpt_path, map_location=device)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start_step = int(state["step"])
            last_loss = state.get("loss")
            if rank == 0:
                log("resumed from %s at step %d" % (ckpt_path, start_step))
    # The worker's memory (lockstep.torch.Checkpointer) when it holds a newer step: every
    # member is told the same step (the newest all of them hold).
    memory = None
    if args.memory_checkpoint_every > 0 and lt is not None and lt.available():
        memory = lt.Checkpointer()
        held = memory.load(None)  # which step, without restoring yet
        if held is not None and held > start_step:
            start_step = memory.load(model, optimizer)
            last_loss = (memory.extra or {}).get("loss")
            if rank == 0:
                log("resumed from the worker's memory at step %d" % start_step)
    timing.mark("checkpoint_load", start_step=start_step)

    # Every rank must resume from the same step (e.g. a node-local checkpoint
    # directory that is missing on some node would break this).
    steps_t = torch.tensor([start_step, -start_step], dtype=torch.int64, device=device)
    dist.all_reduce(steps_t, op=dist.ReduceOp.MAX)
    if steps_t[0].item() != start_step or -steps_t[1].item() != start_step:
        raise SystemExit("rank %d: ranks disagree on the resume step (max %d, min %d)"
                         % (rank, steps_t[0].item(), -steps_t[1].item()))

    ddp_model = DDP(model, device_ids=[args.local_rank] if use_cuda else None,
                    find_unused_parameters=True)

    global_batch = args.batch_size * world
    if rank == 0:
        log("world_size=%d backend=%s device=%s batch=%d global_batch=%d "
            "batches_per_epoch=%d steps=%d start_step=%d"
            % (world, args.backend, device, args.batch_size, global_batch,
               batches_per_epoch, args.steps, start_step))

    def reduced(loss):
        t = loss.detach().clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return (t / world).item()

    loss = None
    step = start_step
    epoch, skip = divmod(step, batches_per_epoch)
    t_start = time.perf_counter()
    t_log, step_log = t_start, step
    save_s = 0.0  # time spent in memory.save, for --timing
    while step < args.steps:
        sampler.set_epoch(epoch)
        for i, (tokens, labels) in enumerate(loader):
            if i < skip:
                continue  # already trained on before the checkpoint
            tokens = tokens.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)

            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp_model(tokens), labels)
            loss.backward()
            optimizer.step()
            step += 1

            loss_value = loss.item()
            if step == start_step + 1:
                timing.mark("first_step", step=step)
            if memory is not None and step % args.memory_checkpoint_every == 0:
                # Before the report: a step the coordinator saw is a step the memory holds.
                t_save = time.perf_counter()
                memory.save(step, model, optimizer, extra={"loss": last_loss})
                save_s += time.perf_counter() - t_save
            if step % args.log_every == 0:
                timing.mark("step", step=step, save_s="%.6f" % save_s)
            if lt is not None:
                lt.report(step=step, loss=loss_value, samples=global_batch)
            if args.sleep_ms > 0:
                time.sleep(args.sleep_ms / 1000.0)

            is_last = step >= args.steps
            periodic = args.checkpoint_every > 0 and step % args.checkpoint_every == 0
            if is_last or (ckpt_path and periodic):
                last_loss = reduced(loss)  # collective: every rank takes this branch
                if ckpt_path and rank == 0:
                    save_checkpoint(ckpt_path, model, optimizer, step, last_loss)

            if rank == 0 and (step % args.log_every == 0 or is_last):
                now = time.perf_counter()
                log("step=%d epoch=%d loss=%.6f step_ms=%.2f"
                    % (step, epoch, loss_value, (now - t_log) * 1000.0 / (step - step_log)))
                t_log, step_log = now, step
            if is_last:
                break
        skip = 0
        epoch += 1

    if rank == 0:
        done = step - start_step
        if done:
            log("trained %d steps in %.3f s (%.2f ms/step)"
                % (done, time.perf_counter() - t_start,
                   (time.perf_counter() - t_start) * 1000.0 / done))
        if last_loss is None:
            raise SystemExit("no step was run and the checkpoint holds no loss")
        log("final_loss=%r" % float(last_loss))
        log("final_step=%d" % step)

    # Teardown order matters with PyTorch 1.13 and Gloo: DDP's Reducer holds a
    # reference to the process group, and the last loss's autograd graph holds
    # the DDP module. Were they freed only after destroy_process_group() (when
    # main() returns), the group's destructor would run from there with the GIL
    # held and join Gloo worker threads, one of which may be waiting for the GIL
    # to free a finished collective's tensor: a hang at exit (seen in about 1 run
    # in 4 under torchrun). Freed first, destroy_process_group() drops the last
    # reference itself, through a binding that releases the GIL.
    del ddp_model, loss
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
