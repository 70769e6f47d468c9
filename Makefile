# Each target is one line into `python -m app` (or the compose service that runs it).
# Settings come from the command line, the environment or `.env`: `make sft NODE_RANK=1`; `make settings`.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# RUNTIME=auto|docker|local. auto: docker where a Docker engine answers and the image is on this node, else
# local; app/containers.py decides and says which. RUNTIME=docker refuses in one line without them.
RUNTIME ?= auto
# RUNTIME=local runs in .venv when there is one, else any interpreter (PYTHON=python3 PYTHONPATH=...).
PYTHON ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)

# Settings (app/settings.py): `make VAR=value` and the shell reach the app as its environment (make
# exports command-line variables to every recipe); the app reads .env itself, below both. So does compose,
# for the containers. RUNTIME, PYTHON and IB are make's own: the command line or the shell only.

# Hydra's own ${...} in ARGS (ARGS='trainer.project_name=x-${oc.env:HOSTNAME}') reaches the app as written:
# make would expand it as one of its own variables, to nothing.
$(foreach v,ARGS RAY_START_ARGS,$(if $(filter undefined,$(origin $(v))),,$(eval override $(v) := $$(value $(v)))$(eval export $(v))))

# The docker side (app/containers.py): image, build and overlay settings. GPU and IB = auto|0|1: the GPU
# (compose.gpu.yaml) and InfiniBand (compose.ib.yaml) overlays, auto = where the node has them.
export RUNTIME IMAGE FLAVOR BASE_IMAGE BUILDER SITE_CA WHEELS TORCH_INDEX_URL PIP_INDEX_URL PIP_EXTRA_INDEX_URL \
       GPU IB MOUNTS STACK_HOME COMPOSE_PROJECT_NAME BUILD_FILES_PORT
# $(call app,SERVICE): the `python -m app` prefix; in SERVICE's container unless RUNTIME=local.
app = $(if $(filter local,$(RUNTIME)),$(PYTHON) -m app,$(PYTHON) -m app.containers run $(1))

.PHONY: help setup test test-containers prep data-check check sft grpo-head grpo-worker gather merge eval \
        report board doctor smoke demo build lock tiny-model settings slurm k8s

help: ## list every target
	@awk 'BEGIN {FS = ":.*## "} /^[a-z-]+:.*## / {printf "  make %-12s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo "  (RUNTIME=$(RUNTIME); every variable: make settings, README.md, .env.example)"

setup: ## build .venv with everything the tests and the CPU-side commands need
	python3 -m venv .venv && .venv/bin/pip install -q --upgrade pip && .venv/bin/pip install -q torch==2.13.0 && .venv/bin/pip install -q -c constraints-dev.txt -e '.[dev]'

test: ## run the whole test suite (CPU; real Ray, torchrun and FSDP processes)
	$(PYTHON) -m pytest

test-containers: ## the container suite: every target in real containers (a Docker engine, IMAGE built; .ci/run)
	$(PYTHON) -m pytest -m containers tests/containers

prep: ## GSM8K + the arith task -> verl RL + SFT parquet under DATA_DIR (GSM8K_SOURCE=dir|hf, default: bundled)
	$(call app,gsm8k-prep) prep

data-check: ## check your own parquet: make data-check FILE=x.parquet [KIND=rl|sft] [FIX=out.parquet]
	$(call app,gsm8k-prep) data check

check: ## preflight only: make check JOB=sft|grpo [CONFIG=my.yaml]
	$(call app,sft-runner) check

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

slurm: ## an sbatch script for this run: make slurm JOB=sft|grpo [SUBMIT=1] [SLURM_CONTAINER=none|docker|pyxis|apptainer]
	$(call app,merger) slurm

k8s: ## Kubernetes manifests for this run: make k8s JOB=sft|grpo (KubeRay RayJob; PyTorchJob or K8S_SFT=indexed)
	$(call app,merger) k8s

settings: ## every variable, its value here and where it came from (shell, .env, default)
	$(call app,merger) settings

smoke: ## whole pipeline on one GPU with a tiny local model: prep, SFT, merge, generate
	$(call app,sft-runner) smoke

demo: ## proof of learning on one GPU: tiny model, SFT -> eval A0 -> GRPO -> eval A1 on the arith task
	$(call app,sft-runner) demo

tiny-model: ## write a tiny random model + tokenizer: make tiny-model OUT=models/tiny
	$(call app,merger) tiny-model

build: ## build the image IMAGE (default verl-stack:0.1.0): FLAVOR=gpu|cpu, BASE_IMAGE, SITE_CA, WHEELS
	$(PYTHON) -m app.containers build

lock: ## re-resolve docker/*.lock with hashes from docker/requirements.in + pyproject.toml (network)
	scripts/lock.sh
