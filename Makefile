# Two commands matter: `make demo` and `make test` (which runs `make lint` first). Both run `make setup` first, which is
# idempotent: a second run only checks stamps and costs seconds.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
KAFKA_VERSION := 4.1.1
KAFKA_LIBS := .cache/kafka/$(KAFKA_VERSION)/libs

.PHONY: setup lint test demo kafka clean
.DEFAULT_GOAL := setup

setup: $(VENV)/.stamp $(KAFKA_LIBS)/.stamp .cache/prometheus.stamp

# torchrec is installed with --no-deps: its metadata asks for the CUDA fbgemm-gpu, which fails to
# import without an NVIDIA driver and collides with fbgemm-gpu-cpu (both ship `fbgemm_gpu`).
$(VENV)/.stamp: requirements/cpu.txt requirements/dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=24" "setuptools>=77"
	$(PY) -m pip install --quiet -r requirements/cpu.txt -r requirements/dev.txt
	$(PY) -m pip install --quiet --no-deps torchrec==1.8.0
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
lint: $(VENV)/.stamp
	$(VENV)/bin/ruff check streamtrain tests
	$(VENV)/bin/ruff format --check streamtrain tests
	$(VENV)/bin/mypy

test: setup lint
	$(PY) -m pytest -ra tests

demo: setup
	$(PY) -m streamtrain demo

kafka: setup
	$(PY) -m streamtrain dev-kafka --topic clicks

clean:
	rm -rf $(VENV) .cache deploy/kafka/target
