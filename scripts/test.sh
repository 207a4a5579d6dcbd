#!/usr/bin/env bash
# Install featcal with its dev extras into .venv and run the whole test suite, in FEATCAL_TEST_WORKERS
# processes (default 2; pytest-xdist, each test file in one process, so its module fixtures are built once).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev
exec .venv/bin/python -m pytest -q -n "${FEATCAL_TEST_WORKERS:-2}" --dist loadfile "$@"
