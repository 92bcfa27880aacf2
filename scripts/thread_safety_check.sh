#!/usr/bin/env bash
# Checks the thread-safety annotations (ABSL_GUARDED_BY, ABSL_EXCLUSIVE_LOCKS_REQUIRED, ...) of
# the daemons' sources with clang's -Wthread-safety: every translation unit of worker/,
# coordinator/, common/ and cli/ is parsed (-fsyntax-only, no code generated) with the flags of
# the build's compile_commands.json. Usage: scripts/thread_safety_check.sh [BUILD_DIR]
# Exit 77 (a skip for ctest) when clang++ is not installed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-${LOCKSTEP_BUILD_DIR:-$root/build}}"
clang="$(command -v clang++ || command -v clang++-14 || true)"
if [[ -z "$clang" ]]; then
  echo "thread_safety_check: clang++ not found (Debian package clang); skipping" >&2
  exit 77
fi
python3 - "$root" "$build" "$clang" <<'PY'
import json, os, shlex, subprocess, sys
from concurrent.futures import ThreadPoolExecutor
root, build, clang = sys.argv[1:4]
with open(os.path.join(build, "compile_commands.json")) as f:
    commands = json.load(f)
units = []
for c in commands:
    path = os.path.realpath(c["file"])
    rel = os.path.relpath(path, root)
    if not rel.endswith(".cc") or rel.split("/")[0] not in ("worker", "coordinator", "common", "cli"):
        continue
    args = shlex.split(c["command"]) if "command" in c else c["arguments"]
    keep = []
    skip = False
    for i, a in enumerate(args[1:], 1):
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MT", "-MQ"):
            skip = True
            continue
        if a in ("-c", "-MD", "-MMD", "-Werror", "-Wall", "-Wextra") or a == c["file"]:
            continue
        keep.append(a)
    if os.path.basename(keep[0]) == "ccache":
        keep = keep[1:]
    units.append((rel, c["directory"], [clang] + [a for a in keep if not a.endswith(("c++", "g++"))]
                  + ["-fsyntax-only", "-Wthread-safety", "-Werror=thread-safety",
                     "-Wno-unknown-warning-option", path]))
if not units:
    sys.exit("thread_safety_check: no sources in " + build + "/compile_commands.json")
def check(unit):
    rel, cwd, cmd = unit
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    return rel, r.returncode, r.stderr
failed = 0
with ThreadPoolExecutor(max_workers=int(os.environ.get("LOCKSTEP_JOBS", "2"))) as pool:
    for rel, code, err in pool.map(check, sorted(units)):
        if code != 0:
            failed += 1
            print(f"== {rel}\n{err}", file=sys.stderr)
print(f"thread_safety_check: {len(units)} files, {failed} with errors")
sys.exit(1 if failed else 0)
PY
