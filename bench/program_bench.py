#!/usr/bin/env python3
"""Program jobs: a user's unchanged torchrun script under Lockstep, next to torchrun itself.

Workload: examples/torch/train.py (synthetic token classification, DDP over Gloo, 2 processes,
one thread each, per-rank batch 32, global batch 64), run with --timing: rank 0 prints
`timing <name> <unix_time>` lines (process start, script start, after import torch, after the
lockstep import, after init_process_group, after the checkpoint load, first step, every
--log-every step). Every number below comes from those lines (and, for Lockstep, from the job's
recoveryHistory), so all systems are measured by the same clock in the same script.

Systems, 2 workers/processes on this host:
  * torchrun --standalone;
  * torchrun with the c10d rendezvous (--rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:PORT
    --nnodes=1 --max_restarts=3);
  * Lockstep: a local cluster (deploy/local/cluster.sh, 2 workers with --programs_root), one
    program job per run on the same long-lived workers.
torchrun runs with --redirects=9:1 --tee=9:1 (Debian's torchrun crashes on Python 3.11 without
them) and OMP_NUM_THREADS=1, as Lockstep's default threadsPerWorker gives the program.

Measures:
  1. steady-state samples/s from the timing lines (from step --warmup to the last step, no
     checkpoints), runs alternating A B C C B A A B C ... to cancel the machine's drift;
  2. launch (torchrun) or submit (Lockstep) to the first completed step, from the same runs;
  3. kill -9 of rank 1's Python process after the checkpoint at step 2 * --checkpoint_every
     (plus --kill_delay), with --sleep_ms per step: kill to the group's next completed step
     (rank 0's first step after the restart), and steps redone (step at the kill minus the
     step resumed from). torchrun restarts all processes (--max_restarts=3);
  4. where the restart time goes: Lockstep's detection (kill to recoveryHistory.detectUnixMs),
     stop + re-form (to reformedUnixMs), then the new rank 0's spawn, interpreter start,
     import torch, import lockstep.torch, init_process_group, data/model/checkpoint load and
     first step; torchrun's kill to the new process's start, then the same phases.

Prints a Markdown table per measurement and writes JSON (default
bench/results/program_bench.json). --quick: fewer steps, one repetition, one kill per system
(under 3 minutes).
Usage: bench/program_bench.py [--quick] [--build build-dev] [--repeats 3] [--steps 2000]
       [--recovery_trials 3] [--out FILE]
"""
import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = "/usr/bin/python3"
TRAIN = os.path.join(ROOT, "examples/torch/train.py")
MEMORY = "Lockstep + memory checkpoints"
SYSTEMS = ["torchrun --standalone", "torchrun c10d", "Lockstep", MEMORY]


def is_lockstep(system):
    return system.startswith("Lockstep")

# Start-up phases, in the order train.py's --timing reports them: (event, label of the phase
# that ends at the event).
PHASES = [
    ("proc_start", "spawn (to the process's start, /proc, 10 ms ticks)"),
    ("script_start", "interpreter start-up (to train.py's first line)"),
    ("import_torch", "import torch"),
    ("import_lockstep", "import lockstep.torch (grpc; Lockstep only)"),
    ("init_process_group", "init_process_group (rendezvous with the other rank)"),
    ("checkpoint_load", "data, model, optimizer, checkpoint load"),
    ("first_step", "first step (resume-step allreduce, DDP wrap, step 1)"),
]


# --------------------------------------------------------------------------------------------
# Parsing train.py's output


def parse_timing(lines):
    """[(name, unix_s, {field: value})] from `timing NAME T k=v ...` lines (prefixes stripped)."""
    events = []
    for line in lines:
        if line.startswith("[default") and "]:" in line:
            line = line.split("]:", 1)[1]
        parts = line.split()
        if len(parts) < 3 or parts[0] != "timing":
            continue
        try:
            t = float(parts[2])
        except ValueError:
            continue
        fields = dict(p.split("=", 1) for p in parts[3:] if "=" in p)
        events.append((parts[1], t, fields))
    return events


def incarnations(events):
    """Splits rank 0's events into one list per process (each starts at proc_start)."""
    out = []
    for e in events:
        if e[0] == "proc_start" or not out:
            out.append([])
        out[-1].append(e)
    return out


def first(events, name):
    for e in events:
        if e[0] == name:
            return e
    return None


def phases(events, origin_s):
    """{event: seconds since the previous event (origin_s for the first)} for PHASES. A process
    that started before origin_s (a Lockstep worker's warm interpreter, parked ahead) spawned
    in 0 s; its interpreter start-up is then origin_s to the script's first line."""
    out, prev = {}, origin_s
    for name, _ in PHASES:
        e = first(events, name)
        if e is None:
            continue
        out[name] = max(0.0, e[1] - prev) if name == "proc_start" else e[1] - prev
        prev = max(e[1], origin_s) if name == "proc_start" else e[1]
    return out


def throughput(events, warmup, global_batch):
    steps = [(int(f["step"]), t) for n, t, f in events if n == "step" and int(f["step"]) >= warmup]
    if len(steps) < 2:
        raise RuntimeError(f"too few step timing lines after step {warmup}: {steps}")
    (s0, t0), (s1, t1) = steps[0], steps[-1]
    saved = [float(f.get("save_s", 0)) for n, t, f in events
             if n == "step" and int(f["step"]) in (s0, s1)]
    return {"samples_per_second": global_batch * (s1 - s0) / (t1 - t0),
            "ms_per_step": (t1 - t0) * 1000 / (s1 - s0), "from_step": s0, "to_step": s1,
            # rank 0's time inside lockstep.torch.Checkpointer.save, per step, same window
            "save_ms_per_step": (saved[-1] - saved[0]) * 1000 / (s1 - s0)
            if len(saved) == 2 else None}


def final_loss(lines):
    for line in lines:
        if "final_loss=" in line:
            return float(line.split("final_loss=", 1)[1])
    return None


def global_batch(lines):
    for line in lines:
        if "global_batch=" in line:
            return int(line.split("global_batch=", 1)[1].split()[0])
    raise RuntimeError("train.py printed no global_batch")


# --------------------------------------------------------------------------------------------
# Processes: finding rank 1, killing it


def cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]


def environ(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(kv.decode(errors="replace").split("=", 1)
                    for kv in f.read().split(b"\0") if b"=" in kv)


def find_rank1(checkpoint_dir, by_env):
    """The pid of train.py's local rank 1 in the run whose --checkpoint-dir is checkpoint_dir:
    Lockstep appends --local_rank=1 to its argv; torchrun sets LOCAL_RANK=1 in its environment
    (its own agent has the same argv, without LOCAL_RANK)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            argv = cmdline(pid)
            if "train.py" not in " ".join(argv) or f"--checkpoint-dir={checkpoint_dir}" not in argv:
                continue
            if not by_env and "--local_rank=1" in argv:
                return pid
            if by_env and environ(pid).get("LOCAL_RANK") == "1":
                return pid
        except (OSError, ValueError):
            continue
    return None


def wait_for_checkpoints(path, writes, deadline_s, proc=None):
    """Returns once path has been written `writes` times (distinct mtimes; train.py replaces it
    atomically every --checkpoint-every steps), polling every 5 ms."""
    seen, last = 0, None
    while time.time() < deadline_s:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the run ended (exit {proc.returncode}) before checkpoint {writes}")
        try:
            m = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            m = None
        if m is not None and m != last:
            seen, last = seen + 1, m
            if seen >= writes:
                return
        time.sleep(0.005)
    raise RuntimeError(f"{path}: {seen} of {writes} checkpoint writes before the deadline")


def kill_rank1(checkpoint_dir, by_env, deadline_s):
    while time.time() < deadline_s:
        pid = find_rank1(checkpoint_dir, by_env)
        if pid is not None:
            t = time.time()
            os.kill(pid, signal.SIGKILL)
            return t, pid
        time.sleep(0.01)
    raise RuntimeError("rank 1's process was not found")


# --------------------------------------------------------------------------------------------
# The systems


class Workspace:
    """A fresh directory for everything this run writes: the programs root (world-readable,
    the workers run programs as nobody when started as root), checkpoints (world-writable) and
    the cluster's directory."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="program-bench.")
        os.chmod(self.dir, 0o755)
        self.prog = os.path.join(self.dir, "prog")
        self.ckpt = os.path.join(self.dir, "ckpt")
        os.makedirs(self.prog)
        os.makedirs(self.ckpt)
        os.chmod(self.prog, 0o755)
        os.chmod(self.ckpt, 0o777)
        shutil.copy(TRAIN, os.path.join(self.prog, "train.py"))
        os.chmod(os.path.join(self.prog, "train.py"), 0o644)
        self.n = 0

    def checkpoint_dir(self):
        self.n += 1
        d = os.path.join(self.ckpt, f"run-{self.n}")
        os.makedirs(d)
        os.chmod(d, 0o777)
        return d

    def remove(self):
        shutil.rmtree(self.dir, ignore_errors=True)


class Lockstep:
    def __init__(self, build, ws):
        self.build, self.ws = build, ws
        self.dir = os.path.join(ws.dir, "cluster")
        self.ctl_path = os.path.join(build, "cli/lockstepctl")
        subprocess.run([os.path.join(ROOT, "deploy/local/cluster.sh"), "start", "--dir", self.dir,
                        "--workers", "2", "--bin", build, "--programs_root", ws.prog],
                       check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(self.dir, "address")) as f:
            self.address = f.read().strip()

    def ctl(self, *args, timeout=60):
        return subprocess.run([self.ctl_path, f"--coordinator={self.address}", *args],
                              check=True, capture_output=True, text=True, timeout=timeout).stdout

    def submit(self, args):
        spec = {"name": "program-bench", "minWorkers": 2, "maxWorkers": 2, "maxRestarts": 5,
                "program": {"argv": [PYTHON, "train.py", *args], "workdir": self.ws.prog,
                            "localRankArg": "--local_rank", "stopGraceMs": 2000}}
        path = os.path.join(self.dir, f"job-{time.time_ns()}.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        t = time.time()
        job_id = json.loads(self.ctl("--output=json", "submit", path))["jobId"]
        return job_id, t

    def wait(self, job_id, timeout_s):
        # One watch stream until the job ends (polling would cost the programs CPU).
        try:
            subprocess.run([self.ctl_path, f"--coordinator={self.address}", "watch", job_id],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.ctl("cancel", job_id)
            raise RuntimeError(f"{job_id} did not end within {timeout_s} s")
        job = json.loads(self.ctl("--output=json", "status", job_id))
        # The logs reach the coordinator in batches every 200 ms; the last batch may trail the
        # job's end.
        lines = []
        for _ in range(20):
            lines = self.ctl("logs", job_id, "--rank=0").splitlines()
            if any("final_step=" in line for line in lines):
                break
            time.sleep(0.1)
        if job["state"] != "JOB_STATE_SUCCEEDED":
            raise RuntimeError(f"{job_id} {job['state']}: {job.get('reason')}")
        return job, lines

    def stop(self):
        subprocess.run([os.path.join(ROOT, "deploy/local/cluster.sh"), "stop", "--dir", self.dir],
                       check=False)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Torchrun:
    """One torchrun of train.py in a session of its own, its stdout read by a thread."""

    def __init__(self, system, args, monitor_interval=None, cwd=None):
        cmd = [PYTHON, "-m", "torch.distributed.run"]
        if system == "torchrun --standalone":
            cmd += ["--standalone", "--nnodes=1", "--max_restarts=3"]
        else:
            cmd += ["--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}",
                    "--nnodes=1", "--max_restarts=3"]
        if monitor_interval is not None:
            cmd.append(f"--monitor_interval={monitor_interval}")
        cmd += ["--nproc_per_node=2", "--redirects=9:1", "--tee=9:1",
                os.path.join(cwd, "train.py"), *args]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env.pop("PYTHONPATH", None)  # no lockstep.torch: train.py runs as a plain torchrun user's
        self.lines, self.cmd = [], cmd
        self.launch = time.time()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env, cwd=cwd, start_new_session=True)
        self.stderr = []
        self.readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self.lines)),
                        threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr))]
        for r in self.readers:
            r.start()

    @staticmethod
    def _read(stream, out):
        for line in stream:
            out.append(line.rstrip("\n"))

    def wait(self, timeout_s):
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"torchrun did not end within {timeout_s} s: "
                               f"{' | '.join(self.stderr[-5:])}")
        for r in self.readers:
            r.join()
        if self.proc.returncode != 0:
            raise RuntimeError(f"torchrun exited {self.proc.returncode}: "
                               f"{' | '.join(self.stderr[-5:])}")
        return self.lines

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


# --------------------------------------------------------------------------------------------
# Measurements


def steady_run(system, lockstep, ws, a):
    args = [f"--steps={a.steps}", f"--log-every={a.log_every}", "--timing"]
    if system == MEMORY:
        args.append("--memory-checkpoint-every=1")
    if is_lockstep(system):
        job_id, launch = lockstep.submit(args)
        job, lines = lockstep.wait(job_id, a.timeout)
        extra = {"job_id": job_id, "coordinator_first_step_latency_ms":
                 int(job["firstStepLatencyMs"]),
                 "coordinator_samples_per_second": job.get("samplesPerSecond")}
    else:
        run = Torchrun(system, args, cwd=ws.prog)
        launch = run.launch
        lines = run.wait(a.timeout)
        extra = {}
    events = parse_timing(lines)
    tp = throughput(events, a.warmup, global_batch(lines))
    first_step = first(events, "first_step")[1]
    return {"system": system, **tp, "launch_to_first_step_s": first_step - launch,
            "startup_phases_s": phases(events, launch), "final_loss": final_loss(lines), **extra}


def recovery_run(system, lockstep, ws, a):
    ckpt = ws.checkpoint_dir()
    args = [f"--steps={a.recovery_steps}", f"--checkpoint-every={a.checkpoint_every}",
            f"--checkpoint-dir={ckpt}", f"--sleep-ms={a.sleep_ms}", "--log-every=1", "--timing"]
    if system == MEMORY:
        args.append("--memory-checkpoint-every=1")
    deadline = time.time() + a.timeout
    path = os.path.join(ckpt, "checkpoint.pt")
    if is_lockstep(system):
        job_id, launch = lockstep.submit(args)
        wait_for_checkpoints(path, 2, deadline)
        time.sleep(a.kill_delay)
        kill_t, pid = kill_rank1(ckpt, False, deadline)
        job, lines = lockstep.wait(job_id, a.timeout)
    else:
        run = Torchrun(system, args, monitor_interval=a.monitor_interval, cwd=ws.prog)
        try:
            wait_for_checkpoints(path, 2, deadline, run.proc)
            time.sleep(a.kill_delay)
            kill_t, pid = kill_rank1(ckpt, True, deadline)
        except BaseException:
            run.kill()
            raise
        lines = run.wait(a.timeout)
    inc = incarnations(parse_timing(lines))
    # By the script's start: a warm interpreter's process started before the kill.
    began = lambda i: (first(i, "script_start") or i[0])[1]
    before = [i for i in inc if began(i) < kill_t]
    after = [i for i in inc if began(i) >= kill_t]
    if not before or not after:
        raise RuntimeError(f"{system}: no restarted rank 0 in the timing lines "
                           f"({len(inc)} processes)")
    step_at_kill = max([int(f["step"]) for n, t, f in before[-1] if n == "step" and t <= kill_t],
                       default=0)
    restarted = after[0]
    resumed = int(first(restarted, "checkpoint_load")[2]["start_step"])
    first_step = first(restarted, "first_step")[1]
    out = {"system": system, "killed_pid": pid, "kill_unix_s": kill_t,
           "step_at_kill": step_at_kill, "resumed_from_step": resumed,
           "steps_redone": step_at_kill - resumed, "recovery_s": first_step - kill_t,
           "restarts_seen": len(inc) - 1, "final_loss": final_loss(lines),
           "warm_start": int((first(restarted, "script_start") or (0, 0, {}))[2]
                             .get("preloaded", 0)) == 1}
    if is_lockstep(system):
        hist = [r for r in job["recoveryHistory"] if int(r.get("detectUnixMs", 0)) / 1000 >= kill_t - 1]
        if not hist:
            raise RuntimeError(f"{job_id}: no recovery recorded")
        r = hist[0]
        detect, reformed = int(r["detectUnixMs"]) / 1000, int(r["reformedUnixMs"]) / 1000
        out.update({
            "job_id": job_id, "recovery_record": r,
            "detection_s": detect - kill_t, "stop_reform_s": reformed - detect,
            "phases_s": phases(restarted, reformed),
            "coordinator_first_step_s": int(r.get("firstStepUnixMs", 0)) / 1000 - kill_t,
            "coordinator_steps_redone": int(r.get("stepsRedone", 0)),
            "coordinator_step_at_detection": int(r.get("stepAtDetection", 0)),
            "coordinator_resumed_from_step": int(r.get("resumedFromStep", 0)),
        })
    else:
        # torchrun: the agent notices the dead process at its next monitor tick, stops the
        # others, re-runs its rendezvous and spawns: all of it is "to the new process's start".
        out["phases_s"] = phases(restarted, kill_t)
    return out


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt_s(v, digits=3):
    return "-" if v is None else f"{v:.{digits}f} s"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="650 steps, one run per system, one kill per system (under 3 minutes)")
    p.add_argument("--build", default=os.path.join(ROOT, "build-dev"))
    p.add_argument("--repeats", type=int, default=3, help="steady-state runs per system")
    p.add_argument("--steps", type=int, default=2000, help="steps of a steady-state run")
    p.add_argument("--warmup", type=int, default=50, help="steps left out of the throughput")
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--recovery_trials", type=int, default=3, help="kills per system")
    p.add_argument("--recovery_steps", type=int, default=200)
    p.add_argument("--checkpoint_every", type=int, default=50)
    p.add_argument("--sleep_ms", type=float, default=20.0)
    p.add_argument("--kill_delay", type=float, default=0.5,
                   help="seconds after the second checkpoint write to kill rank 1")
    p.add_argument("--monitor_interval", type=float, default=None,
                   help="torchrun's --monitor_interval in the kill runs (default: torchrun's, 5 s)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--timeout", type=float, default=180, help="seconds per run")
    p.add_argument("--out", default=os.path.join(ROOT, "bench/results/program_bench.json"))
    a = p.parse_args()
    if a.quick:
        a.repeats, a.steps, a.recovery_trials = 1, 650, 1
    systems = [s for s in a.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            p.error(f"unknown system {s!r} (known: {', '.join(SYSTEMS)})")

    result = {"workload": "examples/torch/train.py, 2 processes, Gloo, global batch 64",
              "host": os.uname().nodename, "cpus": os.cpu_count(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "build": a.build, "quick": a.quick,
              "settings": {k: v for k, v in vars(a).items() if k not in ("out", "build", "quick")},
              "steady": [], "recovery": []}
    ws = Workspace()
    lockstep = None
    try:
        if any(is_lockstep(s) for s in systems):
            lockstep = Lockstep(a.build, ws)
        # Steady state: A B C, C B A, A B C ... (each round reversed) against drift.
        for rep in range(a.repeats):
            order = systems if rep % 2 == 0 else list(reversed(systems))
            for s in order:
                r = steady_run(s, lockstep, ws, a)
                r["round"] = rep
                result["steady"].append(r)
                print(f"steady {s} round {rep}: {r['samples_per_second']:,.0f} samples/s, "
                      f"{r['ms_per_step']:.2f} ms/step, first step after "
                      f"{r['launch_to_first_step_s']:.2f} s", file=sys.stderr)
        for trial in range(a.recovery_trials):
            order = systems if trial % 2 == 0 else list(reversed(systems))
            for s in order:
                r = recovery_run(s, lockstep, ws, a)
                r["trial"] = trial
                result["recovery"].append(r)
                print(f"kill {s} trial {trial}: next step after {r['recovery_s']:.2f} s, "
                      f"steps redone {r['steps_redone']}", file=sys.stderr)
    finally:
        if lockstep is not None:
            lockstep.stop()
        ws.remove()

    summarize_and_print(result, systems, a)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nJSON: {a.out}")


def summarize_and_print(result, systems, a):
    summary = {}
    steady = result["steady"]
    rec = result["recovery"]
    for s in systems:
        runs = [r for r in steady if r["system"] == s]
        kills = [r for r in rec if r["system"] == s]
        summary[s] = {
            "samples_per_second_median": med(r["samples_per_second"] for r in runs),
            "launch_to_first_step_s_median": med(r["launch_to_first_step_s"] for r in runs),
            "startup_phases_s_median": {n: med(r["startup_phases_s"].get(n) for r in runs)
                                        for n, _ in PHASES},
            "recovery_s_median": med(r["recovery_s"] for r in kills),
            "warm_starts": sum(1 for r in kills if r.get("warm_start")),
            "steps_redone": [r["steps_redone"] for r in kills],
            "recovery_phases_s_median": {n: med(r["phases_s"].get(n) for r in kills)
                                         for n, _ in PHASES},
        }
        if is_lockstep(s) and kills:
            summary[s]["detection_s_median"] = med(r["detection_s"] for r in kills)
            summary[s]["stop_reform_s_median"] = med(r["stop_reform_s"] for r in kills)
            summary[s]["coordinator_first_step_s_median"] = med(
                r["coordinator_first_step_s"] for r in kills)
    result["summary"] = summary
    base = summary.get("torchrun --standalone", {}).get("samples_per_second_median")

    print(f"\n1. Steady state, {a.steps} steps, samples/s from step {a.warmup} to the last "
          f"(examples/torch/train.py, 2 processes, global batch 64, no checkpoints)\n")
    print("| system | " + " | ".join(f"run {i + 1}" for i in range(a.repeats)) +
          " | median | ms/step (median) | vs torchrun --standalone |")
    print("|---|" + "---|" * a.repeats + "---|---|---|")
    for s in systems:
        runs = sorted((r for r in steady if r["system"] == s), key=lambda r: r["round"])
        m = summary[s]["samples_per_second_median"]
        ratio = f"{m / base:.2f}x" if base and m else "-"
        print(f"| {s} | " + " | ".join(f"{r['samples_per_second']:,.0f}" for r in runs) +
              f" | {m:,.0f} | {med(r['ms_per_step'] for r in runs):.2f} | {ratio} |")
    print("\nRun order: " + ", ".join(f"{r['system']}" for r in steady))
    if MEMORY in systems:
        runs = [r for r in steady if r["system"] == MEMORY]
        save_ms, step_ms = med(r["save_ms_per_step"] for r in runs), med(
            r["ms_per_step"] for r in runs)
        plain = summary.get("Lockstep", {}).get("samples_per_second_median")
        mem = summary[MEMORY]["samples_per_second_median"]
        summary[MEMORY]["save_ms_per_step_median"] = save_ms
        print(f"\n{MEMORY} (a save after every step): rank 0 spends {save_ms:.3f} ms per step "
              f"in Checkpointer.save, {100 * save_ms / step_ms:.1f}% of its {step_ms:.2f} ms "
              f"step" + (f"; samples/s {100 * (1 - mem / plain):.1f}% below plain Lockstep "
                         f"(the save, the worker's copies to its peer, noise)" if plain else ""))

    print("\n2. Launch (torchrun) or submit (Lockstep, before `lockstepctl submit`) to the "
          "first completed step, medians of the runs above\n")
    print("| phase | " + " | ".join(systems) + " |")
    print("|---|" + "---|" * len(systems))
    for n, label in PHASES:
        print(f"| {label} | " + " | ".join(
            fmt_s(summary[s]["startup_phases_s_median"][n]) for s in systems) + " |")
    print("| **launch/submit to first step** | " + " | ".join(
        f"**{fmt_s(summary[s]['launch_to_first_step_s_median'])}**" for s in systems) + " |")
    for system in filter(is_lockstep, systems):
        ls = [r["coordinator_first_step_latency_ms"] / 1000 for r in steady
              if r["system"] == system]
        print(f"\n{system}: firstStepLatencyMs (coordinator: submit to the first report), "
              f"median {fmt_s(med(ls))} ({', '.join(f'{v:.3f}' for v in ls)})")

    if not rec:
        return
    print(f"\n3. kill -9 of rank 1 {a.kill_delay} s after the checkpoint at step "
          f"{2 * a.checkpoint_every} (--sleep-ms={a.sleep_ms:g}, checkpoint every "
          f"{a.checkpoint_every}): kill to the group's next completed step\n")
    print("| system | trials (s) | median | steps redone | step at kill -> resumed from |")
    print("|---|---|---|---|---|")
    for s in systems:
        kills = sorted((r for r in rec if r["system"] == s), key=lambda r: r["trial"])
        if not kills:
            continue
        trials = ", ".join("%.3f" % r["recovery_s"] for r in kills)
        redone = ", ".join(str(r["steps_redone"]) for r in kills)
        steps = ", ".join("%d->%d" % (r["step_at_kill"], r["resumed_from_step"]) for r in kills)
        print(f"| {s} | {trials} | {fmt_s(summary[s]['recovery_s_median'])} | {redone} | "
              f"{steps} |")
    for system in filter(is_lockstep, systems):
        kills = [r for r in rec if r["system"] == system]
        firsts = ", ".join("%.3f" % r["coordinator_first_step_s"] for r in kills)
        records = ", ".join("%d->%d (%d)" % (r["coordinator_step_at_detection"],
                                             r["coordinator_resumed_from_step"],
                                             r["coordinator_steps_redone"]) for r in kills)
        restored = ", ".join(r["recovery_record"].get("restoredFrom", "-") for r in kills)
        print(f"\n{system}: recoveryHistory kill to firstStepUnixMs {firsts} s; "
              f"stepAtDetection -> resumedFromStep (stepsRedone): {records}; "
              f"restoredFrom: {restored}")

    print("\n4. Where the restart time goes (medians; the new rank 0's timing lines)\n")
    print("| phase | " + " | ".join(systems) + " |")
    print("|---|" + "---|" * len(systems))
    if any(is_lockstep(s) for s in systems):
        row = lambda label, key: print(f"| {label} | " + " | ".join(
            fmt_s(summary[s].get(key)) if is_lockstep(s) else "-" for s in systems) + " |")
        row("detection (kill to recoveryHistory.detectUnixMs)", "detection_s_median")
        row("stop + re-form (to reformedUnixMs)", "stop_reform_s_median")
    for n, label in PHASES:
        if n == "proc_start":
            label = ("spawn: Lockstep from reformedUnixMs; torchrun from the kill (its monitor "
                     "tick, stop, rendezvous and spawn)")
        print(f"| {label} | " + " | ".join(
            fmt_s(summary[s]["recovery_phases_s_median"][n]) for s in systems) + " |")
    print("| restarted rank 0 in a warm interpreter | " + " | ".join(
        f"{summary[s]['warm_starts']} of {len(summary[s]['steps_redone'])}" for s in systems) + " |")
    print("| **kill to first step** | " + " | ".join(
        f"**{fmt_s(summary[s]['recovery_s_median'])}**" for s in systems) + " |")
    if "Lockstep" in systems:
        ls = summary["Lockstep"]
        ph = ls["recovery_phases_s_median"]
        imp = (ph.get("script_start") or 0) + (ph.get("import_torch") or 0) + \
            (ph.get("import_lockstep") or 0)
        total = ls["recovery_s_median"]
        candidates = [(label, ph[n]) for n, label in PHASES if ph.get(n) is not None]
        candidates += [("detection", ls.get("detection_s_median") or 0),
                       ("stop + re-form", ls.get("stop_reform_s_median") or 0)]
        largest = max(candidates, key=lambda x: x[1], default=(None, 0))
        print(f"\nLockstep: interpreter start-up and imports (script start, import torch, import "
              f"lockstep.torch) take {imp:.3f} s of {total:.3f} s ({100 * imp / total:.0f}%); "
              f"the largest single phase is {largest[0]} ({largest[1]:.3f} s)."
              + (" Interpreter start-up (import torch) dominates." if imp > total / 2 else
                 " Interpreter start-up (import torch) does not dominate on its own."))


if __name__ == "__main__":
    main()
