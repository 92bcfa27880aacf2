#!/usr/bin/env python3
"""Trains the reference workload with Lockstep and with PyTorch's torchrun side by side.

Reference workload (issue 2): MLP 784-512-512-10 (ReLU), softmax cross-entropy, SGD lr 0.05
momentum 0.9, global batch 256, Fashion-MNIST, 2 epochs, one thread per process, Gloo.

Measures, for each system:
  * training throughput (samples/s, excluding the first step and the evaluation) and test
    accuracy with 1 and 2 workers;
  * start-up latency: Lockstep's submit-to-first-step with 2, 4 and 8 long-lived workers
    (cold: the workers' first job; warm: the next one) next to torchrun's launch-to-first-step.

Prints a Markdown table and writes JSON (default bench/results/compare_torchrun.json).
Usage: bench/compare_torchrun.py [--epochs 2] [--workers 1,2] [--startup 2,4,8] [--repeats 1]
       [--skip-torch] [--build build] [--out FILE]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reference_spec(workers, epochs, max_steps=0, skip_eval=False, seed=1):
    spec = {
        "name": f"reference-{workers}w",
        "model": {"mlp": {"hiddenWidths": [512, 512], "activation": "relu"}},
        "dataset": {"type": "fashion_mnist", "path": "/usr/share/datasets/fashion-mnist"},
        "optimizer": {"type": "sgd", "learningRate": 0.05, "momentum": 0.9},
        "globalBatchSize": 256,
        "seed": seed,
        "minWorkers": workers,
        "maxWorkers": workers,
        "threadsPerWorker": 1,
    }
    if max_steps:
        spec["maxSteps"] = max_steps
    else:
        spec["epochs"] = epochs
    if skip_eval:
        spec["skipEvaluation"] = True
    return spec


class Cluster:
    def __init__(self, build, workers):
        self.build = build
        self.dir = tempfile.mkdtemp(prefix="lockstep-bench.")
        subprocess.run([os.path.join(ROOT, "deploy/local/cluster.sh"), "start", "--dir", self.dir,
                        "--workers", str(workers), "--bin", build], check=True,
                       stdout=subprocess.DEVNULL)
        with open(os.path.join(self.dir, "address")) as f:
            self.address = f.read().strip()

    def ctl(self, *args):
        out = subprocess.run([os.path.join(self.build, "cli/lockstepctl"),
                              f"--coordinator={self.address}", *args],
                             check=True, capture_output=True, text=True)
        return out.stdout

    def run_job(self, spec, timeout_s=900):
        path = os.path.join(self.dir, f"job-{time.time_ns()}.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        job = json.loads(self.ctl("submit", path, "--output=json"))
        job_id = job["jobId"]
        # One watch stream until the job ends: polling with a new lockstepctl process many
        # times a second would itself eat into the CPU the workers train on.
        subprocess.run([os.path.join(self.build, "cli/lockstepctl"),
                        f"--coordinator={self.address}", "watch", job_id],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout_s)
        job = json.loads(self.ctl("status", job_id, "--output=json"))
        if job["state"] != "JOB_STATE_SUCCEEDED":
            raise RuntimeError(f"{job_id} {job['state']}: {job.get('reason')}")
        return job

    def stop(self):
        subprocess.run([os.path.join(ROOT, "deploy/local/cluster.sh"), "stop", "--dir", self.dir],
                       check=False)


def lockstep_training(build, workers, epochs, **overrides):
    cluster = Cluster(build, workers)
    try:
        spec = reference_spec(workers, epochs)
        spec.update(overrides)
        job = cluster.run_job(spec)
    finally:
        cluster.stop()
    return {
        "samples_per_second": job["trainSamplesPerSecond"],
        "test_accuracy": job["eval"]["testAccuracy"],
        "test_loss": job["eval"]["testLoss"],
        "steps": int(job["step"]),
        "first_step_latency_ms": int(job["firstStepLatencyMs"]),
    }


def torchrun(nproc, *args):
    cmd = [os.path.join(ROOT, "bench/torch/run_torchrun.sh"), str(nproc), *args]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    values = {}
    for line in out.splitlines():
        parts = line.split(" ", 1)
        if parts[0] in ("LAUNCH_UNIX_MS", "FIRST_STEP_UNIX_MS"):
            values.setdefault(parts[0], int(parts[1]))
        elif parts[0] == "RESULT":
            values["RESULT"] = json.loads(parts[1])
    return values


def torch_training(nproc, epochs):
    r = torchrun(nproc, "--epochs", str(epochs))
    res = r["RESULT"]
    return {
        "samples_per_second": res["samples_per_second"],
        "test_accuracy": res["test_accuracy"],
        "test_loss": res["test_loss"],
        "steps": res["steps"],
        "launch_to_first_step_ms": r["FIRST_STEP_UNIX_MS"] - r["LAUNCH_UNIX_MS"],
    }


CACHE_DIR = "/dev/shm/lockstep-cache"  # lockstep-worker's default --data_cache_dir


def lockstep_startup(build, sizes, repeats):
    """Submit-to-first-step for each world size, three ways:
    cold: the first job ever on this host (no decoded data cache, fresh worker processes);
    new_workers: fresh worker processes, the host's decoded cache present;
    warm: the next jobs on the same long-lived workers (median of `repeats`)."""
    out = {}
    spec = lambda w: reference_spec(w, 1, max_steps=3, skip_eval=True)
    for w in sizes:
        subprocess.run(["rm", "-rf", CACHE_DIR], check=True)
        cluster = Cluster(build, w)
        try:
            cold = int(cluster.run_job(spec(w))["firstStepLatencyMs"])
            warm = [int(cluster.run_job(spec(w))["firstStepLatencyMs"]) for _ in range(repeats)]
        finally:
            cluster.stop()
        cluster = Cluster(build, w)
        try:
            fresh = int(cluster.run_job(spec(w))["firstStepLatencyMs"])
        finally:
            cluster.stop()
        out[w] = {"cold_ms": cold, "new_workers_ms": fresh, "warm_ms": statistics.median(warm)}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", default="1,2")
    p.add_argument("--startup", default="2,4,8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--deterministic", action="store_true",
                   help="also measure deterministic mode's throughput cost (2 workers; medians "
                        "of --repeats alternating pairs)")
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--out", default=os.path.join(ROOT, "bench/results/compare_torchrun.json"))
    a = p.parse_args()
    workers = [int(w) for w in a.workers.split(",") if w]
    sizes = [int(w) for w in a.startup.split(",") if w]

    result = {"workload": "MLP 784-512-512-10, SGD 0.05/0.9, batch 256, Fashion-MNIST",
              "epochs": a.epochs, "host": os.uname().nodename, "cpus": os.cpu_count(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "training": {}, "startup": {}}
    for w in workers:
        row = {"lockstep": lockstep_training(a.build, w, a.epochs)}
        if not a.skip_torch:
            row["torchrun"] = torch_training(w, a.epochs)
        result["training"][w] = row
        print(f"trained with {w} worker(s): {json.dumps(row)}", file=sys.stderr)
    if sizes:
        ls = lockstep_startup(a.build, sizes, a.repeats)
        for w in sizes:
            row = {"lockstep": ls[w]}
            if not a.skip_torch:
                runs = [torchrun(w, "--max_steps", "3") for _ in range(max(1, a.repeats // 3))]
                row["torchrun_ms"] = statistics.median(
                    r["FIRST_STEP_UNIX_MS"] - r["LAUNCH_UNIX_MS"] for r in runs)
            result["startup"][w] = row
            print(f"start-up with {w} workers: {json.dumps(row)}", file=sys.stderr)

    if a.deterministic:
        # Default and deterministic runs alternate, a.repeats pairs per setting, and the ratio
        # is of the medians: this VM's throughput drifts by 10-20% between runs.
        result["deterministic"] = []
        for shards in (None, 4, 8):
            extra = {} if shards is None else {"microShards": shards}
            base, det = [], []
            for _ in range(max(1, a.repeats)):
                base.append(lockstep_training(a.build, 2, a.epochs))
                det.append(lockstep_training(a.build, 2, a.epochs, deterministic=True, **extra))
            b = statistics.median(r["samples_per_second"] for r in base)
            d = statistics.median(r["samples_per_second"] for r in det)
            row = {"micro_shards": "default (2)" if shards is None else shards,
                   "samples_per_second": d, "default_samples_per_second": b, "ratio": d / b,
                   "runs": [r["samples_per_second"] for r in det],
                   "default_runs": [r["samples_per_second"] for r in base],
                   "test_accuracy": det[0]["test_accuracy"]}
            result["deterministic"].append(row)
            print(f"deterministic: {json.dumps(row)}", file=sys.stderr)

    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)

    print(f"\nReference workload, {a.epochs} epochs, {os.cpu_count()} CPUs\n")
    print("| workers | Lockstep samples/s | torchrun samples/s | ratio | Lockstep accuracy "
          "| torchrun accuracy |")
    print("|---|---|---|---|---|---|")
    for w, row in result["training"].items():
        ls, tr = row["lockstep"], row.get("torchrun")
        ratio = f"{ls['samples_per_second'] / tr['samples_per_second']:.2f}x" if tr else "-"
        print(f"| {w} | {ls['samples_per_second']:,.0f} | "
              f"{tr['samples_per_second']:,.0f} | {ratio} | {ls['test_accuracy']:.4f} | "
              f"{tr['test_accuracy']:.4f} |" if tr else
              f"| {w} | {ls['samples_per_second']:,.0f} | - | - | {ls['test_accuracy']:.4f} | - |")
    if result["startup"]:
        print("\n| workers | Lockstep submit-to-first-step: first job on the host | new workers, "
              "data cached | long-lived workers (median) | torchrun launch-to-first-step |")
        print("|---|---|---|---|---|")
        for w, row in result["startup"].items():
            tr = f"{row['torchrun_ms'] / 1000:.2f} s" if "torchrun_ms" in row else "-"
            ls = row["lockstep"]
            print(f"| {w} | {ls['cold_ms'] / 1000:.2f} s | {ls['new_workers_ms'] / 1000:.2f} s | "
                  f"{ls['warm_ms'] / 1000:.2f} s | {tr} |")
    if result.get("deterministic"):
        print("\n| deterministic mode, 2 workers | samples/s | default mode samples/s | ratio "
              "| accuracy |")
        print("|---|---|---|---|---|")
        for row in result["deterministic"]:
            print(f"| {row['micro_shards']} micro-shards | {row['samples_per_second']:,.0f} | "
                  f"{row['default_samples_per_second']:,.0f} | {row['ratio']:.2f} | "
                  f"{row['test_accuracy']:.4f} |")
    print(f"\nJSON: {a.out}")


if __name__ == "__main__":
    main()
