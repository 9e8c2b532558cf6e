#!/usr/bin/env bash
# Run a command inside mindlab's virtualenv, creating it first if needed:
#   scripts/venv.sh python train.py ...
# The venv lives outside the clone (it is ~3.5 GB), keyed by a hash of the requirements files, so every
# clone and CI run with the same requirements reuses it. MINDLAB_VENV_HOME moves it.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
key=$(cat "$root/requirements.txt" "$root/requirements.lock" | sha256sum | cut -c1-16)
home=${MINDLAB_VENV_HOME:-$HOME/.cache/mindlab}
venv=$home/venv-$key
mkdir -p "$home"
(
  flock 9
  if [ ! -f "$venv/.complete" ]; then
    echo "[mindlab] creating $venv (one-time, ~2-3 min)" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q -r "$root/requirements.txt" -c "$root/requirements.lock" 2>&1 \
      | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
    touch "$venv/.complete"
  fi
  # the C++ kernels (kernels/*.cc), compiled once per source and CPU; without g++ the plain ops are used
  (cd "$root" && "$venv/bin/python" -m kernels)
) 9>"$home/.lock-$key"
export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv"
cd "$root"
exec "$@"
