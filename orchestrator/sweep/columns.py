"""What each column of a sweep's summary.csv / summary.md holds: the table docs/sweeps.md
shows is generated from this and from sweep.RESULT_COLUMNS (the columns written), so a
column added without a meaning fails a test (tests/test_docs.py) and the docs cannot lag
(`python tools/doc_samples.py` rewrites the table)."""

from __future__ import annotations

from orchestrator.sweep.sweep import PERCENTILE_METRICS, RESULT_COLUMNS

_MEAN_MAX = tuple(f"{k}_{s}_us" for k in PERCENTILE_METRICS for s in ("mean", "max"))

# (the columns of one row of the table, what they hold), in the order of the table
COLUMN_DOCS: list[tuple[tuple[str, ...], str]] = [
    (("status",), "`ok`: every request verified and no error; `failed`: ran but not every request "
                  "verified; `interrupted`: SIGINT/SIGTERM ended it (counts so far); `error`: "
                  "`results.json` carries an error (or cannot be read); `missing`: no `results.json` "
                  "(the job crashed before writing one); `not started`: a combination of the sweep "
                  "whose job never began (an interrupted sweep)"),
    (("exit_code",), "the job's exit code (README.md, Exit codes)"),
    (("requests", "verified", "corrupted", "failed"), "counts from `results.json`"),
    (("routes",), "requests per route, e.g. `engine=200` or `engine=100;tcp=3`"),
    (("mem_pool", "route"), "what the plan decided (`plan.mem_pool`, `plan.route`); empty when the job "
                            "never got a plan"),
    (("send_aux_p50_us", "send_aux_p99_us", "send_aux_p999_us"), "send_aux (the write alone) latency "
                                                                 "percentiles, us"),
    (("taken_p50_us", "taken_p99_us", "taken_p999_us"), "forward step done -> taken by the decode "
                                                        "(status in, readiness gate passed), us"),
    (("handoff_p50_us", "handoff_p99_us", "handoff_p999_us"), "forward step done -> the decode's verdict, "
                                                              "us"),
    (("e2e_p50_us", "e2e_p99_us"), "latency from arrival (what an open-loop sweep plots), us"),
    (_MEAN_MAX, "mean and max of send_aux, taken, handoff and from-arrival latency, us"),
    (("handoffs_per_s", "mb_per_s", "bytes_per_request", "effective_transport"), "as in `results.json`"),
    (("offered_per_s", "achieved_pct"), "open loop (`workload.rate`): the offered load (all prefill ranks) "
                                        "and the verified rate as a percentage of it; a run below 95% also "
                                        "warns in its summary"),
    (("startup_s", "startup_by_process"), "start-up (excluded from the rate) and each process's, e.g. "
                                          "`prefill=4.29;decode=4.98`"),
    (("silent_corruptions", "steps_disagreed"), "decode TP groups (`endpoints.decode_tp` > 1): requests "
                                                "taken unready or with a wrong room (what SGLang would take "
                                                "silently), steps where the ranks disagreed before the "
                                                "all-reduce; empty with one rank"),
    (("gate_read", "gate_read_p50_us", "gate_read_p99_us", "stall_p50_us", "stall_p99_us"),
     "the decode gate's read (`gate.read`), its cost per poll and how long the decode loop stalled per "
     "poll, us"),
    (("forward_steps_per_s_idle", "forward_steps_per_s_serving"), "`endpoints.decode_load`: the decode "
                                                                  "GPU's forward steps/s without handoffs "
                                                                  "and while serving; empty without one"),
    (("requests_per_send", "duration_s", "burstiness", "layout"), "request rows per send call (coalesced "
                                                                  "runs carry several), "
                                                                  "`workload.duration_s`, "
                                                                  "`workload.burstiness`, the rank/TP layout "
                                                                  "(`1 prefill rank -> 1 decode instance "
                                                                  "(TP 1)`)"),
    (("error",), "the job's error, empty when none"),
]

_FIRST = [("`job`", "hydra.job.num (the subdir name)"),
          ("one per swept key", "the value from the job's `.hydra/overrides.yaml` (every key given on the "
                                "command line, `hydra.*` left out; empty where a job did not set it). A key "
                                "that is also a result column is prefixed: `mem_pool=NONE,NVLINK` gives "
                                "`override:mem_pool`")]
_LAST = [("`send_aux_p90_us`, `handoff_p99.9_us`, ... (last)", "each job's `report.percentiles` not "
                                                               "already a column, metric by metric")]


def undocumented() -> list[str]:
    """Columns written without a row here, or described twice, or described and not written."""
    named = [c for cols, _ in COLUMN_DOCS for c in cols]
    return sorted({c for c in RESULT_COLUMNS if named.count(c) != 1} | (set(named) - set(RESULT_COLUMNS)))


def column_table() -> str:
    """The Markdown table of docs/sweeps.md."""
    rows = [*_FIRST, *((", ".join(f"`{c}`" for c in cols), text) for cols, text in COLUMN_DOCS), *_LAST]
    return "\n".join(["| column | what it holds |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])
