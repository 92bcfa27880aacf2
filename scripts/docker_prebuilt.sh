#!/usr/bin/env bash
# Stages binaries built on this host for the images' prebuilt path (deploy/docker/Dockerfile
# with BINARIES=prebuilt, docs/deploy.md), so that an image build copies them instead of
# compiling the daemons again inside Docker:
#   deploy/docker/prebuilt/bin/         lockstep-coordinator, lockstep-worker, lockstepctl from a
#                                       CPU-only build (the coordinator and worker images)
#   deploy/docker/prebuilt/python/      liblockstep_checkpoint.so (the worker-torch image)
#   deploy/docker/prebuilt/bundle-cuda/ scripts/bundle.sh of the main build's worker, when that
#                                       worker has CUDA (the worker-cuda image)
# The images run these binaries on Debian 12 with Debian's libraries, so build on Debian 12.
# Usage: scripts/docker_prebuilt.sh [--build DIR]   (DIR: the main build, default build/)
# The CPU build goes to ${LOCKSTEP_DOCKER_BUILD_DIR:-build-docker} through scripts/build.sh:
# same compiler cache settings, so it reuses what the main build compiled.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
main_build="$root/build"
if [[ "${1:-}" == "--build" ]]; then main_build="${2:?usage: docker_prebuilt.sh [--build DIR]}"; shift 2; fi
(($# == 0)) || { echo "usage: docker_prebuilt.sh [--build DIR]" >&2; exit 2; }
[[ -d "$main_build" ]] || { echo "docker_prebuilt.sh: no build at $main_build (--build DIR)" >&2; exit 1; }
main_build="$(realpath "$main_build")"
cpu_build="${LOCKSTEP_DOCKER_BUILD_DIR:-$root/build-docker}"
stage="$root/deploy/docker/prebuilt"
daemons=(lockstep-coordinator lockstep-worker lockstepctl)

cmake_args=(-DLOCKSTEP_CUDA=OFF -DLOCKSTEP_BUILD_TESTS=OFF -DLOCKSTEP_BUILD_BENCH=OFF)
# The main build's npm ci already fetched the dashboard's chart library: no second download.
node_modules="$main_build/coordinator/dashboard_npm/node_modules"
if [[ -d "$node_modules" ]]; then
  cmake_args+=(-DLOCKSTEP_NODE_MODULES="$node_modules")
else
  cmake_args+=(-DLOCKSTEP_NODE_MODULES=)
fi
LOCKSTEP_BUILD_DIR="$cpu_build" "$root/scripts/build.sh" "${cmake_args[@]}" "${daemons[@]}" \
  lockstep_checkpoint_native

rm -rf "${stage:?}/bin" "${stage:?}/python" "${stage:?}/bundle-cuda"
install -D -m 0755 -t "$stage/bin" "$cpu_build/coordinator/lockstep-coordinator" \
  "$cpu_build/worker/lockstep-worker" "$cpu_build/cli/lockstepctl"
# lockstep.torch.Checkpointer's native copy, for the worker-torch image's Python package.
install -D -m 0755 -t "$stage/python" "$cpu_build/python/lockstep/liblockstep_checkpoint.so"
strip "$stage"/bin/* "$stage"/python/*
echo "docker_prebuilt.sh: CPU binaries in $stage/bin ($(du -sh "$stage/bin" | cut -f1))"

worker="$main_build/worker/lockstep-worker"
libs=""
if [[ -x "$worker" ]]; then libs="$(ldd "$worker" || true)"; fi
if [[ "$libs" == *libcudart* ]]; then
  LOCKSTEP_BUNDLE_SYSTEM_CUDA=1 "$root/scripts/bundle.sh" --build "$main_build" \
    "$stage/bundle-cuda" lockstep-worker lockstepctl
else
  echo "docker_prebuilt.sh: $worker is not a CUDA build: nothing staged for worker-cuda"
fi
