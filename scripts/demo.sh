#!/usr/bin/env bash
# Install featcal into .venv and run the offline mini8 benchmark: merge → FeatCal → evaluate → export.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh plot
exec .venv/bin/featcal demo "$@"
