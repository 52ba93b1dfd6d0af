"""Results: per-request records and per-process results, results.json's schema, the reporting
that turns one into the other, a run's outputs (opened before its handoffs, finished after
them), the run dir's names, lock and atomic writes, logs and plots."""
