#!/usr/bin/env bash
# Install featcal with its dev extras into .venv and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev
exec .venv/bin/python -m pytest -q "$@"
