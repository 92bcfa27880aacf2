#!/usr/bin/env bash
# Makes a relocatable bundle of Lockstep binaries for hosts without the build dependencies (a
# GPU host, a CUDA base image): OUT/libexec holds the binaries, OUT/lib every shared library
# they load except the C runtime and the GPU driver, and OUT/bin a launcher per binary that
# points the loader at OUT/lib. The target needs glibc at least as new as the build host's.
#   scripts/bundle.sh [--build DIR] OUT [BINARY...]   (default: all three daemons and the CLI)
# With LOCKSTEP_BUNDLE_SYSTEM_CUDA=1 the CUDA runtime, cuBLAS and NCCL are left out too (a GPU
# host has its own, and cuBLAS and NCCL alone are over 800 MB).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${LOCKSTEP_BUILD_DIR:-$root/build}"
if [[ "${1:-}" == "--build" ]]; then build="$2"; shift 2; fi
out="${1:?usage: bundle.sh [--build DIR] OUT [BINARY...]}"; shift
names=("$@")
((${#names[@]})) || names=(lockstep-coordinator lockstep-worker lockstepctl)

# Provided by the target system: glibc's libraries and the loader, and the NVIDIA driver's
# user-space libraries, which must match the host's kernel module.
system_lib='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libresolv|libutil|libcuda|libnvidia-)[.-]'
if [[ "${LOCKSTEP_BUNDLE_SYSTEM_CUDA:-0}" == 1 ]]; then
  system_lib='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libresolv|libutil|libcuda|libnvidia-|libcudart|libcublas|libcublasLt|libnccl)[.-]'
fi

mkdir -p "$out/bin" "$out/libexec" "$out/lib"
for name in "${names[@]}"; do
  binary="$(find "$build" -type f -name "$name" -perm -u+x | head -n1)"
  [[ -n "$binary" ]] || { echo "bundle.sh: $name not found under $build (build it first)" >&2; exit 1; }
  install -m 0755 "$binary" "$out/libexec/$name"
  missing="$(ldd "$binary" | awk '/not found/ {print $1}' | grep -Ev "$system_lib" || true)"
  [[ -z "$missing" ]] || { echo "bundle.sh: $name needs missing libraries: $missing" >&2; exit 1; }
  ldd "$binary" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r soname path; do
    [[ "$soname" =~ $system_lib ]] && continue
    [[ -e "$out/lib/$soname" ]] || cp -L "$path" "$out/lib/$soname"
  done
  cat >"$out/bin/$name" <<LAUNCHER
#!/bin/sh
# Runs the bundled $name with the bundle's libraries (LOCKSTEP_BUNDLE_LIB names them: a
# worker leaves them out of its programs' LD_LIBRARY_PATH).
here=\$(dirname "\$(readlink -f "\$0")")/..
LOCKSTEP_BUNDLE_LIB="\$here/lib" \\
LD_LIBRARY_PATH="\$here/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "\$here/libexec/$name" "\$@"
LAUNCHER
  chmod 0755 "$out/bin/$name"
done
# Debug symbols are most of the size; the bundle is for running, not debugging.
if command -v strip >/dev/null; then
  chmod u+w "$out"/lib/* && strip --strip-unneeded "$out"/libexec/* "$out"/lib/* 2>/dev/null || true
fi
echo "bundle.sh: $(ls "$out/libexec" | wc -l) binaries, $(ls "$out/lib" | wc -l) libraries, $(du -sh "$out" | cut -f1) in $out"
