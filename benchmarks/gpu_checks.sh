#!/usr/bin/env bash
# The CUDA measurements benchmarks/README.md lists as not run: one script for a machine with a GPU.
#
#   bash benchmarks/gpu_checks.sh OUT_DIR [TxN]         # TxN: tasks x images, default 8x256 (the TA8 shape)
#   FEATCAL_CHECK_DEVICE=cpu bash benchmarks/gpu_checks.sh /tmp/checks 1x4   # a check that it runs
#
# On random ViT-B/32-shaped models (nothing downloaded), into OUT_DIR:
#   calibration_speed_<TxN>_<device>.json   FeatCal's time and memory (the published run: 53 s at 8 x 256)
#   forward_precision_<device>.json         tf32 and bf16 calibrations against float32: weight differences
#   calibration_phases_<TxN>_<device>.json  each phase of a calibration against its floor
# PYTHON (default python) runs the scripts; the repository's featcal must be importable by it.
set -euo pipefail
out=${1:?usage: gpu_checks.sh OUT_DIR [TxN]}
point=${2:-8x256}
device=${FEATCAL_CHECK_DEVICE:-cuda}
python=${PYTHON:-python}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$(dirname "$0")"
export PYTHONPATH="$(cd .. && pwd)${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi || echo "no nvidia-smi"; } > "$out/device.txt" 2>&1
"$python" calibration_speed.py --points "$point" --device "$device" --workdir "$work/models" \
    --out "$out/calibration_speed_${point}_${device}.json"
"$python" forward_precision.py --no-mini8 --device "$device" --threads 2 --precisions float32 tf32 bf16 \
    --vit-b32 "$point" --workdir "$work/models" --out "$out/forward_precision_${device}.json"
"$python" calibration_phases.py --points "$point" --repeats 1 --device "$device" --workdir "$work/models" \
    --out "$out/calibration_phases_${point}_${device}.json"
