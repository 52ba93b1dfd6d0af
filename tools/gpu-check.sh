#!/usr/bin/env bash
# Reproduces the GPU results in BENCHMARKS.md on a 2-GPU H200 machine (no network there).
# Prepare here:  ../shared/tools/gpu-wheels.sh      (fills .whl/)
# Run there:     bash tools/gpu-check.sh [OUTDIR]    (carry .whl along)
set -uo pipefail
out=${1:-${OUT:-outputs/gpu-check}}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl || exit 1
export PYTHONPATH="$site:$PWD"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
  pip list 2>/dev/null | grep -i mooncake || ls "$site" | grep -i mooncake
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
echo "== GPU tests"
timeout 300 python3 -m pytest -q -m gpu -s tests/test_gpu.py 2>&1 | tail -15 | tee "$out/gpu-tests.txt"
echo "== default INTRA_NODE_NVLINK profile"
timeout 300 python3 -m orchestrator mem_pool=INTRA_NODE_NVLINK hydra.run.dir="$out/run-intra-node-nvlink" 2>&1 \
  | grep -v '\[info' | tail -12
echo "== bench: 10 blocks / 15,872 B per request (hidden 7168 bf16)"
timeout 400 python3 -m orchestrator.bench mem_pool=INTRA_NODE_NVLINK buffers.hidden_size=7168 \
  buffers.hidden_states_dtype=bfloat16 hydra.run.dir="$out/bench-intra-node-nvlink" 2>&1 | grep -v '\[info' | tail -30
