#!/usr/bin/env bash
# Usage: run_torchrun.sh NPROC [train_mlp.py args...]
#
# Launches bench/torch/train_mlp.py (or the script $TORCH_SCRIPT names, e.g. train_gpt.py)
# under Debian's torchrun (python3-torch 1.13)
# on this host: --standalone, 1 node, NPROC CPU workers, OMP_NUM_THREADS=1.
#
# Extra torchrun options (underscore spelling only, e.g.
# "--max_restarts=3 --monitor_interval=0.1") go in $TORCHRUN_EXTRA.
#
# --redirects=9:1 --tee=9:1: Debian's torchrun crashes on Python 3.11 without
# them (docs/platform_notes.md). They only name local rank 9, so local ranks 0-8 write
# straight to the inherited stdout/stderr with no prefix and no log file; a
# tee'd rank (9) would be echoed as "[default9]:line". The sed below strips
# such "[<role><n>]:" prefixes anyway, so every stdout line is parser-clean.
# torchrun's own log messages go to stderr, untouched.
#
# Prints "LAUNCH_UNIX_MS <ms>" first (before the interpreter starts), so
# launch-to-first-step = FIRST_STEP_UNIX_MS - LAUNCH_UNIX_MS.
# Exit status is torchrun's.
#
# torchrun's per-attempt log dir (error files; stdout.log only for tee'd ranks)
# goes to a fresh mktemp dir that is removed on exit; set TORCHRUN_KEEP_LOGS=1
# to keep it (its path is printed to stderr), or pass --log_dir in
# TORCHRUN_EXTRA (it comes later on the command line, so it wins).
set -euo pipefail

if [[ $# -lt 1 || ! "$1" =~ ^[0-9]+$ || "$1" -lt 1 ]]; then
    echo "usage: $0 NPROC [train_mlp.py args...]" >&2
    exit 2
fi
NPROC=$1
shift

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export OMP_NUM_THREADS=1
export PYTHONUNBUFFERED=1

# shellcheck disable=SC2206  # word-splitting of TORCHRUN_EXTRA is intended
EXTRA=(${TORCHRUN_EXTRA:-})

LOG_DIR=$(mktemp -d /tmp/lockstep_torchrun.XXXXXX)
if [[ "${TORCHRUN_KEEP_LOGS:-0}" == 1 ]]; then
    echo "torchrun log dir: $LOG_DIR" >&2
else
    trap 'rm -rf "$LOG_DIR"' EXIT
fi

echo "LAUNCH_UNIX_MS $(date +%s%3N)"
set +e
/usr/bin/python3 -m torch.distributed.run \
    --standalone --nnodes=1 --nproc_per_node="$NPROC" \
    --redirects=9:1 --tee=9:1 --log_dir="$LOG_DIR" \
    "${EXTRA[@]}" \
    "$HERE/${TORCH_SCRIPT:-train_mlp.py}" "$@" \
    | sed -u -E 's/^\[[A-Za-z_]*[0-9]+\]:[[:space:]]?//'
rc=${PIPESTATUS[0]}
exit "$rc"
