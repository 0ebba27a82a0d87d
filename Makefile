# fnkernel — `make demo` then `make test` on a fresh machine with Python 3.11.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-ui image test-k8s proto lint fmt typecheck bench bench-peers kpt-e2e mutate clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or make PYTHON=python3)"; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Installs the kernelspec into .venv, then runs notebooks/quickstart.ipynb headless through it.
demo: $(STAMP)
	$(VENV)/bin/fnkernel install --sys-prefix
	$(PY) -m fnkernel.kernel.demo notebooks/quickstart.ipynb

# Two test processes (pytest-xdist), each taking the next test as it finishes one: most of the
# suite's time is spent waiting on stacks, kernels and clusters. On this 2-core machine, 5½–7
# min against 10–12 min in one process.
test: $(STAMP) lint typecheck
	$(PY) -m pytest -n 2 --dist worksteal

# The inner loop, under 2 minutes: the tests that start no stack, cluster, kernel or server
# process of their own and wait no seconds on purpose (tests/conftest.py, SLOW_FIXTURES).
# 1 min 26 s in two processes here, 2 min 24 s in one.
test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" -q -n 2 --dist worksteal

UI_STAMP := $(VENV)/.installed-ui
$(UI_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,ui]'
	touch $(UI_STAMP)

# The notebook in a real browser (docs/architecture.md, "Testing in a browser"): JupyterLab on
# 127.0.0.1 and Debian's Chromium (apt-get install -y chromium) driven by Playwright. Screenshots
# of failures go to ui-failures/. Not part of `make test`.
test-ui: $(UI_STAMP)
	$(PY) -m pytest tests_ui -p no:cacheprovider

# fnkernel's image (deploy/Dockerfile) built with podman from Debian's packages, no registry and
# no network in the build (tools/image.sh; docs/kubernetes.md, "The image"). Needs root.
image: $(STAMP)
	PYTHON=$(PY) tools/image.sh

# The cluster path as a cluster runs it: the image built, every pod of deploy/ a set of podman
# containers of it, run as the manifests say; the API server emulated (tests_k8s/). Installs
# Debian's podman, runc and mmdebstrap when they are missing (as root), and kubernetes-client
# unless a kubectl is there already (another package's /usr/bin/kubectl would refuse it). Not part
# of `make test`.
K8S_PACKAGES := podman runc mmdebstrap uidmap containernetworking-plugins slirp4netns \
	fuse-overlayfs golang-github-containers-common
test-k8s: $(STAMP)
	@command -v podman >/dev/null && command -v mmdebstrap >/dev/null \
		|| { apt-get update -qq && apt-get install -y -qq --no-install-recommends $(K8S_PACKAGES) >/dev/null; }
	@command -v kubectl >/dev/null \
		|| { apt-get update -qq && apt-get install -y -qq --no-install-recommends kubernetes-client >/dev/null; }
	$(MAKE) image
	$(PY) -m pytest tests_k8s -p no:cacheprovider

proto: $(STAMP)
	$(PY) -m fnkernel.runtime_server._proto.gen

fmt: $(STAMP)
	$(VENV)/bin/ruff format runtime_server adapters kernel system tests tests_ui tests_k8s benchmarks tools

# mypy and import-linter read files, and the editable install maps the names fnkernel.* by an
# import hook they cannot follow (pyproject.toml, [tool.setuptools.package-dir]): they read the
# installed layout through src/fnkernel/{runtime_server,adapters,kernel,system}, committed links
# to the folders (README.md, "Layout").
TREE := src

lint: $(STAMP)
	$(VENV)/bin/ruff format --check runtime_server adapters kernel system tests tests_ui tests_k8s benchmarks tools
	$(VENV)/bin/ruff check runtime_server adapters kernel system tests tests_ui tests_k8s benchmarks tools
	PYTHONPATH=$(TREE) $(VENV)/bin/lint-imports
	$(PY) -m tools.check_names

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Every benchmark runs even when an earlier one misses its target; the exit status says whether all
# were met. The sources are compiled first, as an installed package's are: a process that starts
# a component would otherwise compile ours each time (with PYTHONDONTWRITEBYTECODE set).
bench: $(STAMP)
	$(PY) -m compileall -q runtime_server adapters kernel system benchmarks >/dev/null
	$(VENV)/bin/fnkernel bench

# fnkernel beside Ray and Jupyter Kernel Gateway, interleaved in one run (benchmarks/peers.py), and
# DataFrames in and out beside Ray and a ProcessPoolExecutor (benchmarks/dataframes.py), and grpc's
# two I/O engines under the same calls (benchmarks/engines.py), all run: the peers are an optional
# extra, installed here. Not part of `make test` or `make bench`.
PEERS_STAMP := $(VENV)/.installed-peers
$(PEERS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,peers]'
	touch $(PEERS_STAMP)

bench-peers: $(PEERS_STAMP)
	$(PY) -m compileall -q runtime_server adapters kernel system benchmarks >/dev/null
	$(PY) -m benchmarks.peers; peers=$$?; $(PY) -m benchmarks.dataframes; frames=$$?; \
		$(PY) -m benchmarks.engines && [ $$peers -eq 0 ] && [ $$frames -eq 0 ]

# kpt's own fn render / fn eval cases, judged as kpt judges them (docs/krm.md): KPT is a kpt
# checkout, or KPT_MIRROR a bare clone of github.com/kptdev/kpt; CATALOG_MIRROR, a bare clone of
# github.com/kptdev/krm-functions-catalog, adds its examples. Not part of `make test`.
kpt-e2e: $(STAMP)
	$(PY) -m tools.kpt_e2e $(if $(KPT_MIRROR),--mirror $(KPT_MIRROR),$(if $(KPT),--kpt $(KPT))) \
		$(if $(CATALOG_MIRROR),--catalog $(CATALOG_MIRROR))

# Mutation testing of the Runtime Server's core (tools/mutate.py): the score per file, and each
# surviving mutant (docs/architecture.md, "Mutation testing"). Not part of `make test`; under 30
# minutes on 2 cores.
mutate: $(STAMP)
	$(PY) -m tools.mutate

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache mutants ui-failures
