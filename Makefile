# Two commands matter: `make demo` and `make test` (`make lint` first, then the suite, which builds the
# docs site strictly). Both run `make setup` first, which is idempotent: a second run only checks
# stamps and costs seconds.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
KAFKA_VERSION := 4.1.1
KAFKA_LIBS := .cache/kafka/$(KAFKA_VERSION)/libs
# Which fbgemm_gpu to install: the CUDA build (requirements/cuda.txt) on hosts where nvidia-smi
# answers, else the CPU one (requirements/cpu.txt). Override with STREAMTRAIN_CUDA=1 or 0, or run
# `make setup-cuda`. The worker picks its device from what is installed (distributed.device: auto).
STREAMTRAIN_CUDA ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
VARIANT := $(if $(filter 1,$(STREAMTRAIN_CUDA)),cuda,cpu)
OTHER_FBGEMM := $(if $(filter cuda,$(VARIANT)),fbgemm-gpu-cpu,fbgemm-gpu)
STAMP := $(VENV)/.stamp-$(VARIANT)

.PHONY: setup setup-cuda lint test docs demo kafka gpu-payload clean
.DEFAULT_GOAL := setup

setup: $(STAMP) $(KAFKA_LIBS)/.stamp .cache/prometheus.stamp

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

# Debian's Prometheus, for the tests that scrape a live worker and evaluate the dashboard's queries.
.cache/prometheus.stamp:
	command -v prometheus >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends prometheus) || \
	    echo "warning: could not install Debian's prometheus; the scraping tests will say so and skip"
	mkdir -p .cache && (command -v prometheus >/dev/null && touch $@ || true)

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

# What a lent GPU machine lacks to run `streamtrain bench gpu` (deploy/gpu/README.md): fbgemm-gpu
# for its torch, the wheels, a JDK and the broker's jars, packed into parts under .gpu/ that each fit
# one call of the device tool. It downloads hundreds of MB, so it is no part of `make test`.
gpu-payload: $(STAMP) $(KAFKA_LIBS)/.stamp
	PYTHON=$(PY) STREAMTRAIN_KAFKA_LIBS=$(KAFKA_LIBS) bash deploy/gpu/payload.sh

clean:
	rm -rf $(VENV) .cache deploy/kafka/target site
