# Two commands matter: `make demo` and `make test` (`make lint` first, then the suite, which builds the
# docs site strictly). Both run `make setup` first, which is idempotent: a second run only checks
# stamps and costs seconds. `make test-fast` is the quick path while working: lint, then the tests
# that need no broker and no ranks.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
KAFKA_VERSION := 4.1.1
KAFKA_LIBS := .cache/kafka/$(KAFKA_VERSION)/libs
JOINER_DIR := .cache/joiner
# Which fbgemm_gpu to install: the CUDA build (requirements/cuda.txt) on hosts where nvidia-smi
# answers, else the CPU one (requirements/cpu.txt). Override with STREAMTRAIN_CUDA=1 or 0, or run
# `make setup-cuda`. The worker picks its device from what is installed (distributed.device: auto).
STREAMTRAIN_CUDA ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
VARIANT := $(if $(filter 1,$(STREAMTRAIN_CUDA)),cuda,cpu)
OTHER_FBGEMM := $(if $(filter cuda,$(VARIANT)),fbgemm-gpu-cpu,fbgemm-gpu)
STAMP := $(VENV)/.stamp-$(VARIANT)

.PHONY: setup setup-cuda lint test test-fast docs demo kafka clean
.DEFAULT_GOAL := setup

setup: $(STAMP) $(KAFKA_LIBS)/.stamp $(JOINER_DIR)/libs/.stamp .cache/prometheus.stamp

setup-cuda:
	$(MAKE) setup STREAMTRAIN_CUDA=1

# torchrec is installed with --no-deps: its metadata asks for the CUDA fbgemm-gpu, unpinned, which
# fails to import without an NVIDIA driver and collides with fbgemm-gpu-cpu (both ship
# `fbgemm_gpu`). For the same reason the other variant is removed before this one goes in.
$(STAMP): requirements/$(VARIANT).txt requirements/common.txt requirements/torchrec.txt requirements/dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.stamp $(VENV)/.stamp-cpu $(VENV)/.stamp-cuda
	$(PY) -m pip install --quiet --upgrade "pip>=24" "setuptools>=77"
	$(PY) -m pip uninstall --quiet --yes $(OTHER_FBGEMM)
	$(PY) -m pip install --quiet -r requirements/$(VARIANT).txt -r requirements/dev.txt
	$(PY) -m pip install --quiet --no-deps -r requirements/torchrec.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) -c "import torch, torchrec, fbgemm_gpu, confluent_kafka, fastavro, numba, prometheus_client"
	touch $@

$(KAFKA_LIBS)/.stamp: deploy/kafka/pom.xml
	mvn --batch-mode --quiet -f deploy/kafka/pom.xml package
	touch $@

# The late-label joiner (deploy/joiner/, Kafka Streams): its jar and runtime jars in $(JOINER_DIR)/libs.
$(JOINER_DIR)/libs/.stamp: deploy/joiner/pom.xml $(shell find deploy/joiner/src -type f)
	rm -rf $(JOINER_DIR)/libs
	mvn --batch-mode --quiet -f deploy/joiner/pom.xml package -Djoiner.dir=$(abspath $(JOINER_DIR))
	touch $@

# Debian's Prometheus, for the tests that scrape a live worker and evaluate the dashboard's queries.
# apt-get runs as root, or through sudo where it asks no password; otherwise nothing is attempted,
# and those tests say that prometheus is missing and skip (under CI=true they fail instead).
APT_GET = apt-get -qq -o=Dpkg::Use-Pty=0
.cache/prometheus.stamp:
	@if command -v prometheus >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ]; then $(APT_GET) update && DEBIAN_FRONTEND=noninteractive \
	    $(APT_GET) install -y --no-install-recommends prometheus; \
	elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo -n $(APT_GET) update && \
	    sudo -n env DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y --no-install-recommends prometheus; \
	else echo "note: not root and no passwordless sudo: install Debian's prometheus package yourself" \
	    "for the tests that scrape a live worker (they skip, saying so, without it)"; \
	fi || echo "warning: could not install Debian's prometheus; the scraping tests will say so and skip"
	@mkdir -p .cache && (command -v prometheus >/dev/null && touch $@ || true)

# Static checks, configured in pyproject.toml: ruff's lint rules, the formatter's verdict, and mypy.
lint: $(STAMP)
	$(VENV)/bin/ruff check streamtrain tests
	$(VENV)/bin/ruff format --check streamtrain tests
	$(VENV)/bin/mypy

# Two pytest workers (pytest-xdist), each with its own broker: a test spends much of its time
# waiting (a broker or worker starting, a timeout, a fault held open), and on a 2-core host the
# suite took 18.5 minutes in two workers against 28.6 in one. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

test: setup lint
	$(PY) -m pytest -ra --durations=40 -n $(TEST_WORKERS) --dist worksteal tests

# The quick path: lint, then every test not marked integration (tests/conftest.py marks each test
# that starts a Kafka broker, a worker process or several ranks), in the same two workers. It needs
# neither Prometheus nor the broker jars, and no root.
test-fast: $(STAMP) lint
	$(PY) -m pytest -q -ra --durations=15 -n $(TEST_WORKERS) --dist worksteal -m "not integration" tests

# The docs site (mkdocs.yml, docs/): the configuration reference regenerated from
# streamtrain/config.py, then a strict build into site/ (git-ignored). tests/test_docs.py checks
# both, and runs the getting-started page's runnable blocks, in `make test`.
docs: setup
	$(PY) -m streamtrain.dev.docs
	$(VENV)/bin/mkdocs build --strict

demo: setup
	$(PY) -m streamtrain demo

kafka: setup
	$(PY) -m streamtrain dev-kafka --topic clicks

clean:
	rm -rf $(VENV) .cache deploy/kafka/target site
