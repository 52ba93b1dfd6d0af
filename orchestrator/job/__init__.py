"""The job: the one place that sees the whole config. It checks it (check, app), turns it into the
specs that cross into the endpoint processes, starts and watches those processes (runner,
warmstart, lifecycle, mps), hears the decodes while their side serves its bootstrap (bootstrap),
rebuilds what a lost process left on disk (recovery), and speaks the runner pipe's protocol
(protocol). The failure policy (failure) is the one table of exit codes and error lines every
command uses."""
