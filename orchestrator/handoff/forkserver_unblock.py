"""Imported first by the forkserver (warmstart.PRELOAD): SIGINT and SIGTERM unblocked.

warmstart.start_early blocks both while it forks and execs the forkserver (so that a Ctrl-C
arriving then stays pending for the command instead of being lost to the moment's SIG_IGN);
the mask is inherited across fork and exec, so the forkserver lifts it here, before its
imports. The two stay ignored there, as before (and so in each child until it installs its
own handlers); a new process has no pending signal of its parent's to receive."""

import signal

signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
