#!/usr/bin/env bash
# The main job: installs what is missing, builds, starts a local cluster (one coordinator, two
# CPU workers), trains an MLP on Fashion-MNIST with live progress, prints the test accuracy, and
# stops the cluster. With --gpt it trains a byte-level GPT on Debian's fortunes instead and prints
# the validation loss and a sample of its text. Usage: scripts/demo.sh [--gpt|--synthetic]
# [--workers N]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
synthetic=0
gpt=0
workers=2
while (($#)); do
  case "$1" in
    --synthetic) synthetic=1 ;;
    --gpt) gpt=1 ;;
    --workers) workers="$2"; shift ;;
    --workers=*) workers="${1#*=}" ;;
    -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
    *) echo "demo.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done

"$root/scripts/install_deps.sh"
echo "== building"
"$root/scripts/build.sh" lockstep-coordinator lockstep-worker lockstepctl
bin="${LOCKSTEP_BUILD_DIR:-$root/build}"

spec="$root/docs/examples/fashion_mnist.json"
if ((gpt)); then
  spec="$root/docs/examples/gpt_fortunes.json"
  if [[ ! -d /usr/share/games/fortunes ]]; then
    echo "demo.sh: the fortunes corpus (Debian package fortunes) is not installed" >&2
    exit 1
  fi
elif ((synthetic)); then
  spec="$root/docs/examples/synthetic.json"
elif [[ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]]; then
  echo "demo.sh: Fashion-MNIST is not installed (Debian package dataset-fashion-mnist) and" >&2
  echo "         could not be installed here. Run: scripts/demo.sh --synthetic" >&2
  exit 1
fi

dir="$(mktemp -d /tmp/lockstep-demo.XXXXXX)"
cleanup() { "$root/deploy/local/cluster.sh" stop --dir "$dir" >/dev/null 2>&1 || true; }
trap cleanup EXIT
"$root/deploy/local/cluster.sh" start --dir "$dir" --workers "$workers" --bin "$bin" \
  --http_listen 127.0.0.1:0
coordinator="$(cat "$dir/address")"
echo "== training $(basename "$spec") on $workers workers (coordinator $coordinator, logs in $dir)"
job_spec="$dir/job.json"
sed "s/\"maxWorkers\": [0-9]*/\"maxWorkers\": $workers/; s/\"minWorkers\": [0-9]*/\"minWorkers\": $workers/" \
  "$spec" > "$job_spec"
"$bin/cli/lockstepctl" --coordinator="$coordinator" submit "$job_spec" --watch
