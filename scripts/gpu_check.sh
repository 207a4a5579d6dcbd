#!/usr/bin/env bash
# The GPU checks, one script for a machine with a GPU and featcal installed (.venv or the current Python):
#
#   bash scripts/gpu_check.sh [REPORT_DIR] [PARTS] [TxN]
#
# REPORT_DIR (default benchmarks/results/gpu_check) receives a report of each part; PARTS is a comma list
# of (default: all of them, in this order):
#   tests         the device-parametrised tests on CUDA (pytest -k cuda): weights and metrics against the CPU's
#   rehearsal     the full TA8-shaped run on CUDA (benchmarks/ta8_rehearsal.py): time per stage, peak memory
#   measurements  on random ViT-B/32-shaped models at TxN tasks x images (default 8x256, the TA8 shape):
#                 calibration_speed_<TxN>_<device>.json (the published run: 53 s at 8 x 256),
#                 forward_precision_<device>.json (tf32 and bf16 calibrations against float32: weight
#                 differences), calibration_phases_<TxN>_<device>.json (each phase against its floor),
#                 lm_calibration_speed_<device>.json (a full-width Llama-3.2-3B stack of 2 layers, 2 x 16
#                 sequences of 512 tokens: time and peak memory against the floor of its work; FEATCAL_CHECK_LM
#                 = TxN sets tasks x sequences, e.g. 5x256 for MergeBench's count at 512 tokens), and
#                 lm_calibration_speed_<device>_host.json (the same, the feature streams in host memory)
#   mergebench    (named alone, not part of the default list: it needs the Hub's models and datasets, and hours)
#                 featcal run --suite mergebench --eval-protocol mergebench --allow-code-execution --eval-zero-shot
#                 --eval-experts on FEATCAL_CHECK_BACKBONE (default llama-3.2-3b): MergeBench's five domains on every
#                 stage (docs/causal-lm.md); FEATCAL_CHECK_BENCHMARK_DATA=DIR reads local copies of the benchmarks,
#                 FEATCAL_CHECK_MERGEBENCH_SAMPLES=N evaluates N examples per task; safety is MergeBench's judged
#                 protocol, the default (WildGuard, about 20 GB of GPU memory; the gated allenai/wildguardmix's terms
#                 accepted beforehand, else the run is refused before any work), and
#                 FEATCAL_CHECK_MERGEBENCH_SAFETY=fusionbench scores FusionBench's lm-eval variant instead (not the
#                 paper's); the stages' metrics.json, the card and timings.json go to the report; ifeval needs
#                 nltk's punkt_tab installed beforehand
#                 (`python -m nltk.downloader punkt_tab`, or NLTK_DATA=DIR), which the run checks before any work
# FEATCAL_CHECK_DEVICE=cpu runs the measurements on the CPU (a check that they run: use a small TxN, 1x4,
# and FEATCAL_CHECK_LM=1x2).
set -euo pipefail
cd "$(dirname "$0")/.."
python=".venv/bin/python"
[ -x "$python" ] || python="python3"
report_dir="${1:-benchmarks/results/gpu_check}"
parts="${2:-tests,rehearsal,measurements}"
point="${3:-8x256}"
device="${FEATCAL_CHECK_DEVICE:-cuda}"
mkdir -p "$report_dir"
report_dir=$(cd "$report_dir" && pwd)
wants() { [[ ",$parts," == *",$1,"* ]]; }

"$python" - "$device" <<'PY' | tee "$report_dir/environment.txt"
import sys, torch, transformers
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, transformers {transformers.__version__}")
if sys.argv[1] == "cuda":
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: torch sees no GPU; nothing to check (FEATCAL_CHECK_DEVICE=cpu measures on the CPU)")
    print(f"GPU: {torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible)")
PY
{ nvidia-smi || echo "no nvidia-smi"; } > "$report_dir/device.txt" 2>&1

if wants tests; then
  # Every test that takes a device fixture runs once per device; select the CUDA ones.
  "$python" -m pytest -q -p no:cacheprovider -k "cuda" tests/ 2>&1 | tee "$report_dir/pytest_cuda.txt"
fi
if wants rehearsal; then
  # Per stage wall time and host peak RSS in the JSON; the run folder's timings.json adds
  # torch.cuda.max_memory_allocated under peak_memory. Weights against the CPU: tests/test_devices.py.
  "$python" benchmarks/ta8_rehearsal.py --device "$device" --keep --workdir "$report_dir/work" \
    --output "$report_dir/ta8_rehearsal_$device.json" 2>&1 | tee "$report_dir/ta8_rehearsal_$device.txt"
  cp "$report_dir/work/run/timings.json" "$report_dir/timings_$device.json"
fi
if wants measurements; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  "$python" benchmarks/calibration_speed.py --points "$point" --device "$device" --workdir "$work/models" \
    --out "$report_dir/calibration_speed_${point}_${device}.json"
  "$python" benchmarks/forward_precision.py --no-mini8 --device "$device" --threads 2 \
    --precisions float32 tf32 bf16 --vit-b32 "$point" --workdir "$work/models" \
    --out "$report_dir/forward_precision_${device}.json"
  "$python" benchmarks/calibration_phases.py --points "$point" --repeats 1 --device "$device" \
    --workdir "$work/models" --out "$report_dir/calibration_phases_${point}_${device}.json"
  lm_point="${FEATCAL_CHECK_LM:-2x16}"
  "$python" benchmarks/lm_calibration_speed.py --device "$device" --tasks "${lm_point%x*}" \
    --examples "${lm_point#*x}" --workdir "$work/lm" --out "$report_dir/lm_calibration_speed_${device}.json"
  # the same with the feature streams in host memory: what the copies to and from the device cost
  "$python" benchmarks/lm_calibration_speed.py --device "$device" --tasks "${lm_point%x*}" --stream-storage host \
    --examples "${lm_point#*x}" --workdir "$work/lm" --out "$report_dir/lm_calibration_speed_${device}_host.json"
fi
if wants mergebench; then
  backbone="${FEATCAL_CHECK_BACKBONE:-llama-3.2-3b}"
  run_dir="$report_dir/mergebench_$backbone"
  extra=()
  [ -n "${FEATCAL_CHECK_BENCHMARK_DATA:-}" ] && extra+=(--benchmark-data "$FEATCAL_CHECK_BENCHMARK_DATA")
  [ -n "${FEATCAL_CHECK_MERGEBENCH_SAMPLES:-}" ] && extra+=(--max-eval-samples "$FEATCAL_CHECK_MERGEBENCH_SAMPLES")
  [ -n "${FEATCAL_CHECK_MERGEBENCH_SAFETY:-}" ] && extra+=(--mergebench-safety "$FEATCAL_CHECK_MERGEBENCH_SAFETY")
  "$python" -m featcal run --suite mergebench --backbone "$backbone" --device "$device" --eval-zero-shot \
    --eval-experts --eval-protocol mergebench --allow-code-execution ${extra[@]+"${extra[@]}"} \
    --output-dir "$run_dir/run" 2>&1 | tee "$report_dir/mergebench_${backbone}.txt"
  for stage in zero-shot experts ta featcal-ta; do
    if [ -f "$run_dir/run/$stage/metrics.json" ]; then
      cp "$run_dir/run/$stage/metrics.json" "$run_dir/metrics_$stage.json"
    fi
  done
  cp "$run_dir/run/timings.json" "$run_dir/timings.json"
  cp "$run_dir/run/release/README.md" "$run_dir/card.md"
fi
echo "gpu_check: report in $report_dir"
