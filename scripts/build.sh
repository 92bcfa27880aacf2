#!/usr/bin/env bash
# Configures and builds Lockstep into build/ (Ninja, -j2, ccache). Usage: scripts/build.sh [TARGET...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${LOCKSTEP_BUILD_DIR:-$root/build}"
export CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=1 CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/lockstep-ccache}"
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
if [[ ! -f "$build/build.ninja" ]]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="${LOCKSTEP_BUILD_TYPE:-Release}" >/dev/null
fi
ninja -C "$build" -j "${LOCKSTEP_JOBS:-2}" "$@"
