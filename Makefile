# Two commands after cloning: `make demo` and `make test`. Both create .venv if it is missing.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
AOT := .aot
AOT_STAMP := $(AOT)/.installed
PYTEST_ARGS ?= -n 2 --dist worksteal --durations=25

.PHONY: demo test test-gpu gpu-check notebooks clean venv aot

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || { base=$$(tools/find-python) && echo "creating $(VENV) with $$base" && $$base -m venv $(VENV); }
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

# The CUDA PJRT plugin of the venv's jaxlib, installed beside the venv, not in it: tools/sm90_compile.py compiles for
# the H200 with it on a machine without a GPU, and no other process of the suite sees a CUDA plugin. nvdisasm
# (which the machine's CUDA lacks) lets it dump SASS (--sass).
aot: $(AOT_STAMP)

$(AOT_STAMP): $(STAMP) Makefile
	v=$$($(PY) -c 'import jaxlib; print(jaxlib.__version__)') && $(PY) -m pip install --quiet --no-deps --upgrade \
	  --target $(AOT) "jax-cuda13-plugin==$$v" "jax-cuda13-pjrt==$$v" "nvidia-cuda-nvdisasm==13.5.37"
	@touch $(AOT_STAMP)

demo: $(STAMP)
	$(PY) -m k3jax.demo

test: $(STAMP) $(AOT_STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# On a Hopper machine: the same suite compiled (gpu-marked tests run, interpret tests too).
test-gpu:
	PYTHONPATH=. python3 -m pytest -m gpu -p no:cacheprovider

# On a Hopper machine with the image's python3: GPU tests, randomized tests (GPU budget), the demo and each
# benchmark's quick mode, summarised in one table (gpu-check-out/gpu-check.md). GPU_CHECK_ARGS picks sections
# (--sections), or splits the check over several calls (--budget S --resume; BUILD.md).
gpu-check:
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} python3 tools/gpu_check.py $(GPU_CHECK_ARGS)

# Re-execute every notebook from a clean kernel and store its outputs (what readers see on the code host).
notebooks: $(STAMP)
	$(PY) notebooks/run.py --write

clean:
	rm -rf $(VENV) $(AOT) .pytest_cache
