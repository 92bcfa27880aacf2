#!/usr/bin/env python3
"""Preemption: an urgent job takes workers from a running lower-priority job, by shrinking it
or, when that is not enough, by suspending it.

Two workers (deploy/local/cluster.sh) train the reference MLP (Fashion-MNIST, batch 256) as a
low-priority job (min 1, max 2). Once it has trained --warm_steps steps on both, a job of
priority 10 needing one worker is submitted (the same workload, --urgent_steps steps). The
low job shrinks to one worker at a step boundary, the urgent job starts on the other, and when
it ends the low job grows back. Per trial:

- submit to the urgent job's first step (the coordinator's firstStepLatencyMs: from the submit's
  arrival to the first progress report);
- the low job's pause at the shrink and at the growth (its recovery records: detection to the
  re-formed generation's first step) and the steps it redid (stepsRedone; the target is 0).

The same with torchrun (bench/torch/run_torchrun.sh, the same MLP, checkpoints every
--checkpoint_every steps), where freeing a worker means stopping the low job: the operator kills
it, launches the urgent job on one process and relaunches the low job on the other from its
checkpoint; once the urgent job has ended, kills the low job again and relaunches it on two.
Measured from the kill: the urgent job's first step, the low job's first step after each
relaunch, and the steps it redid (from its last checkpoint).

The suspend scenario (--scenario suspend or both): the low job needs both workers (min 2), and
so does the urgent job: the low job is suspended whole, its state kept in its workers' memory,
and resumes from it once the urgent job has ended. Per trial: submit to the urgent job's first
step; the low job's resume (from the urgent job's end to the low job's first step after it) and
its steps redone. torchrun: kill the low job, run the urgent one on both processes, relaunch the
low job on both from its checkpoint; measured from the kill and from the urgent job's end.

Prints Markdown tables and writes JSON (default bench/results/preemption.json).
Usage: bench/preemption_bench.py [--build build] [--trials 5] [--scenario shrink|suspend|both]
       [--skip-torch]
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


def status(cluster, job_id):
    return json.loads(cluster.ctl("status", job_id, "--output=json"))


def submit(cluster, spec):
    path = os.path.join(cluster.dir, f"job-{time.time_ns()}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    return json.loads(cluster.ctl("submit", path, "--output=json"))["jobId"]


def wait(cluster, job_id, pred, timeout_s=300, poll_s=0.05):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        job = status(cluster, job_id)
        if pred(job):
            return job
        time.sleep(poll_s)
    raise RuntimeError(f"{job_id}: timed out; last state {job['state']}: {job.get('reason')}")


def pause_s(recovery):
    first = int(recovery.get("firstStepUnixMs", 0))
    return (first - int(recovery["detectUnixMs"])) / 1000 if first else None


def trial(cluster, a):
    low = reference_spec(1, 1, max_steps=1_000_000, skip_eval=True)
    low.update(name="low", minWorkers=1, maxWorkers=2, priority=0)
    low_id = submit(cluster, low)
    try:
        wait(cluster, low_id, lambda j: len(j.get("members", [])) == 2 and
             int(j.get("step", 0)) >= a.warm_steps)
        urgent = reference_spec(1, 1, max_steps=a.urgent_steps, skip_eval=True)
        urgent.update(name="urgent", priority=10)
        urgent_id = submit(cluster, urgent)
        done = wait(cluster, urgent_id, lambda j: j["state"] not in
                    ("JOB_STATE_PENDING", "JOB_STATE_RUNNING", "JOB_STATE_RECONFIGURING"))
        if done["state"] != "JOB_STATE_SUCCEEDED":
            raise RuntimeError(f"urgent {urgent_id} {done['state']}: {done.get('reason')}")
        # The growth back, then its first step.
        job = wait(cluster, low_id, lambda j: len(j.get("members", [])) == 2 and any(
            r.get("scaleUp") and int(r.get("firstStepUnixMs", 0)) > 0
            for r in j.get("recoveryHistory", [])))
    finally:
        cluster.ctl("cancel", low_id)
    history = job["recoveryHistory"]
    shrink = next(r for r in history if "preempted by" in r["reason"])
    grow = next(r for r in history if r.get("scaleUp"))
    return {
        "urgent_job": urgent_id, "low_job": low_id,
        "submit_to_first_step_s": int(done["firstStepLatencyMs"]) / 1000,
        "low_pause_at_shrink_s": pause_s(shrink),
        "low_pause_at_growth_s": pause_s(grow),
        "low_steps_redone": int(shrink.get("stepsRedone", 0)) + int(grow.get("stepsRedone", 0)),
        "low_counted_restarts": int(job.get("recoveries", 0)),
        "shrink_reason": shrink["reason"],
    }


def trial_suspend(cluster, a):
    low = reference_spec(2, 2, max_steps=1_000_000, skip_eval=True)
    low.update(name="low", priority=0)
    low_id = submit(cluster, low)
    try:
        wait(cluster, low_id, lambda j: len(j.get("members", [])) == 2 and
             int(j.get("step", 0)) >= a.warm_steps)
        urgent = reference_spec(2, 2, max_steps=a.urgent_steps, skip_eval=True)
        urgent.update(name="urgent", priority=10)
        urgent_id = submit(cluster, urgent)
        suspended = wait(cluster, low_id, lambda j: j["state"] == "JOB_STATE_SUSPENDED")
        done = wait(cluster, urgent_id, lambda j: j["state"] not in
                    ("JOB_STATE_PENDING", "JOB_STATE_RUNNING", "JOB_STATE_RECONFIGURING"))
        if done["state"] != "JOB_STATE_SUCCEEDED":
            raise RuntimeError(f"urgent {urgent_id} {done['state']}: {done.get('reason')}")
        job = wait(cluster, low_id, lambda j: any(
            r["reason"].startswith("resumed after") and int(r.get("firstStepUnixMs", 0)) > 0
            for r in j.get("recoveryHistory", [])))
    finally:
        cluster.ctl("cancel", low_id)
    resume = next(r for r in job["recoveryHistory"] if r["reason"].startswith("resumed after"))
    return {
        "urgent_job": urgent_id, "low_job": low_id,
        "submit_to_first_step_s": int(done["firstStepLatencyMs"]) / 1000,
        "low_resume_s": (int(resume["firstStepUnixMs"]) - int(done["endTimeUnixMs"])) / 1000,
        "low_suspended_s": int(job.get("suspendedMs", 0)) / 1000,
        "low_steps_redone": int(resume.get("stepsRedone", 0)),
        "low_counted_restarts": int(job.get("recoveries", 0)),
        "suspended_at_step": int(suspended["suspension"].get("step", 0)),
    }


class Torchrun:
    """bench/torch/run_torchrun.sh NPROC train_mlp.py-args in its own session; its STEP lines'
    (step, unix ms) and RESUMED_FROM_STEP as they come."""

    def __init__(self, nproc, *args):
        self.steps, self.resumed, self.done = [], None, threading.Event()
        self.proc = subprocess.Popen(
            [os.path.join(ROOT, "bench/torch/run_torchrun.sh"), str(nproc), "--log_every", "1",
             *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            parts = line.split()
            if parts[:1] == ["STEP"]:
                self.steps.append((int(parts[1]), int(parts[2])))
            elif parts[:1] == ["RESUMED_FROM_STEP"]:
                self.resumed = int(parts[1])
        self.done.set()

    def first_step_ms(self, timeout_s=300):
        deadline = time.time() + timeout_s
        while not self.steps and time.time() < deadline and not self.done.is_set():
            time.sleep(0.01)
        if not self.steps:
            raise RuntimeError("torchrun printed no step")
        return self.steps[0][1]

    def wait_step(self, step, timeout_s=300):
        deadline = time.time() + timeout_s
        while (not self.steps or self.steps[-1][0] < step) and time.time() < deadline:
            if self.done.is_set():
                raise RuntimeError(f"torchrun ended at step {self.steps[-1:]}")
            time.sleep(0.01)

    def kill(self):
        """Stops it as an operator would (SIGTERM to torchrun and its workers); the last step."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.done.wait(5)
        return self.steps[-1][0] if self.steps else 0


def torch_trial(a):
    ckpt = tempfile.mkdtemp(prefix="torch-preempt.")
    common = ["--max_steps", 1_000_000, "--checkpoint_dir", ckpt,
              "--checkpoint_every", a.checkpoint_every]
    low = Torchrun(2, *common)
    low.wait_step(a.warm_steps)
    kill_ms = time.time() * 1000
    at_kill = low.kill()
    urgent = Torchrun(1, "--max_steps", a.urgent_steps)
    low = Torchrun(1, *common)
    urgent_first = urgent.first_step_ms()
    low_first = low.first_step_ms()
    redone = at_kill - (low.resumed or 0)
    urgent.proc.wait(timeout=300)
    # Grow back: stop it again and relaunch it on both.
    kill2_ms = time.time() * 1000
    at_kill2 = low.kill()
    low = Torchrun(2, *common)
    low_first2 = low.first_step_ms()
    redone += at_kill2 - (low.resumed or 0)
    low.kill()
    return {"submit_to_first_step_s": (urgent_first - kill_ms) / 1000,
            "low_pause_at_shrink_s": (low_first - kill_ms) / 1000,
            "low_pause_at_growth_s": (low_first2 - kill2_ms) / 1000,
            "low_steps_redone": redone, "low_counted_restarts": 2}


def torch_trial_suspend(a):
    ckpt = tempfile.mkdtemp(prefix="torch-suspend.")
    common = ["--max_steps", 1_000_000, "--checkpoint_dir", ckpt,
              "--checkpoint_every", a.checkpoint_every]
    low = Torchrun(2, *common)
    low.wait_step(a.warm_steps)
    kill_ms = time.time() * 1000
    at_kill = low.kill()
    urgent = Torchrun(2, "--max_steps", a.urgent_steps)
    urgent_first = urgent.first_step_ms()
    urgent.proc.wait(timeout=300)
    end_ms = time.time() * 1000
    low = Torchrun(2, *common)
    low_first = low.first_step_ms()
    redone = at_kill - (low.resumed or 0)
    low.kill()
    return {"submit_to_first_step_s": (urgent_first - kill_ms) / 1000,
            "low_resume_s": (low_first - end_ms) / 1000,
            "low_suspended_s": (low_first - kill_ms) / 1000,
            "low_steps_redone": redone, "low_counted_restarts": 1}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--warm_steps", type=int, default=120)
    p.add_argument("--urgent_steps", type=int, default=100)
    p.add_argument("--checkpoint_every", type=int, default=50, help="torchrun's checkpoints")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--scenario", choices=["shrink", "suspend", "both"], default="both")
    p.add_argument("--out", default=os.path.join(ROOT, "bench/results/preemption.json"))
    a = p.parse_args()
    cluster = Cluster(a.build, 2)
    scenarios = ["shrink", "suspend"] if a.scenario == "both" else [a.scenario]
    trials = {(s, system): [] for s in scenarios for system in ("Lockstep", "torchrun")}
    runners = {("shrink", "Lockstep"): lambda: trial(cluster, a),
               ("shrink", "torchrun"): lambda: torch_trial(a),
               ("suspend", "Lockstep"): lambda: trial_suspend(cluster, a),
               ("suspend", "torchrun"): lambda: torch_trial_suspend(a)}
    try:
        for i in range(a.trials):
            for scenario in scenarios:
                # Alternated against drift.
                for system in (["Lockstep", "torchrun"] if i % 2 == 0 else
                               ["torchrun", "Lockstep"]):
                    if system == "torchrun" and a.skip_torch:
                        continue
                    t = runners[(scenario, system)]()
                    trials[(scenario, system)].append(t)
                    print(f"{scenario} {system} trial {i + 1}: urgent first step after "
                          f"{t['submit_to_first_step_s']:.3f} s, {t['low_steps_redone']} steps "
                          "redone", file=sys.stderr)
    finally:
        cluster.stop()

    def cells(system, key, fmt, scenario="shrink"):
        values = [t[key] for t in trials.get((scenario, system), [])]
        if not values:
            return "-"
        return (", ".join(fmt.format(v) for v in values) +
                f" (median {fmt.format(statistics.median(values))})")

    if "shrink" in scenarios:
        shrink_table(a, cells)
    if "suspend" in scenarios:
        suspend_table(a, cells)
    result = {"workload": "reference MLP, Fashion-MNIST, batch 256", "host_cpus": os.cpu_count(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "build": a.build,
              "settings": vars(a),
              "trials": {f"{s}/{system}": t for (s, system), t in trials.items()}}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nJSON: {a.out}")


def suspend_table(a, cells):
    print(f"\nSuspension: 2 workers, the reference MLP as a low-priority job needing both "
          f"(Lockstep: min 2; torchrun: 2 processes, checkpoints every {a.checkpoint_every} "
          f"steps); after {a.warm_steps} steps a job needing both ({a.urgent_steps} steps; "
          f"Lockstep: priority 10). torchrun's times count from the operator's kill. "
          f"{a.trials} trials each, alternated.\n")
    print("| measure | Lockstep (suspend, state in memory) | torchrun (kill, relaunch from "
          "checkpoint) |")
    print("|---|---|---|")
    for name, key, fmt in [
            ("submit (torchrun: kill) to the urgent job's first step", "submit_to_first_step_s",
             "{:.3f} s"),
            ("urgent job's end to the low job's first step", "low_resume_s", "{:.3f} s"),
            ("low job's steps redone", "low_steps_redone", "{}"),
            ("low job's restarts counted", "low_counted_restarts", "{}")]:
        print(f"| {name} | {cells('Lockstep', key, fmt, 'suspend')} | "
              f"{cells('torchrun', key, fmt, 'suspend')} |")


def shrink_table(a, cells):
    print(f"\nPreemption: 2 workers, the reference MLP as a low-priority job (Lockstep: min 1, "
          f"max 2; torchrun: 2 processes, checkpoints every {a.checkpoint_every} steps); after "
          f"{a.warm_steps} steps a job needing 1 worker ({a.urgent_steps} steps; Lockstep: "
          f"priority 10). torchrun's times count from the operator's kill. "
          f"{a.trials} trials each, alternated.\n")
    print("| measure | Lockstep (shrink) | torchrun (kill, relaunch from checkpoint) |")
    print("|---|---|---|")
    for name, key, fmt in [
            ("submit (torchrun: kill) to the urgent job's first step", "submit_to_first_step_s",
             "{:.3f} s"),
            ("low job's pause when it gives up a worker", "low_pause_at_shrink_s", "{:.3f} s"),
            ("low job's pause when it grows back", "low_pause_at_growth_s", "{:.3f} s"),
            ("low job's steps redone (both)", "low_steps_redone", "{}"),
            ("low job's restarts counted", "low_counted_restarts", "{}")]:
        print(f"| {name} | {cells('Lockstep', key, fmt)} | {cells('torchrun', key, fmt)} |")


if __name__ == "__main__":
    main()
