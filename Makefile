# `make test` and `make demo` work on a fresh machine: the venv is created on first use.
# torch is installed first, pinned to the CPU build on disk, so pip never pulls a CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.shardgen-installed
TORCH_SPEC ?= torch==2.13.0
export OMP_NUM_THREADS ?= 1
# DeepSpeed's JIT-built communication op lives with this venv: torch keys its build directory by
# name only, so two venvs (two clones) sharing ~/.cache/torch_extensions rebuild it in turn, and
# a rank killed mid-build leaves torch's lock file, on which every later DeepSpeed init waits.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions

.PHONY: install test lint demo bench fuzz gpu clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev,deepspeed,plot,trl]"
	# DeepSpeed JIT-builds its CPU communication op at its first init (about half a minute):
	# build it here, once, so no test's timeout can kill ranks mid-build (torch's build lock
	# would stay behind, and every later DeepSpeed init wait on it).
	DS_ACCELERATOR=cpu timeout 900 $(BIN)/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	touch $@

install: $(STAMP)

# ruff, then the layer contracts of pyproject.toml ([tool.importlinter]): an upward import fails.
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks scripts examples
	$(BIN)/lint-imports

# Three workers on 2 cores, one test file each at a time (a file keeps its spawned worlds on one
# worker; the test ranks are forked from a server that imported torch once, tests/helpers/world.py). The
# suite is CPU-bound: on one clean clone, 3 workers took 677 s and 4 workers 761 s, so its time
# comes down only by computing less (the heaviest launched jobs whose paths other tests cover
# run in `make fuzz`, marked `long`).
# The longest files (launched jobs, examples, multi-tower models: 40-150 s each) go first, in this
# order, so no worker starts one at the end (xdist's own order puts files with few tests last).
LONGEST := tests/multirank/test_slurm_example.py tests/multirank/test_cli.py \
	tests/multirank/test_journal_faults.py tests/multirank/test_towers.py tests/multirank/test_engine_multirank.py \
	tests/multirank/test_cli_demo.py tests/multirank/test_examples.py tests/multirank/test_arch_matrix.py \
	tests/multirank/test_cli_launcher.py tests/multirank/test_trl_tools.py tests/multirank/test_encdec.py \
	tests/multirank/test_trl.py tests/multirank/test_stationary.py tests/multirank/test_examples_rl.py \
	tests/multirank/test_invariant_numerics.py tests/multirank/test_faults.py \
	tests/multirank/test_liveness.py tests/multirank/test_integrations_deepspeed.py \
	tests/multirank/test_deepspeed_backend.py tests/multirank/test_clean_exit.py tests/multirank/test_bench.py \
	tests/multirank/test_readme.py tests/multirank/test_user_faults.py tests/multirank/test_doc_snippets.py \
	tests/multirank/test_rollout_multirank.py
# The slowest tests listed at the end (`make test DURATIONS=0` lists every one).
DURATIONS ?= 25
# `make test CPU=1`: the CPU seconds of each test's process tree (its ranks and launched jobs
# included), the costliest files and tests at the end, every test in cpu-report.jsonl
# (tests/helpers/cpu_report.py). Wall durations mostly measure waiting for the cores here.
CPU ?=
CPU_REPORT := $(if $(CPU),-p cpu_report)
CPU_PATH := $(if $(CPU),PYTHONPATH=$(CURDIR)/tests/helpers$(if $(PYTHONPATH),:$(PYTHONPATH)))
# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE, set on
# some machines): the suite starts about a hundred Python processes, each of which would compile
# shardgen and the test helpers again, and pytest would rewrite the test files in every worker.
test: $(STAMP) lint
	$(CPU_PATH) PYTHONDONTWRITEBYTECODE= SHARDGEN_TEST_SMALL_ROWS=1 $(BIN)/python -m pytest -q -p no:cacheprovider $(CPU_REPORT) -n 3 --dist loadfile --no-loadscope-reorder --durations=$(DURATIONS) \
		-m "not bigworld and not long" $(LONGEST) tests

demo: $(STAMP)
	$(BIN)/shardgen demo

# Every input surface with 10,000 examples each (tests/unit/test_input_fuzz.py); random schedules on
# 2-4 ranks (tests/helpers/fuzz.py), N from seed SEED0; the fault cases at 5-8 ranks and the long
# reliability cases (journal faults; the soaks of tests/multirank/test_soak.py: 20,000 prompts, 5,000
# calls, 200 engines; the shipped tool model trained again; the stationary ZeRO-Inference example;
# the examples under torchrun and the DeepSpeed launcher; the rest of the architecture, backend and
# gather-mode cross products that `make test` covers case by case); the two-agent torchrun job 10 times.
N ?= 1000
SEED0 ?= 0
fuzz: $(STAMP)
	SHARDGEN_FUZZ_PROFILE=fuzz $(BIN)/python -m pytest -q -p no:cacheprovider --timeout 3600 --hypothesis-show-statistics tests/unit/test_input_fuzz.py
	$(BIN)/python tests/helpers/fuzz.py --n $(N) --seed0 $(SEED0) --json fuzz-summary.json
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "bigworld or long" tests/multirank/test_faults.py tests/multirank/test_journal_faults.py
	$(BIN)/python -m pytest -q -p no:cacheprovider -m long tests/multirank/test_soak.py tests/multirank/test_trl_tools.py tests/multirank/test_examples.py \
		tests/multirank/test_examples_rl.py tests/multirank/test_cli_launcher.py tests/multirank/test_cli_demo.py tests/multirank/test_readme.py tests/multirank/test_cli.py \
		tests/multirank/test_trl.py tests/multirank/test_stationary.py tests/multirank/test_towers.py tests/multirank/test_encdec.py \
		tests/multirank/test_engine_multirank.py tests/multirank/test_turns_multirank.py tests/multirank/test_invariant_numerics.py \
		tests/multirank/test_rollout_multirank.py
	$(BIN)/python tests/helpers/two_agents.py 10

# Every method side by side at 2 and 4 ranks (about 6 minutes on 2 cores); see docs/PERFORMANCE.md.
bench: $(STAMP)
	$(BIN)/shardgen bench --json bench.json --timeline bench.png

# One GPU, a few minutes: the GPU-marker tests, then every gather mode at world size 1 on CUDA
# (bf16) and a ~1B decode against HF generate(), as JSON (gpu.json). Needs a CUDA torch.
gpu: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m gpu tests/multirank/test_gpu.py
	$(BIN)/python -m torch.distributed.run --nproc-per-node=1 benchmarks/gpu_check.py --json gpu.json

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
