#!/usr/bin/env bash
# Installs what is missing, builds everything and runs every test (ctest). CI runs exactly this.
#   scripts/test.sh [CTEST_ARGS...]
#   scripts/test.sh --stress [CTEST_ARGS...]   the integration suites (ctest -L integration -j2)
#       while two CPU-bound processes run beside them, as on a busy 2-core machine: recovery
#       tests must hold their jobs with hooks, not race them, and must not mistake a slow
#       machine for a dead worker. Run it before resolving anything that touches recovery.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
stress=0
if [[ "${1:-}" == "--stress" ]]; then
  stress=1
  shift
fi
"$root/scripts/install_deps.sh" --test
"$root/scripts/build.sh"
cd "${LOCKSTEP_BUILD_DIR:-$root/build}"
if ((stress == 0)); then
  exec ctest --output-on-failure -j 1 "$@"
fi

load_pids=()
stop_load() { ((${#load_pids[@]})) && kill "${load_pids[@]}" 2>/dev/null; wait 2>/dev/null || true; }
trap stop_load EXIT
for _ in 1 2; do
  # A busy loop at the tests' own priority: each takes a core whenever the scheduler lets it.
  bash -c 'while :; do :; done' &
  load_pids+=($!)
done
echo "test.sh --stress: 2 CPU-bound processes (${load_pids[*]}) beside ctest -L integration -j2" >&2
ctest --output-on-failure -L integration -j 2 "$@"
