#!/usr/bin/env bash
# Set up sensai on a fresh Debian/Ubuntu machine (as root or with sudo), idempotently:
#   - the Fashion-MNIST IDX files (Debian package dataset-fashion-mnist), unless already present;
#   - python3-venv if the interpreter cannot make a virtual environment;
#   - .venv/ in the project root with sensai installed (editable) and its test tools.
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
say "ready: $root/.venv/bin/sensai"
