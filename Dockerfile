# syntax=docker/dockerfile:1
# The one image every node runs: CUDA 13.0 + Python 3.12 + torch 2.11.0 + vLLM 0.24.0 + verl 0.9.1 +
# flash-attn 2.8.3, with every Python package installed from hashed locks (scripts/lock.sh).
#   make build            (= docker compose build)
# Layers go from slowest-changing to fastest: system packages, locked wheels, flash-attn build, our code.
# Nothing secret goes in: tokens and keys reach containers at run time through .env or mounted volumes.

# CUDA 13.0.2 devel (nvcc for flash-attn's build and for the kernels FlashInfer/Triton compile at run
# time) on Ubuntu 24.04, pinned by digest so that every node gets the same bytes.
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04@sha256:5dc1bca23d05bd37b011be68ec470c03b403a5da07ec3a86e41af9470e9d0cc6

FROM ${CUDA_IMAGE} AS base
ARG DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Versions come with the digest-pinned base's Ubuntu 24.04 archive; exact apt pins would break the
# build as soon as Ubuntu publishes a security update and drops the old version.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3.12 python3.12-venv python3.12-dev build-essential ca-certificates \
        openssh-client rsync iproute2 procps numactl \
        libibverbs1 ibverbs-providers librdmacm1 \
    && rm -rf /var/lib/apt/lists/*
# A venv keeps the locked packages apart from Ubuntu's own Python packages (PEP 668).
RUN python3.12 -m venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# --- locked Python packages (changes only when scripts/lock.sh is rerun) ----------------------------
FROM base AS deps
COPY docker/build-tools.lock docker/requirements.lock /opt/lock/
# Build tools first, hash-checked; then everything else without build isolation, so that the two
# sdist-only pins (docker/requirements.sdist-only) are built with those locked tools, not fetched ones.
RUN pip install --require-hashes --no-deps -r /opt/lock/build-tools.lock \
    && pip install --require-hashes --no-build-isolation -r /opt/lock/requirements.lock

# --- flash-attn 2.8.3: PyPI has only the sdist; build it against the locked torch -----------------
FROM deps AS flash-attn
# 8.0 = A100, 9.0 = H100/H200. Add 10.0/12.0 for Blackwell (longer build).
ARG FLASH_ATTN_CUDA_ARCHS="80;90"
ARG MAX_JOBS=8
ARG NVCC_THREADS=2
COPY docker/flash-attn.lock /opt/lock/
RUN FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" \
    MAX_JOBS="${MAX_JOBS}" NVCC_THREADS="${NVCC_THREADS}" \
    pip wheel --require-hashes --no-deps --no-build-isolation -w /opt/wheels -r /opt/lock/flash-attn.lock

# --- the image --------------------------------------------------------------------------------------
FROM deps AS final
COPY --from=flash-attn /opt/wheels /opt/wheels
RUN pip install --no-deps /opt/wheels/flash_attn-*.whl && rm -rf /opt/wheels
# Defaults for air-gapped clusters: nothing phones home. SWANLAB_MODE=local keeps metrics on disk.
# vLLM 0.24 ignores VLLM_ATTENTION_BACKEND (its xformers backend is gone): the backend is chosen in
# configs/grpo.yaml through verl's rollout engine kwargs, so the image sets no attention variable.
ENV RAY_USAGE_STATS_ENABLED=0 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    SWANLAB_MODE=local
WORKDIR /opt/verl-stack
COPY pyproject.toml README.md ./
COPY app ./app
COPY configs ./configs
COPY data/gsm8k_source ./data/gsm8k_source
COPY docker ./docker
COPY scripts/check_image.py scripts/check_lock.py ./scripts/
# Editable, so that the code finds configs/ and the bundled GSM8K beside itself; containers run in the
# host's directory (compose working_dir), where only data/, models/ and checkpoints/ are mounted.
RUN pip install --no-deps --no-build-isolation -e . \
    && python scripts/check_image.py \
    && python -m app --help >/dev/null
LABEL org.opencontainers.image.title="verl-stack" \
      org.opencontainers.image.description="verl 0.9.1 SFT + GRPO, pinned: CUDA 13.0, Python 3.12, torch 2.11.0, vLLM 0.24.0, flash-attn 2.8.3" \
      org.opencontainers.image.licenses="Apache-2.0"
CMD ["python", "-m", "app", "--help"]
