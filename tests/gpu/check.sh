#!/usr/bin/env bash
# The GPU checks, as one script for a machine with a CUDA GPU and torch installed (no network):
#   OUT=some/dir bash tests/gpu/check.sh
# Runs the CUDA tests, the peak probe, the demo (one process per GPU, NCCL), and the CPU suite's
# unit tests with the GPU visible (they must not depend on there being none). Logs go to $OUT.
# The step timeouts add up to 9 minutes, under the device tool's 10-minute limit per command.
set -u
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{
  nvidia-smi -L
  $PY -c "import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, transformers.__version__, torch.cuda.get_device_name(), torch.cuda.device_count())"
  $PY -c "import os, torch._dynamo.config as c; print('compile switched off:', c.disable, {k: v for k, v in os.environ.items() if 'TORCH' in k or 'DYNAMO' in k or 'INDUCTOR' in k})"
} 2>&1 | tee "$OUT/versions.log"
timeout 300 $PY -m pytest -q -p no:cacheprovider -s -rA --durations=0 tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | grep -v "^\[trainmesh\]" | tail -40
timeout 40 $PY -m trainmesh env --peak bf16 --peak-seconds 2 2>&1 | tee "$OUT/peak.log"
DEMO_DIR=$(mktemp -d)
timeout 120 $PY -m trainmesh demo --out "$DEMO_DIR" 2>&1 | tee "$OUT/demo.log" | tail -25
timeout 80 $PY -m pytest -q -p no:cacheprovider tests/unit/test_devices.py tests/unit/test_mesh_layout.py tests/unit/test_throughput.py tests/unit/test_distribution_frontend.py 2>&1 | tee "$OUT/unit_with_gpu.log" | tail -15
rm -rf "$DEMO_DIR"
