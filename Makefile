# kvevents: `make test` bootstraps everything it needs (a .venv, the packages, Kafka's jars).
# Needs python3.11 (or python3 >= 3.11), java >= 17, mvn and gcc on PATH; nothing else.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvevents-installed
PYTEST_ARGS ?=
# What `make setup` installs: the dev extras, and NVIDIA Dynamo's runtime (bench-dynamo, a ~75 MB
# wheel) for bench/index.py and the Dynamo agreement test, which must run (never skip) in CI.
EXTRAS ?= dev,bench-dynamo

# Tests spawn mpiexec (from PyPI's mpich) and the kvevents CLI: both live in the venv.
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: setup test lint test-spark spark bench faults soak demo broker-start broker-stop broker-status registry-start registry-stop clean distclean

setup: $(STAMP)

# Reinstalled when the packaging or a compiled extension's source changes.
$(STAMP): pyproject.toml setup.py $(wildcard schemas/*.pyx schemas/*.pxd schemas/*.pxi producer/*.pyx producer/bridge/*.pyx producer/bridge/*.pxd producer/bridge/*.pxi consumer/*.pyx consumer/*.pxd consumer/*.pxi consumer/export/*.pyx kvevents/commands/*.pyx)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS)]'
	@touch $@

# The Kafka fixture in tests/conftest.py starts (and stops) the broker the tests need.
test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The Spark job (kvevents.analytics.spark_job) needs the spark extra: pyspark 4.2, ~490 MB, so it
# is not in dev; these targets install it once. Its test is marked 'spark' and deselected by
# 'make test' (addopts -m "not spark"); it runs Spark in local mode against the real broker.
SPARK_STAMP := $(VENV)/.kvevents-spark-installed
$(SPARK_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS),spark]'
	@touch $@

# Mutation fuzzing of the readers of outside input (bridge payloads, Kafka values, registry
# framings, route --serve bodies, TensorRT-LLM dicts): tests marked 'soak', deselected by
# 'make test' (which runs a half-second smoke of each).
SOAK_SECONDS ?= 60
soak: setup
	SOAK_SECONDS=$(SOAK_SECONDS) $(BIN)/python -m pytest -m soak -s tests/soak $(PYTEST_ARGS)

test-spark: $(SPARK_STAMP)
	$(BIN)/python -m pytest -m spark tests/integration/test_spark_job.py $(PYTEST_ARGS)

# The Spark job once over the topic (KAFKA_BOOTSTRAP_SERVERS or the local broker) into SPARK_OUT.
SPARK_OUT ?= .kvevents/spark-export
SPARK_ARGS ?=
spark: $(SPARK_STAMP)
	$(BIN)/kvevents export spark $(SPARK_OUT) $(SPARK_ARGS)

# Every check runs, so that one run shows every finding; mypy's settings are in pyproject.toml,
# and stubtest checks the compiled modules' .pyi stubs against the built extensions.
COMPILED_MODULES := kvevents.schemas._fastcodec kvevents.producer._fastrecorder kvevents.producer._gatherscan kvevents.consumer._indexcore \
	kvevents.consumer._statejoin kvevents.consumer.export._packtokens kvevents.commands._route_fast kvevents.producer.bridge._fastconvert
lint: setup
	@status=0; \
	echo "== ruff check ."; $(BIN)/ruff check . || status=1; \
	echo "== ruff format --check ."; $(BIN)/ruff format --check . || status=1; \
	echo "== mypy"; $(BIN)/mypy || status=1; \
	echo "== stubtest"; $(BIN)/python -m mypy.stubtest --concise --allowlist stubtest_allowlist.txt \
		$(COMPILED_MODULES) || status=1; \
	exit $$status

# bench/route_serve.py drives the router with wrk (Debian's package; no PyPI or Maven build).
bench: setup
	@command -v wrk >/dev/null || { echo "installing wrk (apt-get) for bench/route_serve.py"; \
		apt-get install -y -q wrk >/dev/null || sudo apt-get install -y -q wrk >/dev/null; }
	@set -e; found=0; for script in bench/*.py; do \
		[ -e "$$script" ] || continue; found=1; \
		echo "== $$script"; $(BIN)/python "$$script"; \
	done; [ $$found = 1 ] || echo "no benchmark in bench/ yet"

# The fault suite against real processes (each case starts its own brokers on free ports): broker,
# rank and consumer SIGKILLs, overload, hostile messages, a full disk; prints the table and writes
# bench/results/faults.json (docs/RELIABILITY.md). FAULTS_ARGS="--quick" or "--only rank-kill,...".
FAULTS_ARGS ?=
faults: setup
	$(BIN)/python -m faults $(FAULTS_ARGS)

# The whole pipeline on this machine: local broker (started and stopped unless one is
# configured), 2 instances x 4 attention-DP ranks under mpiexec for DEMO_DURATION seconds,
# the index rebuilt from Kafka and checked against the ground truth, routing evaluated.
DEMO_DURATION ?= 30
DEMO_ARGS ?=
demo: setup
	$(BIN)/kvevents demo --duration $(DEMO_DURATION) $(DEMO_ARGS)

# A broker for working by hand; state in ./.kvevents/broker (see `kvevents broker --help`).
broker-start: setup
	$(BIN)/kvevents broker start

broker-stop:
	@if [ -x $(BIN)/kvevents ]; then $(BIN)/kvevents broker stop; fi

broker-status: setup
	@$(BIN)/kvevents broker status || true

# A schema registry for working by hand (Apicurio, Confluent-compatible API); see `kvevents registry --help`.
registry-start: setup
	$(BIN)/kvevents registry start

registry-stop:
	@if [ -x $(BIN)/kvevents ]; then $(BIN)/kvevents registry stop; fi

# Build outputs, caches and the local broker's state; `make distclean` drops the venv too.
clean: broker-stop registry-stop
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache .mypy_cache .hypothesis .kvevents
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +
	rm -f schemas/_*.c producer/_*.c consumer/_*.c $(STAMP)
	find schemas producer consumer -name '*.so' -delete

distclean: clean
	rm -rf $(VENV)
