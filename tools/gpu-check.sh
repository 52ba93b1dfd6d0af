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
  ls "$site" | grep -i mooncake
  nproc
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
echo "== GPU tests"
timeout 300 python3 -m pytest -q -m gpu -s -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -15 | tee "$out/gpu-tests.txt"
echo "== default INTRA_NODE_NVLINK profile"
timeout 300 python3 -m orchestrator mem_pool=INTRA_NODE_NVLINK hydra.run.dir="$out/run-intra-node-nvlink" 2>&1 \
  | grep -v '\[info' | tail -12
echo "== experiment=deepseek_v3_mtp (2000 handoffs, 16 in flight)"
timeout 300 python3 -m orchestrator experiment=deepseek_v3_mtp hydra.run.dir="$out/run-deepseek-v3-mtp" 2>&1 \
  | grep -v '\[info' | tail -12
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('decode verify_us', r['decode_stats'].get('verify_us'), 'gate_waits', r['decode_stats'].get('gate_waits'))" "$out/run-deepseek-v3-mtp/results.json"
for rep in 1 2 3; do
  echo "== bench #$rep: experiment=deepseek_v3_mtp shape (10 blocks / 15,872 B per request)"
  timeout 200 python3 -m orchestrator.bench experiment=deepseek_v3_mtp hydra.run.dir="$out/bench-$rep" > "$out/bench-$rep.log" 2>&1
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); [print(p['path'], 'decode verify_us', p.get('decode_verify_us')) for p in r['paths']]" "$out/bench-$rep/bench.json"
  cp "$out/bench-$rep/bench.md" "$out/bench-$rep.md"
done
echo "== where a GPU-side verification goes"
timeout 60 python3 tools/profile_verify.py 7168 bfloat16
echo "== all pairs: 4 prefill x 4 decode ranks (on 2 GPUs they alternate), NVLink vs tcp route"
timeout 300 python3 -m orchestrator -m experiment=pd_8gpu_nvlink,pd_8gpu_tcp hydra.sweep.dir="$out/pd-4x4" 2>&1 | grep -v '\[info' | grep -E "mem_pool=|requests|send_aux|handoffs/s|pair|ERROR" | head -44
cp "$out/pd-4x4/summary.md" "$out/pd-4x4-summary.md" 2>/dev/null
for rep in 1 2 3; do echo "== bench #$rep table"; cat "$out/bench-$rep.md"; done
