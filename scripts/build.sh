#!/usr/bin/env bash
# Configures and builds Lockstep into build/ (Ninja, -j2, ccache).
# Usage: scripts/build.sh [-DVAR=VALUE...] [TARGET...]
# -D arguments go to cmake, and are applied to an existing build tree too.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${LOCKSTEP_BUILD_DIR:-$root/build}"
export CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=1 CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/lockstep-ccache}"
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
cmake_args=() targets=()
for arg in "$@"; do
  if [[ "$arg" == -D* ]]; then cmake_args+=("$arg"); else targets+=("$arg"); fi
done
if [[ ! -f "$build/build.ninja" ]]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="${LOCKSTEP_BUILD_TYPE:-Release}" \
    "${cmake_args[@]}" >/dev/null
elif ((${#cmake_args[@]})); then
  cmake -S "$root" -B "$build" "${cmake_args[@]}" >/dev/null
fi
ninja -C "$build" -j "${LOCKSTEP_JOBS:-2}" "${targets[@]}"
