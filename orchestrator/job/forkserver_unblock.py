"""Imported first by the forkserver (warmstart.PRELOAD): SIGINT and SIGTERM ignored, then
unblocked.

warmstart.start_early blocks both (never ignores them: that would discard one arriving then)
while it forks and execs the forkserver, so a Ctrl-C in that window stays pending for the
command. The mask is inherited across fork and exec: here the forkserver ignores both first
(which also drops one pending here: the group's Ctrl-C is the command's to handle), then lifts
the mask, before its imports. Its children inherit the two ignored, as lifecycle.spawn arranges
for spawned ones, until each installs its own handlers."""

import signal

for _sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_sig, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
