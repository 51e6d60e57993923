# amp_patch: the two README commands (demo, test) and their set-up.
#
#   make demo            compare O0-O3 and torch.autocast on the built-in model (60 steps;
#                        make demo DEMO_ARGS=--full for the 100 steps of docs/compare.md)
#   make test            lint (ruff), type check (mypy), then the full pytest suite (slow cases
#                        included; the import-graph check and the docstring examples with it)
#   make test-fast       the same without the cases marked slow
#   make lint            ruff and mypy alone
#   make bench           kernel, end-to-end and lean-state benchmarks -> docs/benchmarks.md
#   make check-cuda      compile the CUDA kernels against a CUDA build of torch (no GPU needed)
#   make test-hosts      the host-sensitive tests (tests/cli, tests/cpu_half, timm's resume) under
#                        each CPU host kind, native, conv-only and none, forced by oneDNN's and
#                        ATen's ISA caps (amp_patch.patching.cpu_half.FORCED_KIND_ENV; docs/install.md);
#                        run it when a change touches those paths (slow; not part of `make test`)
#   make test-matrix     the suite on torch 2.6.0, 2.9.1, 2.13.0 and 2.14.1, one venv each, cached
#                        outside the checkout (TORCH_VERSIONS="2.6.0 2.14.1" for fewer; slow,
#                        several GB per version; not part of `make test`)
#
# By default a virtual environment is made in .venv with pinned torch (CPU).
# To use an interpreter that already has torch (a GPU machine, say), pass it:
#   make test PY=python3
# Then only the package itself is installed into it (--no-deps).

SHELL := /bin/bash
PY ?=
DEMO_ARGS ?=
VENV := .venv
CUDA_VENV := .venv-cuda
CUDA_HOME ?= /usr/local/cuda
MAX_JOBS ?= 2
export MAX_JOBS

ifeq ($(strip $(PY)),)
PYTHON := $(VENV)/bin/python
ENV_STAMP := $(VENV)/.deps-stamp
else
PYTHON := $(PY)
ENV_STAMP :=
endif

EXT_SOURCES := setup.py pyproject.toml amp_patch/_buildspec.py $(shell find csrc -type f 2>/dev/null)
EXT_STAMP := build/.ext-stamp-$(subst /,_,$(PYTHON))

.PHONY: demo test test-fast test-hosts lint test-matrix bench check-cuda install clean

# OpenNMT-py (tests/apex_compat/test_opennmt.py) goes last, with the pinned torch as a constraint so that
# nothing can replace it; if it cannot be installed, the venv stays as it is and the test skips.
$(VENV)/.deps-stamp: requirements-dev.txt requirements-nodeps.txt requirements-onmt.txt \
		requirements-onmt-nodeps.txt
	@test -x $(VENV)/bin/python || python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -r requirements-dev.txt
	$(VENV)/bin/python -m pip install -q --no-deps -r requirements-nodeps.txt
	$(VENV)/bin/python -m pip install -q -r requirements-onmt.txt -c requirements-dev.txt \
		&& $(VENV)/bin/python -m pip install -q --no-deps -r requirements-onmt-nodeps.txt \
		|| echo "make: OpenNMT-py's packages did not install; tests/apex_compat/test_opennmt.py will skip"
	@touch $@

# AMP_PATCH_BUILD_EXT=1: compile amp_patch._C now, against this environment's torch (a plain
# `pip install .` ships the sources and compiles them on first import instead; docs/install.md).
$(EXT_STAMP): $(ENV_STAMP) $(EXT_SOURCES)
	@mkdir -p build
	AMP_PATCH_BUILD_EXT=1 $(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .
	@touch $@

install: $(EXT_STAMP)

demo: install
	$(PYTHON) -m amp_patch compare --out out $(DEMO_ARGS)

# ruff and mypy come with requirements-dev.txt; an interpreter passed as PY= may lack them.
lint: $(ENV_STAMP)
	@if $(PYTHON) -c "import ruff, mypy" 2>/dev/null; then \
		$(PYTHON) -m ruff check amp_patch tools tests conftest.py && $(PYTHON) -m mypy; \
	elif [ -n "$(strip $(PY))" ]; then \
		echo "lint: skipped, ruff and mypy are not installed in $(PYTHON) (pip install ruff mypy)"; \
	else \
		echo "lint: ruff and mypy are missing from $(VENV); rm $(VENV)/.deps-stamp and rerun"; exit 1; \
	fi

test: install lint
	AMP_PATCH_REQUIRE_EXT=1 $(PYTHON) -m pytest -q

test-fast: install lint
	AMP_PATCH_REQUIRE_EXT=1 $(PYTHON) -m pytest -q -m "not slow"

# Each kind in a fresh environment (the caps are read once, when torch loads); a cap only lowers a
# host, so on an AVX2 host all three runs are of the none kind: the line before each run says
# which kind the detection found. HOST_KINDS="conv-only" runs one; HOST_TESTS picks the tests.
HOST_KINDS ?= native conv-only none
HOST_TESTS ?= tests/cli tests/cpu_half tests/apex_compat/test_timm_apex.py
test-hosts: install
	@set -e; for kind in $(HOST_KINDS); do \
		caps=$$($(PYTHON) -c "import sys; from amp_patch.patching.cpu_half import FORCED_KIND_ENV as e; \
			print(' '.join(f'{k}={v}' for k, v in e[sys.argv[1]].items()))" $$kind); \
		found=$$(env -u ONEDNN_MAX_CPU_ISA -u ATEN_CPU_CAPABILITY -u AMP_PATCH_CPU_HALF_NATIVE $$caps \
			$(PYTHON) -c "import amp_patch; print(amp_patch.cpu_half_support().bfloat16.kind)"); \
		echo "test-hosts: $$kind ($${caps:-no caps}): the detection finds bf16 host kind $$found"; \
		env -u ONEDNN_MAX_CPU_ISA -u ATEN_CPU_CAPABILITY -u AMP_PATCH_CPU_HALF_NATIVE $$caps \
			AMP_PATCH_REQUIRE_EXT=1 $(PYTHON) -m pytest -q $(HOST_TESTS); \
	done

# tools/test_matrix.sh: a venv per torch version under ~/.cache/amp_patch/venvs (MATRIX_DIR).
TORCH_VERSIONS ?=
test-matrix:
	tools/test_matrix.sh $(TORCH_VERSIONS)

bench: install
	$(PYTHON) -m amp_patch bench

# Compiles csrc/ (CPU and CUDA) against torch 2.14.1, a CUDA 13.0 build, in a
# separate venv. Nothing is installed into the project's environment.
$(CUDA_VENV)/.deps-stamp: requirements-cuda.txt
	@test -x $(CUDA_VENV)/bin/python || python3 -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/python -m pip install -q --upgrade pip
	$(CUDA_VENV)/bin/python -m pip install -q -r requirements-cuda.txt
	@touch $@

check-cuda: $(CUDA_VENV)/.deps-stamp
	@site=$$($(CUDA_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	start=$$(date +%s); \
	PATH="$(CURDIR)/$(CUDA_VENV)/bin:$$PATH" CUDA_HOME=$(CUDA_HOME) \
	CPATH=$$site/nvidia/cu13/include$${CPATH:+:$$CPATH} \
	TORCH_CUDA_ARCH_LIST="$${TORCH_CUDA_ARCH_LIST:-9.0}" \
	AMP_PATCH_BUILD_EXT=1 $(CUDA_VENV)/bin/python setup.py -q build_ext --build-temp build/cuda-check/tmp --build-lib build/cuda-check/lib \
	&& ls build/cuda-check/lib/amp_patch/_C*.so >/dev/null \
	&& echo "check-cuda: CPU and CUDA kernels compiled (TORCH_CUDA_ARCH_LIST=$${TORCH_CUDA_ARCH_LIST:-9.0}) in $$(( $$(date +%s) - start )) s"

clean:
	rm -rf build dist *.egg-info amp_patch/_C*.so out
