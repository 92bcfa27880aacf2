"""The program bench/checkpoint_bench.py runs as a Lockstep job (one process on one worker).

For each state size: a model of bias-free 2048x2048 linear layers trained with Adam, so that
its parameters and Adam's two moments together are the size asked for. Measures (seconds,
medians of --reps): lockstep.torch.Checkpointer.save (the first one apart: it allocates the
worker's slots), torch.save to a file on local disk and on /dev/shm the way a torchrun script
writes its checkpoint (examples/torch/train.py's save_checkpoint: write, fsync, rename), the
copy back out of the worker's memory into the model and optimizer, torch.load from disk,
and a training step with and without a save after it (blocking, and blocking=False). Writes
a JSON list to argv[1].
Usage: checkpoint_job.py OUT.json SIZES_MB DISK_DIR SHM_DIR REPS
"""
import json
import mmap
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

import lockstep.torch as lt
from train import save_checkpoint  # examples/torch/train.py, beside this file

WIDTH = 2048


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    out, sizes, disk_dir, shm_dir, reps = (sys.argv[1], [int(s) for s in sys.argv[2].split(",")],
                                           sys.argv[3], sys.argv[4], int(sys.argv[5]))
    torch.set_num_threads(1)
    results = []
    ckpt = lt.Checkpointer()
    ckpt.load(None)
    step_no = 0
    for mb in sizes:
        layers = max(1, round(mb * (1 << 20) / 4 / 3 / (WIDTH * WIDTH)))
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        x = torch.randn(4, WIDTH)

        def step():
            opt.zero_grad(set_to_none=True)
            model(x).sum().backward()
            opt.step()

        step()  # Adam's state exists from here
        state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        state_bytes += sum(v.numel() * v.element_size() for s in opt.state.values()
                           for v in s.values() if torch.is_tensor(v))

        def save():
            nonlocal step_no
            step_no += 1
            ckpt.save(step_no, model, opt)

        first = timed(save)
        saves = [timed(save) for _ in range(reps)]
        disk = os.path.join(disk_dir, f"state-{mb}.pt")
        shm = os.path.join(shm_dir, f"state-{mb}.pt")
        disk_saves = [timed(lambda: save_checkpoint(disk, model, opt, step_no, 0.0))
                      for _ in range(reps)]
        shm_saves = [timed(lambda: save_checkpoint(shm, model, opt, step_no, 0.0))
                     for _ in range(reps)]
        # The copy back: what load() does once the worker named the slot.
        newest = max(ckpt._slots, key=lambda s: s.sequence())
        with open(newest.path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        restores = [timed(lambda: ckpt._fill(m, step_no, model, opt)) for _ in range(reps)]
        m.close()
        disk_loads = []
        for _ in range(reps):
            fd = os.open(disk, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # from the disk, not the cache
            os.close(fd)
            disk_loads.append(timed(lambda: torch.load(disk)))
        plain_steps = [timed(step) for _ in range(reps)]

        def step_and_save():
            step()
            save()

        saved_steps = [timed(step_and_save) for _ in range(reps)]

        # save(blocking=False): the time it returns in (the checksum and the commit go on in a
        # thread), and a step with one after it (the previous one's commit waited for first).
        def save_async():
            nonlocal step_no
            step_no += 1
            return ckpt.save(step_no, model, opt, blocking=False)

        async_saves = []
        for _ in range(reps):
            async_saves.append(timed(save_async))
            ckpt.wait()

        def step_and_save_async():
            step()
            save_async()

        async_steps = [timed(step_and_save_async) for _ in range(reps)]
        ckpt.wait()
        os.remove(disk)
        os.remove(shm)
        results.append({
            "size_mb": mb, "state_bytes": state_bytes, "layers": layers,
            "checkpointer_first_save_s": first,
            "checkpointer_save_s": statistics.median(saves),
            "torch_save_disk_s": statistics.median(disk_saves),
            "torch_save_shm_s": statistics.median(shm_saves),
            "checkpointer_restore_copy_s": statistics.median(restores),
            "torch_load_disk_s": statistics.median(disk_loads),
            "step_s": statistics.median(plain_steps),
            "step_and_save_s": statistics.median(saved_steps),
            "checkpointer_save_nonblocking_s": statistics.median(async_saves),
            "step_and_save_nonblocking_s": statistics.median(async_steps),
            "reps": reps,
        })
        print(json.dumps(results[-1]), flush=True)
        del model, opt
    with open(out + ".tmp", "w") as f:
        json.dump(results, f, indent=2)
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main()
