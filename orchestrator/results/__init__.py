"""Results: per-request records and per-process results, results.json's schema, the reporting
that turns one into the other, the run dir's names, lock and atomic writes, logs and plots."""
