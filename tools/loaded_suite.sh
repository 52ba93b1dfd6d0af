#!/usr/bin/env bash
# The suite under load (issue 37): `make test` in a set-up clone beside LOOPS loops of
# `python -m orchestrator workload.requests=3000`, a 1-min load sample every 10 s, then the
# README's 4x4 command at that load. Prints one summary block; everything else goes to OUT.
#
#   bash tools/loaded_suite.sh CLONE [OUT] [LOOPS]
#     CLONE  a clone set up by its own `make test` (or .ci/run): its .venv is used
#     OUT    where the logs go (default: a new dir under /tmp)
#     LOOPS  background loops (default 3)
set -uo pipefail
CLONE=$(cd "${1:?usage: tools/loaded_suite.sh CLONE [OUT] [LOOPS]}" && pwd)
OUT=${2:-$(mktemp -d /tmp/loaded.XXXX)}
LOOPS=${3:-3}
mkdir -p "$OUT"
PY="$CLONE/.venv/bin/python"
STOP="$OUT/stop"
rm -f "$STOP"

loop() {  # one background loop: runs until STOP exists; one line per run: its exit code
  local i=0
  while [ ! -e "$STOP" ]; do
    i=$((i + 1))
    (cd "$CLONE" && "$PY" -m orchestrator workload.requests=3000 \
        "hydra.run.dir=$OUT/loop$1/run$i" >/dev/null 2>&1)
    echo "$?" >> "$OUT/loop$1.rc"
    rm -rf "$OUT/loop$1/run$i"
  done
}
sampler() {
  while [ ! -e "$STOP" ]; do cut -d' ' -f1 /proc/loadavg >> "$OUT/load"; sleep 10; done
}

for n in $(seq 1 "$LOOPS"); do loop "$n" & done
sampler &
sleep 30  # let the load build up

t0=$(date +%s)
(cd "$CLONE" && make test ARGS="--durations=30" > "$OUT/suite.log" 2>&1)
suite_rc=$?
t1=$(date +%s)
(cd "$CLONE" && "$PY" -m orchestrator endpoints.prefill_ranks=4 endpoints.decode_ranks=4 \
    transport.route=tcp "hydra.run.dir=$OUT/4x4" > "$OUT/4x4.log" 2>&1)
four_rc=$?
touch "$STOP"
wait

runs=$(cat "$OUT"/loop*.rc 2>/dev/null | wc -l)
bad=$(grep -vc '^0$' "$OUT"/loop*.rc 2>/dev/null | awk -F: '{s += $NF} END {print s + 0}')
load=$(sort -n "$OUT/load" | awk '{a[NR] = $1} END {printf "median %s max %s (%d samples)", a[int((NR + 1) / 2)], a[NR], NR}')
echo "commit:   $(git -C "$CLONE" rev-parse --short HEAD)"
echo "load:     $load"
echo "suite:    exit $suite_rc in $(( (t1 - t0) / 60 )) min $(( (t1 - t0) % 60 )) s: $(grep -E '[0-9]+ (passed|failed)' "$OUT/suite.log" | tail -1)"
echo "4x4:      exit $four_rc: $(grep -m1 '^requests' "$OUT/4x4.log"), $(grep -o 'start-up [0-9.]* s' "$OUT/4x4.log" | head -1)"
echo "loops:    $runs runs, $bad not exit 0"
echo "logs:     $OUT"
