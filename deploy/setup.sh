#!/usr/bin/env bash
# Set up sensai on a fresh Debian/Ubuntu machine (as root or with sudo), idempotently:
#   - the Fashion-MNIST IDX files (Debian package dataset-fashion-mnist), unless already present;
#   - python3-venv if the interpreter cannot make a virtual environment;
#   - .venv/ in the project root with sensai installed (editable) and its test tools;
#   - beside it, tritonserver (the Triton backend) and perf_analyzer (Triton's benchmarking client).
# A second run with nothing changed takes a second or two.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
fmnist_dir="${SENSAI_FMNIST_DIR:-/usr/share/datasets/fashion-mnist}"

say() { printf '[setup] %s\n' "$*" >&2; }
as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@";
  elif command -v sudo >/dev/null 2>&1; then sudo "$@";
  else say "need root (or sudo) to run: $*"; exit 1; fi
}
apt_updated=0
apt_install() {
  if [ "$apt_updated" -eq 0 ]; then
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    apt_updated=1
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

if ! ls "$fmnist_dir"/train-images-idx3-ubyte* >/dev/null 2>&1; then
  say "installing Fashion-MNIST (apt package dataset-fashion-mnist)"
  apt_install dataset-fashion-mnist
fi

if ! command -v "$python" >/dev/null 2>&1; then
  say "installing python3"
  apt_install python3 python3-venv
fi
if [ ! -x .venv/bin/python ]; then
  if ! "$python" -m venv --help >/dev/null 2>&1 || ! "$python" -c 'import ensurepip' >/dev/null 2>&1; then
    say "installing python3-venv"
    apt_install python3-venv
  fi
  say "creating .venv"
  "$python" -m venv .venv
fi

# Reinstall only when the package definition changed since the last successful install.
stamp=.venv/.sensai-installed
want="$(cat pyproject.toml deploy/constraints.txt | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  say "installing sensai and its dependencies into .venv (first time: several minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -c deploy/constraints.txt -e '.[test]'
  echo "$want" > "$stamp"
fi
# A tritonserver binary for the Triton backend and its tests: the nvidia-pytriton wheel carries one,
# but pins numpy<2, so it is unpacked beside the environment rather than installed into it.
if [ ! -x .venv/triton/pytriton/tritonserver/bin/tritonserver ]; then
  say "unpacking tritonserver (nvidia-pytriton wheel, ~150 MB) into .venv/triton"
  if ! .venv/bin/python -m pip install -q --no-deps --target .venv/triton 'nvidia-pytriton==0.7.0'; then
    say "warning: could not get nvidia-pytriton; the Triton backend needs a tritonserver of your own"
  fi
fi
# perf_analyzer, Triton's benchmarking client, for `sensai perf-data` users and bench-load's
# --perf-analyzer: PyPI's perf-analyzer wheel, unpacked beside the environment (a tool, not a
# dependency) with a wrapper at .venv/bin/perf_analyzer.  Its binary needs glibc 2.38; where the
# machine's is older (Debian 12), it runs against Debian 13's libc and libstdc++, unpacked into a
# private folder from the machine's own apt mirror (no root needed, nothing installed system-wide).
install_perf_analyzer() {
  local d=.venv/perf_analyzer w=.venv/bin/perf_analyzer bin
  rm -rf "$d" && mkdir -p "$d/dl" "$d/whl" "$d/apt/lists/partial" "$d/apt/cache/archives/partial" \
    "$d/debs" "$d/sysroot" || return 1
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: \
    --platform manylinux_2_38_x86_64 -d "$d/dl" 'perf-analyzer>=2.50' 2>/dev/null || return 1
  .venv/bin/python -m zipfile -e "$d"/dl/perf_analyzer-*.whl "$d/whl" || return 1
  bin="$root/$d/whl/perf_analyzer/bin/perf_analyzer"
  chmod +x "$bin"
  if "$bin" --version >/dev/null 2>&1; then
    printf '#!/bin/sh\nexec "%s" "$@"\n' "$bin" > "$w"
  else
    local src=/etc/apt/sources.list.d/debian.sources uri opts
    uri=$(awk '/^URIs:/{print $2; exit}' "$src" 2>/dev/null) || return 1
    [ -n "$uri" ] || return 1
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $uri trixie main" \
      > "$d/apt/sources.list"
    opts=(-o Dir::Etc::sourcelist="$root/$d/apt/sources.list" -o Dir::Etc::sourceparts=-
          -o Dir::State::Lists="$root/$d/apt/lists" -o Dir::Cache="$root/$d/apt/cache"
          -o Debug::NoLocking=1 -o Acquire::Retries=1 -o Acquire::http::Timeout=30)
    apt-get "${opts[@]}" update -qq >/dev/null 2>&1 || return 1
    (cd "$d/debs" && apt-get "${opts[@]}" download -qq libc6 libstdc++6 libgcc-s1 \
      >/dev/null 2>&1) || return 1
    for f in "$d"/debs/*.deb; do dpkg-deb -x "$f" "$d/sysroot" || return 1; done
    local lib="$root/$d/sysroot/usr/lib/x86_64-linux-gnu"
    local path="$lib:/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu"
    printf '#!/bin/sh\nexec "%s/ld-linux-x86-64.so.2" --library-path "%s" "%s" "$@"\n' \
      "$lib" "$path" "$bin" > "$w"
  fi
  chmod +x "$w" && "$w" --version >/dev/null 2>&1 && rm -rf "$d/dl" "$d/apt" "$d/debs"
}
if ! .venv/bin/perf_analyzer --version >/dev/null 2>&1; then
  say "unpacking perf_analyzer (PyPI perf-analyzer wheel) into .venv/perf_analyzer"
  if ! install_perf_analyzer; then
    rm -rf .venv/bin/perf_analyzer .venv/perf_analyzer
    say "warning: could not get perf_analyzer; sensai runs without it" \
        "(only bench-load --perf-analyzer and its tests use it)"
  fi
fi
say "ready: $root/.venv/bin/sensai"
