#!/usr/bin/env bash
# The GPU results in BENCHMARKS.md, reproduced on an H200 machine, one GPU or two (no network there).
# Prepare here:  ../shared/tools/gpu-wheels.sh      (fills .whl/)
# Run there:     bash tools/gpu-check.sh [OUTDIR] [STEPS]   (carry .whl along)
# STEPS: any of tests,yardstick,bench,ladder,floor,trace,profile,pyspy,sweep,sweeplow,pairs,tp,tprace,gate,tails
# (default: tests,yardstick,bench,profile,pyspy,sweep,pairs,tp)
# (ladder: the cost ladder, `python -m orchestrator.bench bench.phases=ladder` on experiment=deepseek_v3_mtp
# (NVLink rows, endpoints.mps=auto: MPS where the pair shares a GPU), R0..R7 and the yardstick
# (YARDSTICK_ROOM=1) interleaved over 5 rounds of bench.ladder_handoffs each; LADDER_HANDOFFS,
# LADDER_ROUNDS and LADDER_RUNGS (e.g. [R7,yardstick]: the goal's pair alone, more rounds) override; ladder.md / ladder.json in OUTDIR's tarball; the CPU twin is the same
# command without the experiment)
# (floor: tools/route_floor.py gpu FLOOR_N FLOOR_ROUNDS 256 FLOOR_MODES, default 12800 3
# engine-co64,engine-pipe+st: the coalesced goal's floor, a careful coalesced loop against
# per-request writes with a status each; any of its modes may be named, all under MPS)
# (trace: tools/call_trace.py over one run of TRACE_N (3000) handoffs one in flight, fill=ahead, MPS
# auto: each function's p50 per process and the median handoff, both sides on one clock, in trace.txt)
# (yardstick: ../shared/tools/handoff_yardstick.py, the reference loop the bench is compared
# with, run in the same call just before and just after the bench, plain and with
# YARDSTICK_ROOM=1 (SGLang's room write and check), each without CUDA MPS and under a daemon of
# this script's own; then ours/yardstick for each pair: ../shared does not travel to the device,
# so copy it first: cp ../shared/tools/handoff_yardstick.py .whl/ ; its path can be given as
# YARDSTICK=...; IDEAL_GPU_D=1 puts its decode on GPU 1)
# (bench and gate run with and without MPS: the bench gives each path whose processes share a
# GPU a no-MPS twin (endpoints.mps=off: one in flight and per-request); the gate sweep runs its
# CUDA rows with endpoints.mps=off and on, its host rows once. MPS never changes a device
# setting: a control daemon with its pipe and log dirs in a temp dir, quit at the end.)
# (tails: for every run dir made before it, the first engine write's cost at start-up and the
# five slowest handoffs with their request ids and send times: is the tail a cold start or
# steady state, on the prefill's side or the decode's?)
# Run dirs go to a temp dir; at the end its small files (summaries, results.json, bench
# tables, plots, profiles) are packed into OUTDIR/gpu-check.tar.gz (the device tool returns at
# most 8 files).
set -uo pipefail
dest=${1:-${OUT:-outputs/gpu-check}}
steps=${2:-tests,yardstick,bench,profile,pyspy,sweep,pairs,tp}
yardstick=${YARDSTICK:-.whl/handoff_yardstick.py}
out=$(mktemp -d)/gpu-check
mkdir -p "$out" "$dest"
pack() {
  (cd "$(dirname "$out")" && find gpu-check -type f \( -name '*.md' -o -name '*.json' -o -name '*.csv' \
     -o -name '*.png' -o -name '*.txt' -o -name '*.raw' -o -name 'machine.txt' -o \( -name '*.log' -size -2M \) \) ! -name 'requests*' \
     ! -name 'decisions*' ! -name 'verdicts*' | tar czf "$dest/gpu-check.tar.gz" -T -)
  cp "$out/machine.txt" "$dest/" 2>/dev/null
}
mps_dir=
mps_on() {  # a CUDA MPS control daemon of this script's own (for the yardstick); 1: none to be had
  command -v nvidia-cuda-mps-control >/dev/null || { echo "(nvidia-cuda-mps-control is not on PATH)"; return 1; }
  mps_dir=$(mktemp -d /tmp/mps-XXXXXX); mkdir -p "$mps_dir/pipe" "$mps_dir/log"
  export CUDA_MPS_PIPE_DIRECTORY=$mps_dir/pipe CUDA_MPS_LOG_DIRECTORY=$mps_dir/log
  nvidia-cuda-mps-control -d || { mps_off; return 1; }
}
mps_off() {  # quit it (it outlives the call otherwise) and wait until it is gone
  [ -n "$mps_dir" ] || return 0
  echo quit | nvidia-cuda-mps-control
  for _ in $(seq 100); do [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] || break; sleep 0.1; done
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; mps_dir=
}
trap 'mps_off; pack' EXIT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl || exit 1
export PYTHONPATH="$site:$PWD"
want() { [[ ",$steps," == *",$1,"* ]]; }
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
  ls "$site" | grep -i mooncake
  nproc; echo "commit ${GIT_COMMIT:-unknown}"
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
if want tests; then
  echo "== GPU tests"
  timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu.py tests/test_gpu_step.py tests/test_digest.py \
    tests/test_mps.py 2>&1 | tail -30 | tee "$out/gpu-tests.txt"
fi
run_yardstick() {  # $1: before / after the bench; lines tagged [when mps=off|on room=0|1]
  if [ ! -f "$yardstick" ]; then
    echo "== yardstick: $yardstick not found (cp ../shared/tools/handoff_yardstick.py .whl/)"; return
  fi
  for mps in off on; do
    if [ $mps = on ]; then mps_on || continue; fi
    for room in 0 1; do
      echo "== yardstick ($1, MPS $mps, YARDSTICK_ROOM=$room): python3 $(basename "$yardstick") gpu 3000${IDEAL_GPU_D:+ (decode on GPU $IDEAL_GPU_D)}"
      (cd "$(dirname "$yardstick")" && YARDSTICK_ROOM=${room/0/} timeout 120 python3 "$(basename "$yardstick")" gpu 3000) 2>&1 \
        | grep -E "RESULT|mismatch|Error" | sed "s/^/[$1 mps=$mps room=$room] /" | tee -a "$out/yardstick.txt"
    done
    [ $mps = on ] && mps_off
  done
}
ours_over_yardstick() {  # ours (the bench's one in flight) / the yardstick, for each MPS x room pair
  python3 - "$out/yardstick.txt" "$out/bench.json" <<'PY' | tee "$out/ours-over-yardstick.md"
import json, re, statistics, sys
ys = {}
for line in open(sys.argv[1]):
    m = re.match(r"\[(\w+) mps=(\w+) room=(\d)\] RESULT .*? p50 ([\d.]+) us", line)
    if m:
        ys.setdefault((m[2], m[3]), []).append(float(m[4]))
try:
    paths = json.load(open(sys.argv[2]))["paths"]
except (OSError, ValueError):
    paths = []
ours = {}
for p in paths:
    ph = (p.get("phases") or {}).get("handoff 1-in-flight")
    if ph and p["path"].startswith("engine nvlink_intra"):
        ours["on" if p["path"].endswith(", MPS") else "off"] = ph["handoff_us"]["p50"]
print("| MPS | yardstick p50 us (plain) | yardstick p50 us (YARDSTICK_ROOM=1) | ours 1-in-flight NVLink p50 us "
      "| ours / yardstick ROOM=1 | ours / plain |")
print("|---|---|---|---|---|---|")
for mps in ("off", "on"):
    plain, room = ys.get((mps, "0")), ys.get((mps, "1"))
    med = lambda v: round(statistics.median(v), 1) if v else None
    o, pr, rr = ours.get(mps), med(plain), med(room)
    print(f"| {mps} | {plain} | {room} | {o} | {round(o / rr, 2) if o and rr else '-'} | "
          f"{round(o / pr, 2) if o and pr else '-'} |")
print("(yardstick: every run of the call, before and after the bench; ratios use their medians)")
PY
}
want yardstick && run_yardstick "before"
if want bench; then
  echo "== bench: experiment=deepseek_v3_mtp (10 blocks / 15,872 B per request)"
  timeout 400 python3 -m orchestrator.bench experiment=deepseek_v3_mtp hydra.run.dir="$out/bench" > "$out/bench.log" 2>&1
  cp "$out/bench/bench.md" "$out/bench.md" 2>/dev/null; cp "$out/bench/bench.json" "$out/bench.json" 2>/dev/null
  cat "$out/bench.md" 2>/dev/null || tail -30 "$out/bench.log"
  want yardstick && run_yardstick "after" && ours_over_yardstick
fi
if want ladder; then
  echo "== the cost ladder: R0..R7 and the yardstick (YARDSTICK_ROOM=1), interleaved rounds, experiment=deepseek_v3_mtp"
  YARDSTICK_ROOM=1 timeout "${LADDER_TIMEOUT:-540}" python3 -m orchestrator.bench phases=ladder experiment=deepseek_v3_mtp \
    bench.ladder_rounds="${LADDER_ROUNDS:-5}" bench.ladder_handoffs="${LADDER_HANDOFFS:-2000}" bench.yardstick="$yardstick" ${LADDER_RUNGS:+bench.ladder_rungs=$LADDER_RUNGS} \
    hydra.run.dir="$out/ladder" > "$out/ladder.log" 2>&1
  echo "(exit $?)"
  cp "$out/ladder/ladder.md" "$out/ladder.md" 2>/dev/null; cp "$out/ladder/ladder.json" "$out/ladder.json" 2>/dev/null
  cat "$out/ladder.md" 2>/dev/null || tail -30 "$out/ladder.log"
fi
if want floor; then
  echo "== route floors: tools/route_floor.py gpu, none of this project's code, under an MPS daemon of this script's own"
  if mps_on; then
    timeout 300 python3 tools/route_floor.py gpu "${FLOOR_N:-12800}" "${FLOOR_ROUNDS:-3}" 256 \
      "${FLOOR_MODES:-engine-co64,engine-pipe+st}" > "$out/floor.txt" 2>&1
    echo "(exit $?)"
    mps_off
    tail -25 "$out/floor.txt"
  else
    echo "(no MPS daemon to be had: the floor is taken under one, as the ladder's pair is; skipped)"
  fi
fi
if want trace; then
  echo "== the one-in-flight critical path, call by call: tools/call_trace.py (endpoints.mps=auto)"
  timeout 200 python3 tools/call_trace.py run "$out/trace" -- python3 -m orchestrator experiment=deepseek_v3_mtp \
    workload.fill=ahead workload.concurrency=1 workload.requests="${TRACE_N:-3000}" hydra.run.dir="$out/run-trace" 2>&1 | tail -4
  python3 tools/call_trace.py report "$out/trace" > "$out/trace.txt" 2>&1
  rm -rf "$out/trace"  # (every call recorded: large; the report stays)
  sed -n '/median handoff/,$p' "$out/trace.txt" | head -45
fi
if want profile; then
  echo "== experiment=deepseek_v3_mtp (inline) and with fill=ahead"
  timeout 200 python3 -m orchestrator experiment=deepseek_v3_mtp hydra.run.dir="$out/run-deepseek" 2>&1 | tail -8
  timeout 200 python3 -m orchestrator experiment=deepseek_v3_mtp workload.fill=ahead hydra.run.dir="$out/run-deepseek-ahead" 2>&1 | tail -8
fi
if want pyspy; then
  if python3 -c 'import py_spy' 2>/dev/null || command -v py-spy >/dev/null || [ -x "$site/bin/py-spy" ]; then
    spy=$(command -v py-spy || echo "$site/bin/py-spy")
    echo "== py-spy: where the per-request NVLink handoff spends its time (fill=ahead, 20k requests)"
    timeout 120 "$spy" record --subprocesses --format raw --rate 500 -o "$out/profile-ahead.raw" -- \
      python3 -m orchestrator experiment=deepseek_v3_mtp workload.fill=ahead workload.requests=20000 \
      hydra.run.dir="$out/run-deepseek-ahead-profiled" 2>&1 | grep -v "^py-spy>" | tail -6
  fi
fi
if want sweep; then
  echo "== latency vs offered load: rate x mem_pool (INTRA_NODE_NVLINK vs NONE over the tcp route)"
  timeout 400 python3 -m orchestrator -m experiment=deepseek_v3_mtp workload.requests=6000 workload.concurrency=512 \
    workload.rate=2000,8000,16000,32000,64000 mem_pool=INTRA_NODE_NVLINK,NVLINK hydra.sweep.dir="$out/rate-sweep" 2>&1 \
    | grep -E "sweep summary|job failed" ; cp "$out/rate-sweep/summary.png" "$out/rate-sweep.png" 2>/dev/null
  cut -d, -f1-4,13-14,20-24 "$out/rate-sweep/summary.csv" 2>/dev/null
fi
if want sweeplow; then
  echo "== latency vs offered load below and around the knee (fill=ahead: the route alone)"
  timeout 300 python3 -m orchestrator -m experiment=deepseek_v3_mtp workload.requests=3000 workload.concurrency=512 \
    workload.fill=ahead workload.rate=500,1000,2000,3000,4000 mem_pool=INTRA_NODE_NVLINK,NVLINK \
    hydra.sweep.dir="$out/rate-sweep-low" 2>&1 | grep -E "sweep summary|job failed"
  cut -d, -f1-4,13-14,20-24 "$out/rate-sweep-low/summary.csv" 2>/dev/null
fi
if want pairs; then
  echo "== all pairs: 4 prefill x 4 decode ranks (on 2 GPUs they alternate), NVLink vs tcp route, fill ahead"
  timeout 300 python3 -m orchestrator -m experiment=pd_8gpu_nvlink,pd_8gpu_tcp workload.fill=ahead hydra.sweep.dir="$out/pd-4x4" 2>&1 \
    | grep -E "mem_pool=|requests|handoffs/s|pairs|ERROR" | head -20
  cp "$out/pd-4x4/summary.md" "$out/pd-4x4-summary.md" 2>/dev/null
fi
if want gate; then
  echo "== decode under load: gate.read x decode_load x MPS, CUDA rows, one in flight, fill ahead"
  timeout 300 python3 -m orchestrator -m experiment=deepseek_v3_mtp mem_pool=INTRA_NODE_NVLINK workload.fill=ahead \
    workload.concurrency=1 workload.requests=300 endpoints.decode_load.step_ms=0,8 gate.read=sglang,batched,side_stream \
    endpoints.mps=off,on hydra.sweep.dir="$out/gate" 2>&1 | grep -E "sweep summary|job failed|error"
  echo "== the same on host rows (no GPU process: every gate.read is the same there)"
  timeout 100 python3 -m orchestrator -m experiment=deepseek_v3_mtp mem_pool=NONE workload.fill=ahead \
    workload.concurrency=1 workload.requests=300 endpoints.decode_load.step_ms=0,8 gate.read=sglang \
    hydra.sweep.dir="$out/gate-host" 2>&1 | grep -E "sweep summary|job failed|error"
  python3 - "$out/gate-host/summary.csv" "$out/gate/summary.csv" <<'PY' | tee "$out/gate.txt"
import csv, os, sys
keys = ["mem_pool", "mps", "gate_read", "decode_load", "verified", "taken_p50_us", "handoff_p50_us", "gate_read_p50_us",
        "gate_read_p99_us", "stall_p50_us", "stall_p99_us", "forward_steps_per_s_idle", "forward_steps_per_s_serving"]
rows = [r for f in sys.argv[1:] if os.path.exists(f) for r in csv.DictReader(open(f))]
for r in rows:
    r["decode_load"] = next((v for k, v in r.items() if k.endswith("decode_load.step_ms")), "")
    r["mps"] = next((v for k, v in r.items() if k.endswith("endpoints.mps")), "")
print("| " + " | ".join(keys) + " |")
for r in rows:
    print("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
PY
fi
if want tprace; then
  echo "== decode TP=2, the race fault with the gate on (the rows the room gate lets through torn)"
  timeout 200 python3 -m orchestrator mem_pool=INTRA_NODE_NVLINK endpoints.decode_tp=2 endpoints.prefill_gpus=[0] \
    endpoints.decode_gpus=[0,1] workload.requests=4000 faults=status_first \
    hydra.run.dir="$out/tp-gate-on-race" 2>&1 | tail -8
fi
if want tp; then
  echo "== decode TP=2 on both GPUs, prefill on GPU 0: gate on, then gate off with the race fault"
  timeout 200 python3 -m orchestrator mem_pool=INTRA_NODE_NVLINK endpoints.decode_tp=2 endpoints.prefill_gpus=[0] \
    endpoints.decode_gpus=[0,1] workload.requests=4000 hydra.run.dir="$out/tp-gate-on" 2>&1 | tail -8
  timeout 200 python3 -m orchestrator mem_pool=INTRA_NODE_NVLINK endpoints.decode_tp=2 endpoints.prefill_gpus=[0] \
    endpoints.decode_gpus=[0,1] workload.requests=4000 faults=status_first \
    hydra.run.dir="$out/tp-gate-on-race" 2>&1 | tail -8
  timeout 200 python3 -m orchestrator mem_pool=INTRA_NODE_NVLINK endpoints.decode_tp=2 endpoints.prefill_gpus=[0] \
    endpoints.decode_gpus=[0,1] workload.requests=4000 faults=status_first gate.readiness=false \
    hydra.run.dir="$out/tp-gate-off" 2>&1 | tail -8
fi
if want tails; then
  echo "== tails: first write at start-up, and the slowest handoffs (request id: handoff us)"
  find "$out" -name requests.jsonl | sort | while read -r f; do
    d=$(dirname "$f")
    python3 - "$d" <<'PY'
import glob, json, sys
d = sys.argv[1]
first = [json.loads(l)["first_write_us"] for p in glob.glob(d + "/prefill*.log") for l in open(p)
         if '"bootstrapped"' in l and "first_write_us" in l]
recs = [json.loads(l) for p in glob.glob(d + "/requests*.jsonl") for l in open(p)]
slow = sorted((r for r in recs if r.get("handoff_us") is not None), key=lambda r: -r["handoff_us"])[:5]
print(d.split("gpu-check/")[-1], "first_write_us", first, "slowest (rid, handoff, send)",
      [(r["rid"], round(r["handoff_us"]), round(r.get("send_us") or 0)) for r in slow], "of", len(recs))
PY
  done | tee "$out/tails.txt"
fi
