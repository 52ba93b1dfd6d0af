"""Time bounds for tests that must hold on a loaded 2-core box (CI runs the suite in 3
workers on 2 cores, and other work may share them: load 10 was seen). A bound is what the
configuration lets the thing under test take (the timeouts on its path, which the test
names) plus margins for the work no timeout bounds. A hang, or a wait the code should not
make, still fails: a test picks the waits so that the one it rules out is not among them.
"""

from __future__ import annotations

SLACK_S = 15.0
"""Scheduling and logging inside running processes on a loaded box (a quiet box needs well
under a second)."""

START_S = 25.0
"""One round of process start-up (Python, torch, Mooncake's engine, the bootstrap; processes
that start side by side count once): 5 s at load 6.5, up to 20 s at load 10 (issue 33)."""

FINISH_S = 20.0
"""A command's own ending: its records, results.json and latency.png, and the interpreter's
teardown. After a link cut at load 11.6 (tests/test_netns.py, 30,000 requests): 4.3 s of
records, 7.0 s of latency.png, 3.5 s of teardown."""


def startup_timeout_s() -> float:
    """endpoints.startup_timeout_s as configured by default (a command run without it): the
    longest one start-up phase of a run may go without progress before the run ends itself."""
    from orchestrator.profile.config import EndpointsConfig

    return EndpointsConfig().startup_timeout_s


def bound(*waits_s: float, start: bool = False, finish: bool = False) -> float:
    """The longest a test lets something take: the configured waits on its path, a round of
    start-up and a command's ending where they are on it, and SLACK_S."""
    return sum(waits_s) + SLACK_S + (START_S if start else 0.0) + (FINISH_S if finish else 0.0)
