"""Sweeps and the tools around runs: the multirun summary (sweep), Slurm (slurm), the transport
bench (bench), replay of a run dir (replay) and report over run dirs (report)."""
