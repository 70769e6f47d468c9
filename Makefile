# Each target is one line into `python -m app` (or the compose service that runs it).
# Settings come from the environment, `.env`, or the command line: `make sft NODE_RANK=1`.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# RUNTIME=auto|docker|local. auto: docker where a Docker engine answers and the image is on this node, else
# local; app/containers.py decides and says which. RUNTIME=docker refuses in one line without them.
RUNTIME ?= auto
# RUNTIME=local runs in .venv when there is one, else any interpreter (PYTHON=python3 PYTHONPATH=...).
PYTHON ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)

# .env (see .env.example) counts for RUNTIME=local too, as it does for compose: below the shell
# environment and `make VAR=...`. Make has no dotenv reader: each KEY=value line is assigned unless KEY
# came from the command line or has a non-empty value already (empty counts as unset, as in the app, so
# the empty variables an outer make exports do not hide .env).
ifneq ($(wildcard .env),)
empty :=
define newline


endef
dotenv_key = $(firstword $(subst =, ,$(1)))
dotenv_set = $(if $(or $(filter command line,$(origin $(1))),$(strip $($(1)))),,$(1) = $(2))$(newline)export $(1)
dotenv_line = $(if $(and $(findstring =,$(1)),$(filter-out #%,$(1))),$(call dotenv_set,$(call dotenv_key,$(1)),$(subst ^, ,$(patsubst $(call dotenv_key,$(1))=%,%,$(1)))))
$(foreach line,$(subst $(newline), ,$(subst $(empty) $(empty),^,$(file < .env))),$(eval $(call dotenv_line,$(line))))
endif

# Everything the app reads; exported so each command (and compose's interpolation) sees it.
export DATA_DIR GSM8K_SOURCE MODEL_PATH NNODES NODE_RANK GPUS_PER_NODE MASTER_ADDR MASTER_PORT \
       HEAD_IP RAY_PORT ARGS DRY_RUN FRESH FORCE STEP CKPT_DIR OUT_DIR NODES RUN MODEL JOB \
       TRAIN_FILE VAL_FILE PROJECT EXPERIMENT SWANLAB_MODE WAIT_TIMEOUT \
       BOARD_HOST BOARD_PORT LIMIT OUT EVAL_BACKEND SMOKE_DIR SMOKE_STEPS IMAGE \
       FLASH_ATTN_CUDA_ARCHS MAX_JOBS DASHBOARD_HOST RAY_START_ARGS NODE_IP

# The docker side (app/containers.py): image, build and overlay settings. GPU and IB = auto|0|1: the GPU
# (compose.gpu.yaml) and InfiniBand (compose.ib.yaml) overlays, auto = where the node has them.
export RUNTIME IMAGE FLAVOR BASE_IMAGE BUILDER SITE_CA WHEELS TORCH_INDEX_URL PIP_INDEX_URL PIP_EXTRA_INDEX_URL \
       GPU IB MOUNTS STACK_HOME COMPOSE_PROJECT_NAME BUILD_FILES_PORT
# $(call app,SERVICE): the `python -m app` prefix; in SERVICE's container unless RUNTIME=local.
app = $(if $(filter local,$(RUNTIME)),$(PYTHON) -m app,$(PYTHON) -m app.containers run $(1))

.PHONY: help setup test test-containers prep data-check check sft grpo-head grpo-worker gather merge eval report \
        board doctor smoke build lock tiny-model

help: ## list every target
	@awk 'BEGIN {FS = ":.*## "} /^[a-z-]+:.*## / {printf "  make %-12s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo "  (RUNTIME=$(RUNTIME); variables: README.md, or .env.example)"

setup: ## build .venv with everything the tests and the CPU-side commands need
	python3 -m venv .venv && .venv/bin/pip install -q --upgrade pip && .venv/bin/pip install -q torch==2.13.0 && .venv/bin/pip install -q -c constraints-dev.txt -e '.[dev]'

test: ## run the whole test suite (CPU; real Ray, torchrun and FSDP processes)
	$(PYTHON) -m pytest

test-containers: ## the container suite: every target in real containers (a Docker engine, IMAGE built; .ci/run)
	$(PYTHON) -m pytest -m containers tests/containers

prep: ## GSM8K -> verl RL + SFT parquet under DATA_DIR (GSM8K_SOURCE=dir|hf, default: bundled copy)
	$(call app,gsm8k-prep) prep gsm8k

data-check: ## check your own parquet: make data-check FILE=x.parquet [KIND=rl|sft] [FIX=out.parquet]
	$(call app,gsm8k-prep) data check $(FILE) $(if $(KIND),--kind $(KIND)) $(if $(FIX),--fix $(FIX))

check: ## preflight only: make check JOB=sft|grpo
	$(call app,sft-runner) check $(or $(JOB),sft)

sft: ## SFT on this node (NNODES, NODE_RANK, GPUS_PER_NODE, MASTER_ADDR, MASTER_PORT; DRY_RUN=1, FRESH=1)
	$(call app,sft-runner) sft

grpo-head: ## Ray head: wait for NNODES nodes, then run GRPO (HEAD_IP, RAY_PORT, GPUS_PER_NODE)
	$(call app,ray-head) grpo-head

grpo-worker: ## Ray worker: join HEAD_IP and stay until the head goes away
	$(call app,ray-worker) grpo-worker

gather: ## pull every node's shards into CKPT_DIR: make gather NODES="ip1 ip2" [STEP=N]
	$(call app,merger) gather

merge: ## merge STEP (default latest) of CKPT_DIR into a Hugging Face model in OUT_DIR (FORCE=1 replaces)
	$(call app,merger) merge

eval: ## GSM8K test accuracy: make eval STEP=N or MODEL=path
	$(call app,sft-runner) eval

report: ## plots + summary of a run: make report RUN=checkpoints/<name>
	$(call app,merger) report

board: ## local swanlab dashboard of a run on 127.0.0.1:5092 (RUN, BOARD_HOST, BOARD_PORT)
	$(call app,merger) board

doctor: ## is this node ready? what to fix, one line each
	$(call app,ray-worker) doctor

smoke: ## whole pipeline on one GPU with a tiny local model: prep, SFT, merge, generate
	$(call app,sft-runner) smoke

tiny-model: ## write a tiny random model + tokenizer: make tiny-model OUT=models/tiny
	$(call app,merger) tiny-model $(or $(OUT),models/tiny)

build: ## build the image IMAGE (default verl-stack:0.1.0): FLAVOR=gpu|cpu, BASE_IMAGE, SITE_CA, WHEELS
	$(PYTHON) -m app.containers build

lock: ## re-resolve docker/*.lock with hashes from docker/requirements.in + pyproject.toml (network)
	scripts/lock.sh
