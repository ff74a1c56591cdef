# Two commands after cloning: `make demo` and `make test`. Both create .venv if it is missing.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?= -n 2 --dist worksteal --durations=25

.PHONY: demo test test-gpu gpu-check notebooks clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || { base=$$(tools/find-python) && echo "creating $(VENV) with $$base" && $$base -m venv $(VENV); }
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m k3jax.demo

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# On a Hopper machine: the same suite compiled (gpu-marked tests run, interpret tests too).
test-gpu:
	PYTHONPATH=. python3 -m pytest -m gpu -p no:cacheprovider

# On a Hopper machine with the image's python3: GPU tests, randomized tests (GPU budget), the demo and each
# benchmark's quick mode, summarised in one table (gpu-check-out/gpu-check.md). GPU_CHECK_ARGS picks sections.
gpu-check:
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} python3 tools/gpu_check.py $(GPU_CHECK_ARGS)

# Re-execute every notebook from a clean kernel and store its outputs (what readers see on the code host).
notebooks: $(STAMP)
	$(PY) notebooks/run.py --write

clean:
	rm -rf $(VENV) .pytest_cache
