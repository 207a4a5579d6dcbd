#!/usr/bin/env bash
# The GPU checks: the device-parametrised tests on CUDA, then the full TA8-shaped rehearsal on CUDA,
# with a short report (versions, time per stage, torch.cuda.max_memory_allocated, host peak RSS;
# the device tests compare weights and metrics with the CPU run's). Run it on a machine with a GPU and featcal installed (.venv or
# the current Python): bash scripts/gpu_check.sh [REPORT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
python=".venv/bin/python"
[ -x "$python" ] || python="python3"
report_dir="${1:-benchmarks/results/gpu_check}"
mkdir -p "$report_dir"
"$python" - <<'PY' | tee "$report_dir/environment.txt"
import torch, transformers
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, transformers {transformers.__version__}")
if not torch.cuda.is_available():
    raise SystemExit("gpu_check: torch sees no GPU; nothing to check")
print(f"GPU: {torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible)")
PY
# Every test that takes a device fixture runs once per device; select the CUDA ones.
"$python" -m pytest -q -p no:cacheprovider -k "cuda" tests/ 2>&1 | tee "$report_dir/pytest_cuda.txt"
if [ -f benchmarks/ta8_rehearsal.py ]; then
  # Per stage wall time and host peak RSS in the JSON; the run folder's timings.json adds
  # torch.cuda.max_memory_allocated under peak_memory. Weights against the CPU: tests/test_devices.py.
  "$python" benchmarks/ta8_rehearsal.py --device cuda --keep --workdir "$report_dir/work" \
    --output "$report_dir/ta8_rehearsal_cuda.json" 2>&1 | tee "$report_dir/ta8_rehearsal_cuda.txt"
  cp "$report_dir/work/run/timings.json" "$report_dir/timings_cuda.json"
fi
echo "gpu_check: report in $report_dir"
