#!/usr/bin/env bash
# Installs the Debian packages Lockstep builds, tests and demos with (fortunes is the GPT demo's
# text corpus, /usr/share/games/fortunes; npm fetches the dashboard's chart library at build
# time, and is only installed when no npm is on the PATH). Idempotent: it only calls apt-get
# when something is missing. Usage: scripts/install_deps.sh [--bench] [--test]
# --test adds what the tests need beyond the build: a Docker engine, docker-compose, debootstrap
# and iptables for the deploy tests, clang for the thread-safety check, a Prometheus server
# that scrapes a test cluster, what the Python client is installed and tested with (pytest),
# PyTorch (Debian's python3-torch, CPU, with Gloo) for the program jobs' tests,
# the browser the dashboard is tested in (chromium), and etcd (etcd-server: etcd and etcdctl)
# for the coordinators' etcd backend.
set -euo pipefail

pkgs=(
  build-essential cmake ninja-build ccache pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libgoogle-glog-dev libgflags-dev libabsl-dev libgtest-dev libgmock-dev
  libgloo-dev libsqlite3-dev libopenblas-dev zlib1g-dev libxxhash-dev
  prometheus-cpp-dev libcpp-httplib-dev
  dataset-fashion-mnist fortunes
)
for arg in "$@"; do
  case "$arg" in
    --bench) pkgs+=(python3-torch python3-xxhash libopenblas0-openmp) ;;
    --test) pkgs+=(docker.io docker-compose debootstrap iptables python3 systemd clang prometheus
                   python3-torch python3-xxhash libopenblas0-openmp
                   python3-grpcio python3-protobuf python3-venv python3-pip python3-pytest openssl
                   chromium etcd-server) ;;
    *) echo "install_deps.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done

# Node.js and npm may come from elsewhere (a newer Node.js): any npm on the PATH will do.
command -v npm >/dev/null 2>&1 || pkgs+=(npm)

missing=()
for p in "${pkgs[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]} == 0)); then
  exit 0
fi
echo "install_deps: installing ${missing[*]}" >&2
sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
# dataset-fashion-mnist is optional: the demo falls back to --synthetic when it is missing.
if ! $sudo apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=600 "${missing[@]}"; then
  rest=()
  for p in "${missing[@]}"; do [[ "$p" != dataset-fashion-mnist ]] && rest+=("$p"); done
  $sudo apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=600 "${rest[@]}"
  echo "install_deps: dataset-fashion-mnist could not be installed; use --synthetic" >&2
fi
