#!/usr/bin/env bash
# The GPU check (docs/gpu.md, issue 32), one call on the GPU machine, from the repo root:
#   here, once:   scripts/fetch_gpu_wheels.sh
#   GPU machine:  run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=600)
# Installs pagedllm there offline (the carried wheels, --no-deps; no CPU extension is
# compiled: PAGEDLLM_CPU_KERNELS=0), runs the Triton kernel tests compiled on CUDA, then
# scripts/gpu_check.py (big pool, greedy vs HF, host syncs, CUDA graphs, W1 offline and
# served vs HF static batching). Everything lands in $OUT for docs/gpu.md.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
export PAGEDLLM_CPU_KERNELS=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - start )) s)" | tee -a "$OUT/summary.txt"; }

stamp "install"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --target /tmp/site . \
    >> "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
export PYTHONPATH=/tmp/site
(cd /tmp && python3 -c "import pagedllm.kernels.triton.attention as a, torch, triton; \
print('installed', a.__file__, 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())") \
    | tee -a "$OUT/summary.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/summary.txt"

stamp "kernel tests, compiled on CUDA"
PAGEDLLM_TEST_DEVICE=cuda timeout 180 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_kernels.py \
    2>&1 | tee "$OUT/kernel_tests.txt" | tail -3 | tee -a "$OUT/summary.txt"

stamp "gpu_check.py"
timeout 390 python3 scripts/gpu_check.py --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log" | grep -v "^\s" | tail -20
stamp "done"
