#!/usr/bin/env bash
# Create .venv (if missing) and install featcal with the given extras, e.g. `scripts/install.sh dev`.
# torch is installed first and pinned to the CPU build that lies on this kind of machine; on your own
# GPU machine install the CUDA build of torch you want first: featcal only needs torch>=2.4.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
