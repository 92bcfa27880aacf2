#!/usr/bin/env python3
"""Fails when an include climbs a layer: every #include "DIR/..." of the project's own code
must name a directory that the including file's layer may use (docs/architecture.md, "Layers").

  scripts/check_layers.py [ROOT]    exit 0: clean; 1: prints each climbing include
  scripts/check_layers.py --self-test   the check finds a climbing include in a scratch tree
"""
import os
import re
import sys

# Each layer and the layers below it that it may include (besides itself). Generated protos
# (lockstep/v1/...) and third-party headers are open to all; tests/ and bench/ may use anything.
LAYERS = {
    "common": [],
    "kernels": ["common"],
    "worker/comm": ["common"],
    "worker/data": ["common", "kernels"],
    "worker/model": ["common", "kernels"],
    "worker/step": ["worker/model", "worker/comm", "common", "kernels"],
    "worker/cuda": ["worker/step", "worker/model", "worker/comm", "common", "kernels"],
    "worker/train": ["worker/step", "worker/model", "worker/data", "worker/comm", "common",
                     "kernels"],
    "worker/device": ["worker/train", "worker/cuda", "worker/step", "worker/model", "worker/data",
                      "worker/comm", "common", "kernels"],
    "worker/program": ["common"],
    # worker/*.cc,h: the generation, the lifecycle, the agent's session, main.
    "worker": ["worker/program", "worker/device", "worker/train", "worker/cuda", "worker/step", "worker/model",
               "worker/data", "worker/comm", "common", "kernels"],
    "coordinator/store": ["common"],
    "coordinator/core": ["common"],
    "coordinator/service": ["coordinator/core", "coordinator/store", "common"],
    "coordinator/dashboard": ["coordinator/service", "coordinator/core", "coordinator/store",
                              "common"],
    # coordinator/main.cc
    "coordinator": ["coordinator/dashboard", "coordinator/service", "coordinator/core",
                    "coordinator/store", "common"],
    "cli": ["common"],
}
UNCHECKED = ("tests/", "bench/", "build")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def layer_of(path):
    """The longest layer that is a directory prefix of `path` (None: not the project's)."""
    best = None
    for layer in LAYERS:
        if path.startswith(layer + "/") and (best is None or len(layer) > len(best)):
            best = layer
    return best


def self_test():
    import tempfile
    with tempfile.TemporaryDirectory() as root:
        def put(path, text):
            os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
            with open(os.path.join(root, path), "w") as f:
                f.write(text)
        put("worker/model/mlp.h", '#include "common/hash.h"\n#include "lockstep/v1/job.pb.h"\n')
        put("tests/unit/x_test.cc", '#include "worker/agent.h"\n')
        if check(root) != []:
            print("self-test: a clean tree was refused")
            return 1
        put("worker/model/gpt.h", '#include "worker/train/trainer.h"\n')
        found = check(root)
        if len(found) != 1 or "worker/model/gpt.h:1" not in found[0]:
            print(f"self-test: expected one climbing include, found {found}")
            return 1
    print("check_layers self-test: passed")
    return 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(__file__), ".."))
    problems = check(root)
    for p in problems:
        print(p)
    if problems:
        print(f"check_layers: {len(problems)} climbing include(s); the layers are in "
              "scripts/check_layers.py and docs/architecture.md")
        return 1
    print("check_layers: no include climbs a layer")
    return 0


def check(root):
    """Every climbing include under `root`, as "FILE:LINE: ..." lines."""
    problems = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "build", "node_modules"))]
        for name in filenames:
            if not name.endswith((".cc", ".h", ".cu", ".cuh")):
                continue
            rel = os.path.normpath(os.path.join(rel_dir, name))
            if rel.startswith(UNCHECKED):
                continue
            mine = layer_of(rel)
            if mine is None:
                continue
            allowed = set(LAYERS[mine]) | {mine}
            with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
                for number, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if not m:
                        continue
                    theirs = layer_of(m.group(1))
                    if theirs is not None and theirs not in allowed:
                        problems.append(f"{rel}:{number}: includes {m.group(1)} ({theirs}), "
                                        f"which layer {mine} may not use")
    return problems


if __name__ == "__main__":
    sys.exit(main())
