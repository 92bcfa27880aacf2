#!/usr/bin/env bash
# Installs what is missing, builds everything and runs every test (ctest). CI runs exactly this.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/install_deps.sh" --test
"$root/scripts/build.sh"
cd "${LOCKSTEP_BUILD_DIR:-$root/build}"
ctest --output-on-failure -j 1 "$@"
