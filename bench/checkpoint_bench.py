#!/usr/bin/env python3
"""lockstep.torch.Checkpointer against torch.save: states of 100 MB and 1 GB.

Starts a local cluster (deploy/local/cluster.sh, 2 workers with --programs_root), runs
bench/checkpoint_job.py as a one-process program job, and prints what it measured: save into
the worker's memory against torch.save (write, fsync, rename) to local disk and to /dev/shm,
the copy back into the model and optimizer against torch.load from disk (page cache dropped),
and a training step with and without a save after it (blocking and not). The restart itself
(kill -9 of a rank to the next step, with the state from memory against torchrun from its disk
checkpoint) is bench/program_bench.py's "Lockstep + memory checkpoints".

Prints a Markdown table and writes JSON (default bench/results/checkpoint_bench.json).
Usage: bench/checkpoint_bench.py [--build build-dev] [--sizes 100,1024] [--reps 3] [--out F]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from program_bench import PYTHON, ROOT, Lockstep, Workspace

JOB = os.path.join(ROOT, "bench/checkpoint_job.py")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build-dev"))
    p.add_argument("--sizes", default="100,1024", help="state sizes in MB")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=os.path.join(ROOT, "bench/results/checkpoint_bench.json"))
    a = p.parse_args()
    ws = Workspace()
    lockstep = None
    try:
        shutil.copy(JOB, os.path.join(ws.prog, "checkpoint_job.py"))
        os.chmod(os.path.join(ws.prog, "checkpoint_job.py"), 0o644)
        out_dir = ws.checkpoint_dir()
        shm_dir = "/dev/shm/" + os.path.basename(ws.dir)
        os.makedirs(shm_dir)
        os.chmod(shm_dir, 0o777)
        out = os.path.join(out_dir, "result.json")
        lockstep = Lockstep(a.build, ws)
        spec = {"name": "checkpoint-bench", "minWorkers": 1, "maxWorkers": 1, "maxRestarts": 0,
                "program": {"argv": [PYTHON, "checkpoint_job.py", out, a.sizes, out_dir, shm_dir,
                                     str(a.reps)],
                            "workdir": ws.prog}}
        path = os.path.join(ws.dir, "job.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        job_id = json.loads(lockstep.ctl("--output=json", "submit", path))["jobId"]
        subprocess.run([lockstep.ctl_path, f"--coordinator={lockstep.address}", "watch", job_id],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=a.timeout)
        job = json.loads(lockstep.ctl("--output=json", "status", job_id))
        if job["state"] != "JOB_STATE_SUCCEEDED" or not os.path.exists(out):
            print(lockstep.ctl("logs", job_id), file=sys.stderr)
            raise RuntimeError(f"{job_id} {job['state']}: {job.get('reason')}")
        with open(out) as f:
            rows = json.load(f)
    finally:
        if lockstep is not None:
            lockstep.stop()
        shutil.rmtree("/dev/shm/" + os.path.basename(ws.dir), ignore_errors=True)
        ws.remove()

    ms = lambda s: f"{s * 1000:,.0f} ms" if s >= 0.1 else f"{s * 1000:.1f} ms"
    print("\n| state (model + Adam) | Checkpointer.save (first: slots allocated) | "
          "torch.save, disk | torch.save, /dev/shm | copy back from memory | "
          "torch.load, disk | step | step + save | save(blocking=False) returns | "
          "step + save(blocking=False) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        gb_s = r["state_bytes"] / r["checkpointer_save_s"] / 1e9
        print(f"| {r['state_bytes'] / 2**20:,.0f} MiB | {ms(r['checkpointer_save_s'])} "
              f"({gb_s:.1f} GB/s; first {ms(r['checkpointer_first_save_s'])}) | "
              f"{ms(r['torch_save_disk_s'])} | {ms(r['torch_save_shm_s'])} | "
              f"{ms(r['checkpointer_restore_copy_s'])} | {ms(r['torch_load_disk_s'])} | "
              f"{ms(r['step_s'])} | {ms(r['step_and_save_s'])} | "
              f"{ms(r['checkpointer_save_nonblocking_s'])} | "
              f"{ms(r['step_and_save_nonblocking_s'])} |")
    result = {"host": os.uname().nodename, "cpus": os.cpu_count(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "settings": {k: v for k, v in vars(a).items() if k != "out"}, "rows": rows}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nJSON: {a.out}")


if __name__ == "__main__":
    main()
