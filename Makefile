# Two entry points for a bare machine:
#   make run    set up, then run the embedded default job (python -m orchestrator)
#   make test   set up, then run the test suite and, beside it, the linter and type checker (make lint)
#               (JOBS=3 parallel workers; JOBS=0 for one process)
# Set-up: a venv in .venv, libibverbs1 (the Mooncake wheels link it) when missing, torch
# (CPU boxes: torch==2.13.0, the CPU build on disk), and this package with the Mooncake
# wheel for the machine (extra cpu, cuda12 or cuda13; override with `make MOONCAKE=cuda13`).
#   make cluster-deps   Debian's slurm-wlm, munge and etcd-server when missing (root or sudo):
#                       what tests/test_cluster*.py start (a Slurm cluster in network
#                       namespaces, etcd); .ci/run installs them, elsewhere those tests skip

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
ARGS   ?=

HAS_GPU  := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)
CUDA_MAJ := $(shell nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: \([0-9]*\).*/\1/p')
ifeq ($(HAS_GPU),yes)
  MOONCAKE ?= $(if $(filter 13,$(CUDA_MAJ)),cuda13,cuda12)
  TORCH    ?= torch
else
  MOONCAKE ?= cpu
  TORCH    ?= torch==2.13.0
endif

STAMP := $(VENV)/.installed-$(MOONCAKE)

.PHONY: setup run lint test bench clean cluster-deps
setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@ldconfig -p | grep -q 'libibverbs.so.1 ' || { \
	  echo "installing libibverbs1 (needed by the Mooncake wheel)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libibverbs1 >/dev/null; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[$(MOONCAKE),test]"
	$(PY) -m pip install -q --no-deps "sglang==0.5.23"
	@touch $@

# command:package pairs; a package is installed when its command is on neither PATH nor /usr/sbin
CLUSTER_DEPS := slurmctld:slurm-wlm slurmd:slurm-wlm sbatch:slurm-wlm munged:munge etcd:etcd-server
cluster-deps:
	@missing=$$(for d in $(CLUSTER_DEPS); do c=$${d%%:*}; \
	  command -v $$c >/dev/null 2>&1 || [ -x /usr/sbin/$$c ] || echo $${d#*:}; done | sort -u | tr '\n' ' '); \
	if [ -n "$$missing" ]; then \
	  echo "installing $$missing(the cluster tests' Slurm, munge and etcd)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

run: setup
	$(PY) -m orchestrator $(ARGS)

# ruff (E, F, I, W, B) and mypy as configured in pyproject.toml; neither writes a cache here
lint: setup
	$(PY) -m ruff check --no-cache orchestrator tests tools
	$(PY) -m mypy orchestrator

# The suite runs in JOBS pytest-xdist workers, test by test, but a module whose fixture is
# costly (the Slurm cluster, the netns pairs, the real sweep) marks itself xdist_group and
# runs on one worker, its fixture built once. 3 on the 2-core CI box: most tests wait on
# processes and timeouts, not on a core. JOBS=0: one process, as plain pytest.
JOBS ?= 3
# make lint runs beside the suite (its output is printed after the suite's); either failing fails
test: setup
	@lintlog=$$(mktemp); $(MAKE) --no-print-directory lint > $$lintlog 2>&1 & lintpid=$$!; \
	PYTHONDONTWRITEBYTECODE=1 $(PY) -m pytest -q $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist loadgroup) $(ARGS); \
	rc=$$?; wait $$lintpid; lintrc=$$?; cat $$lintlog; rm -f $$lintlog; \
	[ $$lintrc = 0 ] || echo "make lint failed (exit $$lintrc)"; [ $$rc = 0 ] && [ $$lintrc = 0 ]

clean:
	rm -rf $(VENV) outputs .pytest_cache .ruff_cache .mypy_cache
