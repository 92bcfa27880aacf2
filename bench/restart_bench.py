#!/usr/bin/env python3
"""Time for workers to register again after a coordinator restart.

For each outage length, the coordinator is killed (SIGKILL), kept down for the outage, and
started again on the same port with the same --state_dir; the time measured is from the new
coordinator serving (its --port_file appears) until every worker is registered with it again.
Workers reconnect on gRPC's own reconnection (at most 250 ms apart), without a backoff of
their own, so the time should not grow with the outage.

Prints a Markdown table and writes JSON (default bench/results/restart.json).
Usage: bench/restart_bench.py [--workers 4] [--trials 3] [--outages 0.1,2,10]
"""
import argparse
import json
import os
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


class Cluster:
    def __init__(self, build, workers):
        self.build = build
        self.dir = tempfile.mkdtemp(prefix="lockstep-restart-bench.")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.coordinator = None
        self.start_coordinator()
        self.workers = []
        for i in range(workers):
            log = open(os.path.join(self.dir, f"w{i}.log"), "w")
            self.workers.append(subprocess.Popen(
                [os.path.join(build, "worker/lockstep-worker"), f"--coordinator={self.address}",
                 "--device=cpu", f"--name=w{i}",
                 f"--data_cache_dir={os.path.join(self.dir, 'cache')}"],
                stdout=log, stderr=subprocess.STDOUT))
        self.wait_registered(workers, timeout_s=30)

    def start_coordinator(self):
        port_file = os.path.join(self.dir, "port")
        if os.path.exists(port_file):
            os.remove(port_file)
        log = open(os.path.join(self.dir, "coordinator.log"), "a")
        self.coordinator = subprocess.Popen(
            [os.path.join(self.build, "coordinator/lockstep-coordinator"),
             f"--listen={self.address}", f"--port_file={port_file}",
             f"--state_dir={os.path.join(self.dir, 'state')}"],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 20
        while not os.path.exists(port_file):
            if time.time() > deadline:
                raise RuntimeError("coordinator did not start")
            time.sleep(0.002)
        return time.time()

    def registered(self):
        out = subprocess.run([os.path.join(self.build, "cli/lockstepctl"),
                              f"--coordinator={self.address}", "workers", "--output=json"],
                             capture_output=True, text=True)
        if out.returncode != 0:
            return 0
        workers = json.loads(out.stdout).get("workers", [])
        return sum(1 for w in workers if w.get("state") in ("idle", "busy"))

    def wait_registered(self, n, timeout_s):
        deadline = time.time() + timeout_s
        while self.registered() < n:
            if time.time() > deadline:
                raise RuntimeError(f"fewer than {n} workers registered within {timeout_s}s")
            time.sleep(0.01)
        return time.time()

    def stop(self):
        for p in self.workers + [self.coordinator]:
            p.send_signal(signal.SIGKILL)
            p.wait()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--outages", default="0.1,2,10")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench/results/restart.json"))
    args = parser.parse_args()
    outages = [float(x) for x in args.outages.split(",")]
    cluster = Cluster(args.build, args.workers)
    results = []
    try:
        for outage in outages:
            times = []
            for _ in range(args.trials):
                cluster.coordinator.send_signal(signal.SIGKILL)
                cluster.coordinator.wait()
                time.sleep(outage)
                serving = cluster.start_coordinator()
                back = cluster.wait_registered(args.workers, timeout_s=60)
                times.append(back - serving)
            results.append({"outage_s": outage, "trials": times,
                            "median_s": statistics.median(times), "max_s": max(times)})
    finally:
        cluster.stop()
    print(f"{args.workers} workers; time from the restarted coordinator serving to every worker "
          "registered again (lockstepctl polled every 10 ms)\n")
    print("| outage | median | max | trials |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['outage_s']:g} s | {r['median_s']:.2f} s | {r['max_s']:.2f} s | "
              + ", ".join(f"{t:.2f}" for t in r["trials"]) + " |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"workers": args.workers, "results": results}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
