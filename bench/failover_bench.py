#!/usr/bin/env python3
"""Failover of coordinators on etcd: kill -9 of the leader, and how long until

  (a) a standby leads and serves (it takes a job submitted to every coordinator in turn),
  (b) every worker is registered with it again,
  (c) that job, submitted at the kill, trains its first step,
  (d) the job that was training when the leader died is the new leader's again: its group,
      which trained on without a coordinator, kept as it is (its generation unchanged, no
      recovery recorded; the steps it trained meanwhile are counted), or else re-formed from
      its members' memory and training again (steps redone counted from its recovery record).

An etcd cluster of three members runs on loopback for the whole run; each trial starts three
coordinators (a prefix of their own) and the workers, submits a job on two workers, waits for
it to train, kills the leader, and polls every coordinator every 10 ms.

Prints a Markdown table and writes JSON (default bench/results/failover.json).
Usage: bench/failover_bench.py [--trials 10] [--workers 4]
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
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(what, predicate, timeout_s, poll_s=0.01):
    deadline = time.time() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.time() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(poll_s)


class Etcd:
    def __init__(self, directory, members=3):
        self.urls = [f"http://127.0.0.1:{free_port()}" for _ in range(members)]
        peers = [f"m{i}=http://127.0.0.1:{free_port()}" for i in range(members)]
        self.processes = []
        for i in range(members):
            peer = peers[i].split("=", 1)[1]
            log = open(os.path.join(directory, f"etcd{i}.log"), "w")
            self.processes.append(subprocess.Popen(
                ["etcd", f"--name=m{i}", f"--data-dir={directory}/etcd{i}",
                 f"--listen-client-urls={self.urls[i]}", f"--advertise-client-urls={self.urls[i]}",
                 f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
                 f"--initial-cluster={','.join(peers)}", "--initial-cluster-state=new"],
                stdout=log, stderr=subprocess.STDOUT))
        time.sleep(2)

    def endpoints(self):
        return ",".join(self.urls)

    def stop(self):
        for p in self.processes:
            p.kill()
            p.wait()


class Trial:
    def __init__(self, build, directory, etcd, trial, workers):
        self.build = build
        self.dir = os.path.join(directory, f"trial{trial}")
        os.makedirs(self.dir)
        self.ports = [free_port() for _ in range(3)]
        self.addresses = [f"127.0.0.1:{p}" for p in self.ports]
        self.coordinators = []
        for i, port in enumerate(self.ports):
            log = open(os.path.join(self.dir, f"coordinator{i}.log"), "w")
            self.coordinators.append(subprocess.Popen(
                [os.path.join(build, "coordinator/lockstep-coordinator"),
                 f"--listen=127.0.0.1:{port}", "--state_backend=etcd",
                 f"--etcd_endpoints={etcd.endpoints()}", f"--etcd_prefix=/bench-{trial}/"],
                stdout=log, stderr=subprocess.STDOUT))
            if i == 0:
                wait_until("the first coordinator to lead", lambda: self.answers(0), 20)
        self.workers = []
        for i in range(workers):
            log = open(os.path.join(self.dir, f"w{i}.log"), "w")
            self.workers.append(subprocess.Popen(
                [os.path.join(build, "worker/lockstep-worker"),
                 f"--coordinator={','.join(self.addresses)}", "--device=cpu", f"--name=w{i}",
                 f"--data_cache_dir={os.path.join(directory, 'cache')}"],
                stdout=log, stderr=subprocess.STDOUT))
        wait_until("the workers", lambda: self.registered(0) == workers, 30)

    def client(self, i):
        return lockstep.Client(self.addresses[i], timeout=1.0)

    def answers(self, i):
        try:
            with self.client(i) as c:
                c.workers()
            return True
        except lockstep.LockstepError:
            return False

    def registered(self, i):
        try:
            with self.client(i) as c:
                return sum(1 for w in c.workers() if w.state in ("idle", "busy"))
        except lockstep.LockstepError:
            return -1

    def stop(self):
        for p in self.workers + self.coordinators:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.workers + self.coordinators:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def spec(steps, workers):
    return {"name": "failover", "model": {"type": "mlp", "hiddenWidths": [64, 64]},
            "dataset": {"type": "synthetic",
                        "synthetic": {"trainSamples": 4096, "testSamples": 512, "inputDim": 32,
                                      "numClasses": 4, "seed": 1}},
            "optimizer": {"type": "sgd", "learningRate": 0.05, "momentum": 0.9},
            "globalBatchSize": 64, "maxSteps": steps, "minWorkers": workers,
            "maxWorkers": workers}


def run_trial(build, directory, etcd, trial, workers):
    t = Trial(build, directory, etcd, trial, workers)
    try:
        with t.client(0) as c:
            running = c.submit(spec(10_000_000, 2)).job_id
            wait_until("the job's first steps", lambda: c.get(running).step >= 20, 60)
            before = c.get(running)
        killed = time.time()
        t.coordinators[0].send_signal(signal.SIGKILL)
        t.coordinators[0].wait()
        # (a), and (c): the job is sent to the others until one takes it.
        leader = submitted = None
        while submitted is None:
            for i in (1, 2):
                try:
                    with t.client(i) as c:
                        submitted = c.submit(spec(10_000_000, 2)).job_id
                        leader = i
                        break
                except lockstep.LockstepError:
                    pass
            if submitted is None:
                time.sleep(0.01)
        times = {"leader_serving_s": time.time() - killed}
        with t.client(leader) as c:
            done = {}
            wanted = ("workers_s", "submitted_first_step_s", "running_trains_again_s")
            while not all(k in done for k in wanted):
                now = time.time()
                if "workers_s" not in done and t.registered(leader) == workers:
                    done["workers_s"] = now - killed
                if "submitted_first_step_s" not in done and c.get(submitted).step >= 1:
                    done["submitted_first_step_s"] = now - killed
                if "running_trains_again_s" not in done:
                    job = c.get(running)
                    if (job.state == job_pb2.JOB_STATE_RUNNING and
                            job.generation == before.generation and not job.recovery_history):
                        done["running_trains_again_s"] = now - killed
                        done["kept"] = True
                        done["steps_redone"] = 0
                        # What the group trained with no coordinator, as the new leader saw it
                        # when it kept the group (the old leader's last record before).
                        done["steps_trained_meanwhile"] = job.step - before.step
                    elif job.recovery_history and job.recovery_history[-1].first_step_unix_ms > 0:
                        done["running_trains_again_s"] = now - killed
                        done["kept"] = False
                        done["steps_redone"] = sum(r.steps_redone for r in job.recovery_history)
                if now - killed > 60:
                    raise RuntimeError(f"trial {trial}: not done within 60 s: {done}")
                time.sleep(0.01)
            times.update(done)
            for job in (running, submitted):
                c.cancel(job)
        return times
    finally:
        t.stop()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench/results/failover.json"))
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(args.build, "python"))
    global lockstep, job_pb2
    import lockstep  # noqa: E402 (from the build tree)
    from lockstep.v1 import job_pb2  # noqa: E402
    if shutil.which("etcd") is None:
        sys.exit("failover_bench: etcd is missing (scripts/install_deps.sh --test installs it)")
    directory = tempfile.mkdtemp(prefix="lockstep-failover-bench.")
    etcd = Etcd(directory)
    trials = []
    try:
        for trial in range(args.trials):
            trials.append(run_trial(args.build, directory, etcd, trial, args.workers))
            print(f"trial {trial}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else
                                                  f"{k} {v}" for k, v in trials[-1].items()),
                  file=sys.stderr)
    finally:
        etcd.stop()
        shutil.rmtree(directory, ignore_errors=True)
    rows = [("a standby leads and serves", "leader_serving_s"),
            ("every worker registered with it", "workers_s"),
            ("a job submitted at the kill: first step", "submitted_first_step_s"),
            ("the running job is the new leader's (kept, else re-formed)",
             "running_trains_again_s")]
    print(f"kill -9 of the leading coordinator (3 coordinators, 3 etcd members, {args.workers} "
          f"workers), {args.trials} trials; seconds from the kill")
    print("| until | median | max |")
    print("|---|---|---|")
    summary = {}
    for label, key in rows:
        values = [t[key] for t in trials]
        summary[key] = {"median": statistics.median(values), "max": max(values)}
        print(f"| {label} | {statistics.median(values):.2f} s | {max(values):.2f} s |")
    redone = [t["steps_redone"] for t in trials]
    kept = sum(1 for t in trials if t["kept"])
    meanwhile = [t["steps_trained_meanwhile"] for t in trials if t["kept"]]
    print(f"the running group kept as it was in {kept} of {len(trials)} trials "
          f"(steps it trained with no coordinator: {meanwhile}); steps redone: {sum(redone)} "
          f"in all ({redone})")
    with open(args.out, "w") as f:
        json.dump({"workers": args.workers, "trials": trials, "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
