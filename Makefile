# Two commands for a fresh machine: `make demo` (the main job) and `make test` (every test).
# Both create the virtual environment they need: torch 2.13.0 (CPU build here) before deepspeed 0.19.8,
# then this package with `pip install .` (the activation .pth needs a real install, not -e).

PYTHON ?= python3
# Another Python (make test-versions' Python rows): PY_VERSION=3.13 takes pyenv's 3.13.x (or python3.13 on
# PATH) and its own venv, .venv-py3.13.
PY_VERSION ?=
PYTHON_VERSIONS := 3.10 3.11 3.12 3.13
PYENV_ROOT ?= $(HOME)/.pyenv
ifneq ($(PY_VERSION),)
PYTHON := $(or $(lastword $(wildcard $(PYENV_ROOT)/versions/$(PY_VERSION).*/bin/python$(PY_VERSION))),python$(PY_VERSION))
endif
# Extra pip arguments for torch. The package mirror CI uses serves the CPU build of 2.13.0; from PyPI a
# Linux machine gets the multi-GB CUDA build, so on a CPU-only machine elsewhere pass
# TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu".
TORCH_PIP_ARGS ?=
# Upstream release to test against: any of src/deepspeed_zero3/_compat.py's SUPPORTED_DEEPSPEED_VERSIONS, each in
# its own venv (the default keeps .venv); e.g. make test DEEPSPEED_VERSION=0.19.4.
SUPPORTED_DEEPSPEED_VERSIONS := $(shell sed -n 's/^SUPPORTED_DEEPSPEED_VERSIONS = //p' src/deepspeed_zero3/_compat.py | tr -d '(),"')
DEFAULT_DEEPSPEED_VERSION := 0.19.8
DEEPSPEED_VERSION ?= $(DEFAULT_DEEPSPEED_VERSION)
ifeq ($(filter $(DEEPSPEED_VERSION),$(SUPPORTED_DEEPSPEED_VERSIONS)),)
$(error DEEPSPEED_VERSION=$(DEEPSPEED_VERSION) is not supported; pick one of: $(SUPPORTED_DEEPSPEED_VERSIONS))
endif
# torch to run on: the default venv has 2.13.0; another release gets its own venv (PyPI's Linux builds of
# torch are CUDA builds of several GB; they run on a CPU too). TORCH_VERSIONS is the measured matrix
# (make test-versions, docs/compat/versions.md): each minor series at its newest patch. It is _compat.py's
# MEASURED_TORCH_VERSIONS (setup.py's torch range), spelled out here because .ci/run reads its last entry.
DEFAULT_TORCH_VERSION := 2.13.0
TORCH_VERSION ?= $(DEFAULT_TORCH_VERSION)
TORCH_VERSIONS := 2.11.0 2.12.1 2.13.0 2.14.1 2.15.0
# .venv for the defaults; else .venv-<release>, .venv-torch<version>, .venv-<release>-torch<version>, each with
# -py<version> for another Python.
VENV_SUFFIX := $(if $(filter-out $(DEFAULT_DEEPSPEED_VERSION),$(DEEPSPEED_VERSION)),-$(DEEPSPEED_VERSION))$(if \
	$(filter-out $(DEFAULT_TORCH_VERSION),$(TORCH_VERSION)),-torch$(TORCH_VERSION))$(if $(PY_VERSION),-py$(PY_VERSION))
VENV ?= .venv$(VENV_SUFFIX)
ifneq ($(VENV_SUFFIX),)
# The op cache is per environment: one shared between them is rebuilt by each of them in turn.
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/.torch_extensions
endif
ifneq ($(TORCH_VERSION),$(DEFAULT_TORCH_VERSION))
# Every pip call in that venv holds torch at the version under test: deepspeed and this package accept any
# torch, and a site-wide pip constraint (some machines cap torch below the newest release) is replaced.
TORCH_PIN := $(abspath $(VENV))/torch-pin.txt
export PIP_CONSTRAINT := $(TORCH_PIN)
endif
BIN := $(VENV)/bin
PORT ?= 29500
# Ranks of a test launch (the exact counts are for 2 ranks).
NPROC ?= 2
# The accelerator and the demo's ranks follow torch (tools/launch_plan.py, decided once per venv): cuda with one
# rank per GPU (NCCL), else cpu with 2 ranks (gloo). `make demo NPROC=N` overrides the ranks.
LAUNCH_PLAN = $(shell cat $(VENV)/.launch-plan 2>/dev/null)
ACCEL = $(or $(word 1,$(LAUNCH_PLAN)),cpu)
DEMO_NPROC = $(if $(filter command line environment,$(origin NPROC)),$(NPROC),$(or $(word 2,$(LAUNCH_PLAN)),2))
# Each environment builds DeepSpeed's CPU comm op once; a shared cache is rebuilt by every other environment.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.torch_extensions
export DS_ACCELERATOR ?= $(ACCEL)
export PYTHONUNBUFFERED := 1
LAUNCH = $(BIN)/deepspeed --num_gpus $(NPROC) --master_port $(PORT)
# Upstream's CPU shm allreduce leaves a 66 MB buffer per rank in /dev/shm (memory) for each port it ran on and
# never unlinks it; a launch on $(PORT) ends by removing them, keeping its exit status.
RELEASE_SHM = status=$$?; rm -f /dev/shm/deepspeed_allreduce_buffer_$$(id -u)_*_$(PORT)_*; exit $$status
DIST_PYTEST = --no_local_rank --module pytest -q -rs -p no:cacheprovider

.PHONY: venv venv-int demo test test-smoke test-smoke-oldest test-parity-smoke test-counts test-smoke-torch test-parity-torch test-counts-torch test-versions test-fresh-install test-unit test-parity test-distributed test-world4 test-integration test-integration-lightning test-integration-hf bench soak clean-locks clean \
	test-gpu gpu-wheels gpu-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(if $(TORCH_PIN),echo "torch==$(TORCH_VERSION)" > $(TORCH_PIN))
	$(BIN)/pip install -q --upgrade pip

# deepspeed is installed without DS_ACCELERATOR: a release built from its sdist (no wheel cached yet) imports the
# accelerator it names in pip's isolated build environment, where there is no torch (0.16.0's cpu one needs it).
$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py $(shell find src -name '*.py' -o -name '*.pth')
	$(BIN)/pip install -q torch==$(TORCH_VERSION) $(TORCH_PIP_ARGS)
	env -u DS_ACCELERATOR $(BIN)/pip install -q deepspeed==$(DEEPSPEED_VERSION)
	$(BIN)/pip install -q ".[test]"
	touch $@

# DeepSpeed's async_io op, for NVMe parameter offload (needs libaio-dev: `apt-get install libaio-dev`; .ci/run
# installs it). Without libaio the NVMe parity scenario records why it could not run.
NVME_OP ?= 1
define AIO_BUILD
from deepspeed.ops.op_builder import AsyncIOBuilder
builder = AsyncIOBuilder()
try:
    if not builder.is_compatible():
        raise RuntimeError("no libaio-dev?")
    builder.load(verbose=False)
except Exception as error:
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    print(f"deepspeed-zero3: async_io op not built ({reason}); NVMe offload tests cannot run here")
endef
export AIO_BUILD

# DeepSpeed's CPU comm op, built once here rather than by the first launch's ranks racing under a test timeout.
$(VENV)/.launch-plan: $(VENV)/.installed
	$(BIN)/python tools/launch_plan.py > $@

$(VENV)/.ops: $(VENV)/.installed $(VENV)/.launch-plan
	@find $(TORCH_EXTENSIONS_DIR) -name lock -delete 2>/dev/null || true
	$(BIN)/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	$(if $(filter 1,$(NVME_OP)),$(BIN)/python -c "$$AIO_BUILD")
	touch $@

venv: $(VENV)/.installed $(VENV)/.launch-plan $(VENV)/.ops

# tests/integration runs the real client libraries (Lightning, transformers, accelerate): installed
# into the same venv afterwards, pinned, with torch and deepspeed held where they are by constraints.
INT_DIR := tests/integration

$(VENV)/.installed-int: $(VENV)/.installed $(INT_DIR)/requirements.txt $(INT_DIR)/constraints.txt
	sed -e 's/^deepspeed==.*/deepspeed==$(DEEPSPEED_VERSION)/' -e 's/^torch==.*/torch==$(TORCH_VERSION)/' \
	  $(INT_DIR)/constraints.txt > $(VENV)/constraints.txt
	$(BIN)/pip install -q -c $(VENV)/constraints.txt -r $(INT_DIR)/requirements.txt
	touch $@

venv-int: $(VENV)/.installed-int

# A build killed midway leaves a lock that makes the next start wait forever.
clean-locks:
	@find $(TORCH_EXTENSIONS_DIR) -name lock -delete 2>/dev/null || true

demo: venv clean-locks
	DS_ACCELERATOR=$(DS_ACCELERATOR) $(BIN)/deepspeed --num_gpus $(DEMO_NPROC) --master_port $(PORT) \
	  examples/train_gpt.py; $(RELEASE_SHM)

test: test-unit test-parity test-distributed test-world4 test-integration

# A quick check of one release or torch (CI runs it on the oldest supported release and the newest torch): the
# unit tests and one 2-rank parity launch per runtime over a few scenarios.
SMOKE_SCENARIOS ?= plain_mlp,train_eval_alternation,zero_init,checkpoint_round_trip,mics_shard_2
test-smoke: test-unit test-parity-smoke

# The smoke on the oldest supported release (CI runs it), in its own venv and op cache (not this make's).
OLDEST_DEEPSPEED_VERSION := $(firstword $(SUPPORTED_DEEPSPEED_VERSIONS))
test-smoke-oldest:
	env -u TORCH_EXTENSIONS_DIR -u PIP_CONSTRAINT $(MAKE) --no-print-directory test-smoke DEEPSPEED_VERSION=$(OLDEST_DEEPSPEED_VERSION)

test-parity-smoke: venv clean-locks
	ZERO3_PARITY_WORLDS=2 ZERO3_PARITY_ONLY=$(SMOKE_SCENARIOS) $(BIN)/python -m pytest -q tests/parity/test_parity.py

# The same for another torch, with the scenarios whose paths go through torch itself: checkpointing and LoRA with
# gradient checkpointing (reentrant and not), z3 leaves and routing, and torch.compile with its three backends.
TORCH_SMOKE_SCENARIOS ?= $(SMOKE_SCENARIOS),activation_checkpointing_frozen,activation_checkpointing_frozen_nonreentrant
TORCH_SMOKE_SCENARIOS := $(TORCH_SMOKE_SCENARIOS),lora_checkpointing_nonreentrant,lora_checkpointing_reentrant
TORCH_SMOKE_SCENARIOS := $(TORCH_SMOKE_SCENARIOS),z3_leaf_modules,moe_expert_leaves_default_persistence
TORCH_SMOKE_SCENARIOS := $(TORCH_SMOKE_SCENARIOS),compile_eager_mlp,compile_aot_eager_mlp,compile_inductor_mlp
test-smoke-torch: test-unit test-parity-torch test-counts-torch

test-parity-torch: venv clean-locks
	ZERO3_PARITY_WORLDS=2 ZERO3_PARITY_ONLY=$(TORCH_SMOKE_SCENARIOS) $(BIN)/python -m pytest -q tests/parity/test_parity.py

# Ours' exact counts where torch decides when a parameter is used: releases at last use in a recompute, and
# persistent parameters under data-dependent routing.
TORCH_COUNT_TESTS ?= tests/distributed/test_recompute_release.py tests/distributed/test_persistence_moe.py
test-counts-torch: venv clean-locks
	$(LAUNCH) $(DIST_PYTEST) $(TORCH_COUNT_TESTS); $(RELEASE_SHM)

# Ours' exact counts on one deepspeed release (make test-versions, a release without the whole suites): all-gather
# calls and numel per pass, peaks, keeping, the end of a backward, and the torch-decided ones above.
COUNT_TESTS ?= tests/distributed/test_comm_counts.py tests/distributed/test_keeping.py \
	tests/distributed/test_backward_end.py $(TORCH_COUNT_TESTS)
test-counts: venv clean-locks
	$(LAUNCH) $(DIST_PYTEST) $(COUNT_TESTS); $(RELEASE_SHM)

# The version matrix (scripts/matrix.py; docs/compat/versions.md): every supported deepspeed release on torch 2.13.0,
# FULL_VERSIONS with the whole suites and the others with the unit tests, the parity smoke and the exact counts;
# every torch of TORCH_VERSIONS and every Python of PYTHON_VERSIONS on deepspeed 0.19.8. One environment per
# (Python, torch) pair, outside the repository, reused across releases and deleted after its last row; a row is
# skipped while it is current, so a stopped pass resumes. Logs in versions-out/<row>/. A subset:
# make test-versions TEST_VERSIONS=0.19.4 TEST_TORCH_VERSIONS= TEST_PYTHON_VERSIONS=  (an empty list skips it)
# MATRIX_ARGS="--commit" commits the table after every row; "--rerun" runs current rows again.
TEST_VERSIONS ?= $(SUPPORTED_DEEPSPEED_VERSIONS)
TEST_TORCH_VERSIONS ?= $(TORCH_VERSIONS)
TEST_PYTHON_VERSIONS ?= $(PYTHON_VERSIONS)
TEST_CLIENTS ?= lightning hf
# The whole suites for the first and last patch of each minor series, where the caller contract or a detected
# feature changes (docs/maintaining.md), and the clients' pinned releases (0.16.9, 0.18.4: their users get the two
# engines, frozen submodules and the rest too); the others get the unit tests, the parity smoke and the exact counts.
FULL_VERSIONS ?= 0.16.0 0.16.3 0.16.4 0.16.9 0.17.0 0.17.6 0.18.0 0.18.1 0.18.4 0.18.9 0.19.0 0.19.3 0.19.4 0.19.8
VERSION_SUITES ?= unit distributed parity
SMOKE_VERSION_SUITES ?= unit parity-smoke counts
TORCH_SUITES ?= unit parity-torch counts-torch
PYTHON_SUITES ?= unit parity-smoke
MATRIX_ARGS ?=
empty :=
space := $(empty) $(empty)
comma := ,
matrix-list = $(if $(strip $(1)),$(subst $(space),$(comma),$(strip $(1))),none)
test-versions:
	$(PYTHON) scripts/matrix.py --deepspeed $(call matrix-list,$(TEST_VERSIONS)) \
	  --torch $(call matrix-list,$(TEST_TORCH_VERSIONS)) --python $(call matrix-list,$(TEST_PYTHON_VERSIONS)) \
	  --clients $(call matrix-list,$(TEST_CLIENTS)) $(MATRIX_ARGS)

# A release as a user installs it (scripts/fresh_install.py; docs/compat/fresh-install.md): for each of
# FRESH_VERSIONS a new venv with torch 2.13.0 and the release, `pip install .`, the release kept, `--check`, a 2-rank
# parity launch per runtime over FRESH_SCENARIOS and two engines over one model; the venv deleted after.
FRESH_VERSIONS ?= 0.16.0 0.16.9 0.17.6 0.18.4 0.19.3
FRESH_SCENARIOS ?= plain_mlp,frozen_eval_submodules,train_eval_alternation,generate_with_a_second_engine_stepping
test-fresh-install:
	$(PYTHON) scripts/fresh_install.py --deepspeed $(call matrix-list,$(FRESH_VERSIONS))

test-unit: venv
	$(BIN)/python -m pytest -q tests/unit

test-parity: venv venv-int clean-locks
	$(BIN)/python -m pytest -q tests/parity

test-distributed: venv clean-locks
	$(LAUNCH) $(DIST_PYTEST) tests/distributed; $(RELEASE_SHM)

# Upstream vs ours side by side (two launches, one at a time): tables on stdout, results.json and plots in bench-out/.
# Options through BENCH_ARGS, e.g. make bench BENCH_ARGS="--model a --steps 8".
bench: venv clean-locks
	$(BIN)/python -m deepspeed_zero3.bench $(BENCH_ARGS)

# Soak (not part of `make test`): 500 steps of training, eval forwards, generation and extra engines over one
# model on 2 ranks; table on stdout, soak-out/soak.json and soak-out/soak.png; exits 1 unless live gathered
# numel, ZeRO hooks and RSS stay flat. Options through SOAK_ARGS, e.g. make soak SOAK_ARGS="--steps 1500".
soak: venv clean-locks
	$(BIN)/python -m deepspeed_zero3.bench.soak $(SOAK_ARGS)

test-integration: venv venv-int clean-locks
	$(BIN)/python -m pytest -q $(INT_DIR)

# The client libraries on the deepspeed their users get (rows of make test-versions): Lightning's `strategies`
# extra allows deepspeed <0.17, so its users get 0.16.9; LLaMA-Factory and open-instruct pin 0.18.4, under the
# Hugging Face Trainer, TRL and peft. E.g. make test-integration-lightning DEEPSPEED_VERSION=0.16.9
LIGHTNING_DEEPSPEED_VERSION := 0.16.9
HF_DEEPSPEED_VERSION := 0.18.4
test-integration-lightning: venv venv-int clean-locks
	$(BIN)/python -m pytest -q $(INT_DIR)/test_lightning.py

test-integration-hf: venv venv-int clean-locks
	$(BIN)/python -m pytest -q $(INT_DIR)/test_hf.py $(INT_DIR)/test_clients.py

test-world4: venv clean-locks
	LOCAL_SIZE=4 $(BIN)/deepspeed --num_gpus 4 --master_port $(PORT) $(DIST_PYTEST) -m world_size tests/distributed; $(RELEASE_SHM)

# GPU checks (world size 1, NCCL, offloaded parameters; docs/maintaining.md "On GPUs"). Without CUDA tests/gpu say so and
# skip, exit 0. GPU_PYTHON picks another interpreter (a GPU machine's own, with CUDA torch) instead of the venv.
GPU_PYTHON ?= $(BIN)/python

test-gpu: $(if $(filter $(BIN)/python,$(GPU_PYTHON)),venv)
	@$(GPU_PYTHON) -c "import torch; print('test-gpu: ' + ('running on ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device (torch ' + torch.__version__ + '): tests/gpu are skipped'))"
	$(GPU_PYTHON) -m pytest -q -rs tests/gpu

# Wheels for a GPU machine without a network (git-ignored .whl/): deepspeed, this package, missing dependencies.
gpu-wheels: venv
	PYTHON=$(BIN)/python bash tools/gpu_wheels.sh

# On a GPU machine, at most 8 minutes: installs .whl/ if present, runs test-gpu and the GPU benchmark, one table.
gpu-check:
	bash tools/gpu_check.sh
# Upstream's own ZeRO-3 unit tests under both runtimes (not part of `make test`: about an hour per runtime on 2
# cores). UPSTREAM is a DeepSpeed source checkout; its tests/ is copied into compat-out/, never into this repository.
# Rebuilds docs/compat/upstream-unit-tests.md; options through COMPAT_ARGS, e.g. COMPAT_ARGS="--collect-only" or
# COMPAT_ARGS="--files test_z3_eager_fallback.py" (other rows keep their earlier, dated measurement).
.PHONY: compat
# Two of upstream's files import transformers at collection: the integration deps are installed first.
compat: venv venv-int clean-locks
	@test -n "$(UPSTREAM)" || { echo "usage: make compat UPSTREAM=<path to a DeepSpeed checkout>"; exit 2; }
	$(BIN)/python tools/upstream_compat.py --upstream "$(UPSTREAM)" $(COMPAT_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .torch_extensions demo-out
