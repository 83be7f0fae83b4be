# patchplace — the two commands: `make demo` and `make test`. Each does all set-up on a fresh machine
# (Debian packages, .venv, pip installs) and skips what is already there on a second run.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV     := .venv
PY       := $(VENV)/bin/python
PIP      := $(PY) -m pip --disable-pip-version-check
APT_PKGS := dataset-fashion-mnist espeak-ng
LIBRARIES := packages/data packages/models packages/objectives packages/finetune
PACKAGES := $(LIBRARIES) export pipelines research
# ONNX Runtime flavour of patchplace-export: cpu (onnxruntime) or gpu (onnxruntime-gpu: CUDA + CPU providers);
# one of them, never both (`make setup ORT=gpu` on a CUDA machine switches an existing .venv over)
ORT      ?= cpu
SHARDS   := shards
CORPORA  := corpora
# torch's wheel index: empty keeps pip's configured one (a local wheel store, PyPI: on Linux the CUDA build, ~5 GB
# with its nvidia-* wheels); `make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu` takes the CPU build
TORCH_INDEX ?=

.PHONY: help setup apt venv demo study study-v5 study-gpu \
        benchmark data test package-tests lint clean

help:
	@echo "make demo   set everything up, then run the main job on the built-in data"
	@echo "make test   set everything up, then run every package's tests and the end-to-end tests"
	@echo "make study  the reproduction study v5's CPU rows in the pre-registered order (research/protocols/study_v5.yaml; results/study_v5.md; resumable; ~570 process-min; docs/study.md)"
	@echo "make study-v5  the same as make study"
	@echo "make study-gpu  study v5's GPU share, the 4 px position claims (refused until the protocol's GPU sizing is recorded; docs/study.md)"
	@echo "make benchmark  speed / memory benchmarks (results/benchmark.md)"

setup: apt venv

# Debian packages: installed when missing; without root or sudo, stop with the exact command to run.
apt:
	@missing=""; for p in $(APT_PKGS); do dpkg -s "$$p" >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then SUDO=""; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo"; \
	else echo "error: missing Debian packages:$$missing; run: sudo apt-get update && sudo apt-get install -y$$missing" >&2; exit 1; fi; \
	$$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q $$missing

venv: $(VENV)/.installed-$(ORT)

$(VENV)/.installed-$(ORT): pyproject.toml $(addsuffix /pyproject.toml,$(PACKAGES))
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q torch==2.14.1 torchvision==0.29.1 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	@other=$$([ "$(ORT)" = gpu ] && echo onnxruntime || echo onnxruntime-gpu); \
	if $(PIP) show "$$other" >/dev/null 2>&1; then echo "ORT=$(ORT): removing $$other (one runtime only)"; \
	$(PIP) uninstall -y -q "$$other" && $(PIP) install -q --force-reinstall --no-deps \
	"$$([ "$(ORT)" = gpu ] && echo onnxruntime-gpu || echo onnxruntime)"; fi
	@# hatchling and its build requirements, for tests that build the packages offline (tests/test_install.py)
	@test -d $(VENV)/wheelhouse || { rm -rf $(VENV)/wheelhouse.part && \
	  $(PIP) download -q -d $(VENV)/wheelhouse.part hatchling editables && mv $(VENV)/wheelhouse.part $(VENV)/wheelhouse; }
	@# PATCHPLACE_SIBLING_SPEC empty: a sibling is required by name, so the -e of this same command provides it
	@# (pip refuses an editable beside a direct reference to the same path: pypa/pip#10216); editable_mode=compat
	@# is for the setuptools-built workspace root, hatchling's editables add src/ to sys.path by themselves
	@# Each [test] extra holds the optional stacks its suite covers (data's [audio], finetune's [privacy], export's
	@# [corruptions,audio]); the pipelines require every extra they run
	@# The libraries first; the pipelines and the research code, which require patchplace-export by name, once it
	@# is installed (a fresh venv's pip 23.2 found no patchplace-export for them beside the `-e 'export[...]'` of one command)
	PATCHPLACE_SIBLING_SPEC= $(PIP) install -q --config-settings editable_mode=compat -e '.[dev]' \
	  $(foreach p,$(LIBRARIES),-e '$(p)[test]') -e 'export[test,$(ORT)]'
	PATCHPLACE_SIBLING_SPEC= $(PIP) install -q -e 'pipelines[test]' -e 'research[test]'
	@rm -f $(VENV)/.installed $(VENV)/.installed-*; touch $@

# ---------------------------------------------------------------------------------------------- demo
# Each split appears atomically; the recipes write these splits last, so they mark a finished run.
FMNIST_MANIFEST := $(SHARDS)/fashion_mnist/test/manifest.json
KWS_MANIFEST    := $(SHARDS)/spoken_keywords/background_noise/manifest.json
KWS_CORPUS      := $(CORPORA)/spoken_keywords/validation_list.txt

$(FMNIST_MANIFEST): | setup
	$(PY) data/fashion_mnist.py --out $(SHARDS)/fashion_mnist

$(KWS_CORPUS): | setup
	$(PY) data/spoken_keywords.py --out $(CORPORA)/spoken_keywords

$(KWS_MANIFEST): $(KWS_CORPUS)
	$(PY) data/speech_commands.py --src $(CORPORA)/spoken_keywords --out $(SHARDS)/spoken_keywords

data: $(FMNIST_MANIFEST) $(KWS_MANIFEST)

# The main job: MP3 pretraining on Fashion-MNIST -> fine-tuning -> evaluation -> ONNX export + ONNX Runtime
# evaluation -> runs/demo/report.md (~13 min on
# 2 CPU cores; resumable: run it again after an interruption). Budget knobs: see `python pipelines/demo.py --help`.
demo: setup data
	$(PY) -m patchplace.data verify $(SHARDS)/fashion_mnist $(SHARDS)/spoken_keywords
	$(PY) pipelines/demo.py --out runs/demo

# Study v5, pre-registered (research/protocols/study_v5.yaml): seed 0 of the position rows, the doubling rule on
# validation (results/study_v5_decisions.json), every seed at the decided epochs, MJP Table 1, speech; resumable.
# Refused (one line) while the protocol is not committed. -> results/study_v5.{json,md}
STUDY_JOBS ?= 2
study study-v5: setup data
	$(PY) pipelines/study.py --jobs $(STUDY_JOBS) --config pipelines/configs/study_v5.yaml

# Study v5's GPU share (the 4 px position claims); refused in one line until its epochs are sized on the GPU itself
STUDY_GPU_JOBS ?= 4
study-gpu: setup data
	$(PY) pipelines/study.py --jobs $(STUDY_GPU_JOBS) --config pipelines/configs/study_v5_gpu4px.yaml

benchmark: setup data
	$(PY) pipelines/benchmark.py --suite all --out results

# ---------------------------------------------------------------------------------------------- test
lint: setup
	$(VENV)/bin/ruff check .

# the suite on TEST_WORKERS processes (pytest-xdist), a test file per worker at a time (its module fixtures built
# once), the longest files first (tests/conftest.py); every test runs one intra-op thread (conftest.py).
# `$(PY) -m pytest -m "not slow"`: the unit and package tests alone (~2.5 min on 2 cores)
TEST_WORKERS ?= 2
# The end-to-end suite (tests/) on xdist workers, then each package's own suite once (package-tests); a bare
# `pytest` at the root still collects both (pyproject's testpaths)
test: setup lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests
	$(MAKE) --no-print-directory package-tests

# Each package's suite as the README types it: `pytest` in the package's folder, with the machine's default threads
# (no root conftest, no thread pin), so a suite that passes only under the root suite's one thread cannot land.
# Two lanes at once, each printed when it ends: export's suite, and the libraries' suites in turn. A suite alone
# keeps about one core busy (measured: 1.1 of 2), so the two lanes take the longer one's time; OMP_WAIT_POLICY=PASSIVE
# lets one suite's idle OpenMP threads sleep while the other computes (spinning, objectives took 2.7x as long beside
# export; the thread count is unchanged).
PACKAGE_LANES := "$(LIBRARIES)" export
package-tests: setup
	@suites() { for p in $$1; do echo "== $$p: pytest (from its folder, default threads)"; \
	  (cd $$p && env -u OMP_NUM_THREADS -u PATCHPLACE_TEST_THREADS OMP_WAIT_POLICY=PASSIVE \
	    $(abspath $(VENV))/bin/pytest -q -p no:cacheprovider) || return 1; done; }; \
	logs=$$(mktemp -d); pids=""; \
	for lane in $(PACKAGE_LANES); do log=$$logs/$$(echo $$lane | tr ' /' '__').log; \
	  { suites "$$lane" > $$log 2>&1 && code=0 || code=$$?; cat $$log; exit $$code; } & pids="$$pids $$!"; done; \
	failed=0; for pid in $$pids; do wait $$pid || failed=1; done; rm -rf $$logs; exit $$failed

clean:
	rm -rf $(SHARDS) $(CORPORA) .pytest_cache
