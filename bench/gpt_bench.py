#!/usr/bin/env python3
"""The GPT reference job with Lockstep and with PyTorch DDP under torchrun, in one run.

Reference job (docs/examples/gpt_fortunes.json): byte-level GPT on Debian's fortunes, context
128, 4 layers, 4 heads, d_model 128, global batch 64 sequences, 300 steps, AdamW (decay on
matrices, clipping at 1.0, warm-up and cosine), one thread per process, Gloo. The PyTorch twin
(bench/torch/train_gpt.py) reads the same text, takes the same batches in the same order and
uses the same optimizer.

Measures tokens/s (from the end of the first step to the end of the last, evaluations left
out) with 1 and 2 workers for both, the ratio, the validation loss at the end for both,
Lockstep's deterministic mode against its default mode (2 workers), and the fraction of this
machine's single-core SGEMM rate that one worker's step reaches (bench/gpt_step_bench).
Prints a Markdown table and writes JSON (default bench/results/gpt_bench.json).
With --rounds N the two systems alternate N times per worker count (Lockstep, PyTorch,
PyTorch, Lockstep, ...), so that a drift in the machine's speed falls on both alike; the table
shows the medians and each round's ratio is kept in the JSON.
Usage: bench/gpt_bench.py [--steps 300] [--workers 1,2] [--rounds 1] [--skip-torch]
                          [--build build] [--out F]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from compare_torchrun import Cluster  # noqa: E402


def reference_spec(workers, steps, deterministic=False):
    with open(os.path.join(ROOT, "docs/examples/gpt_fortunes.json")) as f:
        spec = json.load(f)
    spec.update(name=f"gpt-reference-{workers}w", maxSteps=steps, minWorkers=workers,
                maxWorkers=workers, threadsPerWorker=1, deterministic=deterministic)
    spec.pop("evalEverySteps", None)
    spec.pop("sample", None)
    return spec


def lockstep(build, workers, steps, deterministic=False):
    cluster = Cluster(build, workers)
    try:
        job = cluster.run_job(reference_spec(workers, steps, deterministic), timeout_s=3600)
    finally:
        cluster.stop()
    return {"tokens_per_second": job["trainTokensPerSecond"],
            "validation_loss": job["eval"]["testLoss"],
            "bits_per_byte": job["eval"]["bitsPerByte"],
            "steps": int(job["step"])}


def torch(workers, steps):
    spec = os.path.join(tempfile.mkdtemp(prefix="gpt-bench."), "spec.json")
    with open(spec, "w") as f:
        json.dump(reference_spec(workers, steps), f)
    env = dict(os.environ, TORCH_SCRIPT="train_gpt.py")
    out = subprocess.run([os.path.join(ROOT, "bench/torch/run_torchrun.sh"), str(workers),
                          "--spec", spec, "--steps", str(steps)],
                         check=True, capture_output=True, text=True, env=env).stdout
    for line in out.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            return {"tokens_per_second": r["tokens_per_second"],
                    "validation_loss": r["validation_loss"], "steps": r["steps"]}
    raise RuntimeError("train_gpt.py printed no RESULT:\n" + out)


def step_bench(build):
    path = os.path.join(ROOT, "bench/results/gpt_step_bench.json")
    subprocess.run([os.path.join(build, "bench/gpt_step_bench"), "--steps", "5", "--json", path],
                   check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        return json.load(f)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--workers", default="1,2")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--out", default=os.path.join(ROOT, "bench/results/gpt_bench.json"))
    args = p.parse_args()
    subprocess.run(["cmake", "--build", args.build, "--target", "lockstep-coordinator",
                    "lockstep-worker", "lockstepctl", "gpt_step_bench"], check=True,
                   stdout=subprocess.DEVNULL)
    results = {"steps": args.steps, "rounds": args.rounds, "lockstep": {}, "torch": {},
               "per_round": {}}
    results["step_bench"] = step_bench(args.build)

    def median_run(runs):
        # The run with the median throughput (its loss comes with it).
        ordered = sorted(runs, key=lambda r: r["tokens_per_second"])
        return dict(ordered[(len(ordered) - 1) // 2], runs=len(runs))

    for w in [int(x) for x in args.workers.split(",")]:
        ls_runs, torch_runs = [], []
        for r in range(args.rounds):
            order = ["lockstep", "torch"] if r % 2 == 0 else ["torch", "lockstep"]
            for system in order:
                if system == "lockstep":
                    ls_runs.append(lockstep(args.build, w, args.steps))
                    print(f"lockstep {w}w round {r + 1}: {ls_runs[-1]}", file=sys.stderr, flush=True)
                elif not args.skip_torch:
                    torch_runs.append(torch(w, args.steps))
                    print(f"torch {w}w round {r + 1}: {torch_runs[-1]}", file=sys.stderr, flush=True)
        results["lockstep"][str(w)] = median_run(ls_runs)
        if torch_runs:
            results["torch"][str(w)] = median_run(torch_runs)
            results["per_round"][str(w)] = [
                {"lockstep": a["tokens_per_second"], "torch": b["tokens_per_second"],
                 "ratio": a["tokens_per_second"] / b["tokens_per_second"]}
                for a, b in zip(ls_runs, torch_runs)]
    results["lockstep_deterministic_2"] = lockstep(args.build, 2, args.steps, deterministic=True)

    rows = ["| workers | Lockstep tokens/s | PyTorch tokens/s | ratio | Lockstep val loss "
            "| PyTorch val loss | val loss difference |",
            "|---|---|---|---|---|---|---|"]
    for w, ls in results["lockstep"].items():
        t = results["torch"].get(w)
        if t:
            rows.append(f"| {w} | {ls['tokens_per_second']:,.0f} | {t['tokens_per_second']:,.0f} "
                        f"| {ls['tokens_per_second'] / t['tokens_per_second']:.2f}x "
                        f"| {ls['validation_loss']:.4f} | {t['validation_loss']:.4f} "
                        f"| {100 * (ls['validation_loss'] / t['validation_loss'] - 1):+.2f}% |")
        else:
            rows.append(f"| {w} | {ls['tokens_per_second']:,.0f} | - | - "
                        f"| {ls['validation_loss']:.4f} | - | - |")
    det = results["lockstep_deterministic_2"]
    default2 = results["lockstep"].get("2")
    sb = results["step_bench"]
    print("\n".join(rows))
    for w, rounds in results["per_round"].items():
        if len(rounds) > 1:
            ratios = [r["ratio"] for r in rounds]
            print(f"{w} workers, ratio per round: " + ", ".join(f"{x:.2f}x" for x in ratios) +
                  f" (median {statistics.median(ratios):.2f}x)")
    if default2:
        print(f"\ndeterministic mode, 2 workers: {det['tokens_per_second']:,.0f} tokens/s "
              f"({det['tokens_per_second'] / default2['tokens_per_second']:.2f}x the default mode), "
              f"validation loss {det['validation_loss']:.4f}")
    print(f"one worker's step: {sb['step_gflops']:.1f} GFLOP/s of matrix products, "
          f"{100 * sb['fraction_of_sgemm']:.0f}% of this machine's single-core SGEMM rate "
          f"({sb['sgemm_gflops']:.1f} GFLOP/s)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
