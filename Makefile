# Everything a fresh machine needs, in one place. `make demo` and `make test` run `make setup` first.
#   setup   Python venv with the package, PyTorch (CPU), the dev tools and the frameworks the tests train with
#           (transformers, Lightning, torchdata: pinned, never replacing torch); the native helpers; CRIU 4.2
#           in Cryosleep's private prefix (downloaded, verified against a pinned lock, never touching apt), and
#           beside it criu-uffd: the same CRIU built from Debian's pinned source with memory tracked by userfaultfd
#           write-protect (its build's -dev packages from apt);
#           the loopback S3 server the store's tests run against (Ceph radosgw, private prefix, same way);
#           Slurm and munge from the distribution's packages, for the Slurm tests (tests/slurm);
#           PostgreSQL's server from the distribution's packages, for the coordinator's server catalog's tests
#   slurm   only the Slurm step: apt-get install of slurmctld, slurmd, slurm-client and munge (no daemon is started:
#           the tests run their own, in a private directory)
#   postgresql  only the PostgreSQL step: apt-get install of postgresql (the package's own cluster is not used:
#           the tests run their own server, as an unprivileged user, in a private directory: tests/pgserver.py)
#   test    the default test suite (what CI runs)
#   demo    the main job: snapshot, stop and restore a small DDP job, compared bit for bit
#   lint    ruff and mypy --strict
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN = $(VENV)/bin

.PHONY: setup venv native criu criu-uffd s3server slurm postgresql test test-extended test-slurm test-chaos test-fast demo lint clean

setup: venv native criu criu-uffd s3server slurm postgresql

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)" numpy matplotlib
	printf '%s\n' "$(TORCH)" > $(VENV)/constraints.txt
	$(BIN)/pip install -q -c $(VENV)/constraints.txt -e '.[dev,frameworks]'
	touch $@

native:
	$(MAKE) -C native

criu: venv
	$(BIN)/cryosleep criu install

# CRIU's build dependencies from the distribution's packages, then the pinned CRIU built with memory tracked by
# userfaultfd write-protect (capture/criu_uffd.py), beside the prefix's criu
criu-uffd: criu
	apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	  $$($(BIN)/python -c 'from cryosleep.capture.criu_uffd import BUILD_DEPS; print(*BUILD_DEPS)')
	$(BIN)/cryosleep criu build-uffd

s3server: venv
	$(BIN)/python tools/s3serve.py install

SLURM_PACKAGES = slurmctld slurmd slurm-client munge
slurm:
	@if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
	    && command -v munged >/dev/null; then echo "slurm: installed"; else \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	    $(SLURM_PACKAGES); fi

PG_PACKAGES = postgresql
postgresql:
	@if ls /usr/lib/postgresql/*/bin/initdb /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then \
	  echo "postgresql: installed"; else \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	    $(PG_PACKAGES); fi

test: setup
	$(BIN)/python -m pytest -q --durations=25

test-extended: setup
	$(BIN)/python -m pytest -q -m extended --durations=10

test-slurm: setup
	$(BIN)/python -m pytest -q -m slurm --durations=10

test-chaos: setup
	$(BIN)/python -m pytest -q -m chaos --durations=10

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not extended and not slurm and not chaos"

demo: setup
	$(BIN)/cryosleep demo

lint: venv
	$(BIN)/ruff check src tests tools bench
	$(BIN)/mypy

clean:
	$(MAKE) -C native clean
	rm -rf $(VENV)
