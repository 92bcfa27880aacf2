#!/usr/bin/env python3
"""Recovery time after `kill -9` of one worker, Lockstep next to torchrun elastic.

Workload: the reference MLP (784-512-512-10, SGD 0.05/0.9, batch 256, Fashion-MNIST). For each
trial a worker is killed once training has passed --kill_at_step; recovery time is from the
kill to the next completed optimizer step, and steps redone are committed steps trained again.

Lockstep: N long-lived workers (min 1, max N); the survivors re-form and heal in memory.
torchrun: `--standalone --nproc_per_node=N`, checkpoints every --checkpoint_every steps (the
usual way to survive a failure), with --max_restarts and --monitor_interval as given; torchrun
restarts the whole group and resumes from the last checkpoint.

Prints a Markdown table and writes JSON (default bench/results/recovery.json).
Usage: bench/recovery_bench.py [--trials 5] [--workers 2,3] [--skip-torch]
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from compare_torchrun import Cluster, reference_spec  # noqa: E402


def lockstep_trial(build, workers, kill_at_step, steps):
    cluster = Cluster(build, workers)
    try:
        spec = reference_spec(1, 1, max_steps=steps, skip_eval=True)
        spec["minWorkers"], spec["maxWorkers"] = 1, workers
        path = os.path.join(cluster.dir, "job.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        job_id = json.loads(cluster.ctl("submit", path, "--output=json"))["jobId"]
        while True:
            job = json.loads(cluster.ctl("status", job_id, "--output=json"))
            if int(job["step"]) >= kill_at_step:
                break
            time.sleep(0.02)
        victim = job["members"][-1]["workerName"]
        with open(os.path.join(cluster.dir, f"{victim}.pid")) as f:
            pid = int(f.read())
        kill_ms = time.time() * 1000
        os.kill(pid, signal.SIGKILL)
        subprocess.run([os.path.join(build, "cli/lockstepctl"), f"--coordinator={cluster.address}",
                        "watch", job_id], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=300)
        job = json.loads(cluster.ctl("status", job_id, "--output=json"))
    finally:
        cluster.stop()
    if job["state"] != "JOB_STATE_SUCCEEDED" or int(job["step"]) != steps:
        raise RuntimeError(f"job ended {job['state']} at step {job['step']}: {job.get('reason')}")
    r = [x for x in job["recoveryHistory"] if int(x.get("firstStepUnixMs", 0)) > 0][-1]
    return {
        "recovery_ms": int(r["firstStepUnixMs"]) - kill_ms,
        "detect_ms": int(r["detectUnixMs"]) - kill_ms,
        "heal_ms": int(r.get("healMs", 0)),
        "steps_redone": int(r.get("stepsRedone", 0)),
        "workers_after": len(job["members"]),
    }


def torch_trial_timed(workers, kill_at_step, steps, monitor_interval, checkpoint_every):
    """Like torch_trial, with the time of the first step after the restart."""
    ckpt = tempfile.mkdtemp(prefix="torch-ckpt.")
    extra = "--max_restarts=3"
    if monitor_interval is not None:
        extra += f" --monitor_interval={monitor_interval}"
    env = dict(os.environ, TORCHRUN_EXTRA=extra)
    cmd = [os.path.join(ROOT, "bench/torch/run_torchrun.sh"), str(workers), "--max_steps",
           str(steps), "--log_every", "1", "--checkpoint_dir", ckpt, "--checkpoint_every",
           str(checkpoint_every)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env, start_new_session=True)
    kill_ms = step_at_kill = resumed = None
    result = None
    deadline = time.time() + 180
    for line in proc.stdout:
        if time.time() > deadline:
            break
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "STEP":
            step, ms = int(parts[1]), int(parts[2])
            if kill_ms is None and step >= kill_at_step:
                out = subprocess.run(["pgrep", "-f", "train_mlp.py"], capture_output=True,
                                     text=True).stdout.split()
                pids = sorted(int(p) for p in out)
                kill_ms, step_at_kill = time.time() * 1000, step
                os.kill(pids[-1], signal.SIGKILL)
            elif kill_ms is not None and resumed is not None and ms > kill_ms:
                result = {"recovery_ms": ms - kill_ms,
                          "steps_redone": max(0, step_at_kill - resumed)}
                break
        elif parts[0] == "RESUMED_FROM_STEP":
            resumed = int(parts[1])
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    if result is None:
        raise RuntimeError(f"torchrun did not resume (killed at step {step_at_kill})")
    return result


def summarize(values):
    values = sorted(values)
    return {"median": statistics.median(values), "min": values[0], "max": values[-1]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--workers", default="2,3")
    p.add_argument("--kill_at_step", type=int, default=120)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--checkpoint_every", type=int, default=50)
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--out", default=os.path.join(ROOT, "bench/results/recovery.json"))
    a = p.parse_args()
    result = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": []}
    for w in [int(x) for x in a.workers.split(",")]:
        trials = [lockstep_trial(a.build, w, a.kill_at_step, a.steps) for _ in range(a.trials)]
        row = {"system": "Lockstep", "workers": f"{w} -> {w - 1}",
               "recovery_ms": summarize([t["recovery_ms"] for t in trials]),
               "detect_ms": summarize([t["detect_ms"] for t in trials]),
               "steps_redone": [t["steps_redone"] for t in trials], "trials": trials}
        result["rows"].append(row)
        print(json.dumps(row), file=sys.stderr)
        if a.skip_torch:
            continue
        if 256 % w != 0:
            # train_mlp.py gives each rank 256 / W samples (DistributedSampler's split), so
            # torchrun cannot run the reference batch on W ranks; Lockstep splits micro-shards.
            print(f"torchrun skipped for {w} workers: 256 is not divisible by {w}",
                  file=sys.stderr)
            continue
        for interval in (0.1, None):
            trials = [torch_trial_timed(w, a.kill_at_step, a.steps, interval, a.checkpoint_every)
                      for _ in range(a.trials)]
            row = {"system": f"torchrun (monitor_interval={interval or 'default'}, "
                             f"checkpoint every {a.checkpoint_every})",
                   "workers": f"{w} -> restart {w}",
                   "recovery_ms": summarize([t["recovery_ms"] for t in trials]),
                   "steps_redone": [t["steps_redone"] for t in trials], "trials": trials}
            result["rows"].append(row)
            print(json.dumps(row), file=sys.stderr)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nkill -9 of one worker at step >= {a.kill_at_step}, {a.trials} trials each\n")
    print("| system | workers | recovery median | min-max | steps redone |")
    print("|---|---|---|---|---|")
    for row in result["rows"]:
        r = row["recovery_ms"]
        print(f"| {row['system']} | {row['workers']} | {r['median'] / 1000:.3f} s | "
              f"{r['min'] / 1000:.3f}-{r['max'] / 1000:.3f} s | "
              f"{', '.join(str(x) for x in row['steps_redone'])} |")
    print(f"\nJSON: {a.out}")


if __name__ == "__main__":
    main()
