# The one image every node runs, in two flavours of the same stages:
#   FLAVOR=gpu (default): CUDA 13.0 + Python 3.12 + torch 2.11.0 + vLLM 0.24.0 + verl 0.9.1 + flash-attn 2.8.3,
#              every Python package from hashed locks (scripts/lock.sh), on the digest-pinned CUDA base;
#   FLAVOR=cpu: the same stages and app install on any Debian/Ubuntu base with python3 (scripts/offline-base.sh
#              makes one without a registry): a CPU torch from TORCH_INDEX_URL or WHEELS, the dev constraints
#              (constraints-dev.txt) instead of the CUDA lock, no flash-attn, no vLLM. For tests and laptops.
#   make build [FLAVOR=cpu BASE_IMAGE=local/base IMAGE=verl-stack:cpu]   (app/containers.py; docs/containers.md)
# No `# syntax=` line: the build needs no frontend image, so it runs offline, with BuildKit or the legacy builder.
# Layers go from slowest-changing to fastest: system packages, pinned wheels, flash-attn build, our code.
# Nothing secret goes in: a site CA and local wheels are fetched inside one RUN from the loopback address that
# `make build` serves them on (BUILD_FILES_URL) and deleted in that RUN; tokens and keys come at run time.

# CUDA 13.0.2 devel (nvcc for flash-attn's build and for the kernels FlashInfer/Triton compile at run
# time) on Ubuntu 24.04, pinned by digest so that every node gets the same bytes.
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04@sha256:5dc1bca23d05bd37b011be68ec470c03b403a5da07ec3a86e41af9470e9d0cc6
ARG BASE_IMAGE=${CUDA_IMAGE}

FROM ${BASE_IMAGE} AS base
ARG FLAVOR=gpu
ARG DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Versions come with the base's archive (the digest-pinned Ubuntu 24.04 for gpu); exact apt pins would break
# the build as soon as the archive publishes a security update and drops the old version. Packages the base
# already has are not fetched again (the offline base has them all, so the CPU flavour needs no apt mirror).
# hadolint ignore=DL3008,SC2086
RUN case "${FLAVOR}" in \
      gpu) python=python3.12; packages="python3.12 python3.12-venv python3.12-dev build-essential ca-certificates \
             openssh-client rsync iproute2 procps numactl libibverbs1 ibverbs-providers librdmacm1" ;; \
      cpu) python=python3; packages="python3 python3-venv ca-certificates openssh-client rsync iproute2 procps" ;; \
      *) echo "FLAVOR=${FLAVOR}: use gpu or cpu" >&2; exit 1 ;; \
    esac \
    && missing=$(for p in ${packages}; do dpkg-query -W -f='${Status}\n' "${p}" 2>/dev/null \
                 | grep -q '^install ok installed$' || echo "${p}"; done) \
    && if [ -n "${missing}" ]; then \
         apt-get update && apt-get install -y --no-install-recommends ${missing} && rm -rf /var/lib/apt/lists/*; \
       fi \
    && "${python}" -m venv /opt/venv \
    && mkdir -m 1777 /home/stack
# A venv keeps the pinned packages apart from the distribution's own Python packages (PEP 668).
# HOME: containers run as the invoking user (compose `user:`), who may have no home in the image.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    HOME=/home/stack \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# --- pinned Python packages (changes only when scripts/lock.sh or constraints-dev.txt change) ---------
FROM base AS deps
ARG FLAVOR=gpu
# Where pip looks (build settings; unset = pip's default index) and where the CPU torch comes from.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG TORCH_INDEX_URL
ARG BUILD_FILES_URL
COPY docker/build-tools.lock docker/requirements.lock docker/site.sh constraints-dev.txt pyproject.toml /opt/lock/
# Build tools first, hash-checked; then everything else without build isolation, so that the two
# sdist-only pins (docker/requirements.sdist-only) are built with those locked tools, not fetched ones.
# cpu: torch alone (CPU build) from TORCH_INDEX_URL or the served WHEELS, then pyproject's dependencies,
# every version pinned by constraints-dev.txt (the CPU suite's environment).
RUN /opt/lock/site.sh pip install --require-hashes --no-deps -r /opt/lock/build-tools.lock \
    && if [ "${FLAVOR}" = gpu ]; then \
         /opt/lock/site.sh pip install --require-hashes --no-build-isolation -r /opt/lock/requirements.lock; \
       else \
         torch_from=--no-index \
         && if [ -n "${TORCH_INDEX_URL}" ]; then torch_from="--index-url=${TORCH_INDEX_URL}"; fi \
         && /opt/lock/site.sh pip install --no-deps -c /opt/lock/constraints-dev.txt "${torch_from}" torch \
         && python -c 'import tomllib; print("\n".join(tomllib.load(open("/opt/lock/pyproject.toml", "rb"))["project"]["dependencies"]))' \
            > /opt/lock/cpu-requirements.txt \
         && /opt/lock/site.sh pip install -c /opt/lock/constraints-dev.txt --no-build-isolation -r /opt/lock/cpu-requirements.txt \
         && pip check \
         && python -c 'import sys, torch; sys.exit(torch.version.cuda and "FLAVOR=cpu got a CUDA torch: TORCH_INDEX_URL or WHEELS must hold a CPU build")'; \
       fi

# --- flash-attn 2.8.3 (gpu): PyPI has only the sdist; build it against the locked torch ---------------
FROM deps AS flash-attn
ARG FLAVOR=gpu
# 8.0 = A100, 9.0 = H100/H200. Add 10.0/12.0 for Blackwell (longer build).
ARG FLASH_ATTN_CUDA_ARCHS="80;90"
ARG MAX_JOBS=8
ARG NVCC_THREADS=2
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG BUILD_FILES_URL
COPY docker/flash-attn.lock /opt/lock/
RUN mkdir -p /opt/wheels \
    && if [ "${FLAVOR}" = gpu ]; then \
         FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" \
         MAX_JOBS="${MAX_JOBS}" NVCC_THREADS="${NVCC_THREADS}" \
         /opt/lock/site.sh pip wheel --require-hashes --no-deps --no-build-isolation -w /opt/wheels -r /opt/lock/flash-attn.lock; \
       fi

# --- the image --------------------------------------------------------------------------------------
FROM deps AS final
ARG FLAVOR=gpu
COPY --from=flash-attn /opt/wheels /opt/wheels
RUN if [ "${FLAVOR}" = gpu ]; then pip install --no-deps /opt/wheels/flash_attn-*.whl; fi \
    && rm -rf /opt/wheels /opt/lock
# Defaults for air-gapped clusters: nothing phones home. SWANLAB_MODE=local keeps metrics on disk.
# vLLM 0.24 ignores VLLM_ATTENTION_BACKEND (its xformers backend is gone): the backend is chosen in
# configs/grpo.yaml through verl's rollout engine kwargs, so the image sets no attention variable.
ENV RAY_USAGE_STATS_ENABLED=0 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    SWANLAB_MODE=local \
    STACK_FLAVOR=${FLAVOR}
WORKDIR /opt/verl-stack
COPY pyproject.toml README.md ./
COPY app ./app
COPY configs ./configs
COPY data/gsm8k_source ./data/gsm8k_source
COPY docker ./docker
COPY scripts/check_image.py scripts/check_lock.py ./scripts/
# Editable, so that the code finds configs/ and the bundled GSM8K beside itself; containers run in the
# host's directory (compose working_dir), with the checkout's configs/ mounted over the image's copy.
RUN pip install --no-deps --no-build-isolation -e . \
    && if [ "${FLAVOR}" = gpu ]; then python scripts/check_image.py; fi \
    && python -m app --help >/dev/null
LABEL org.opencontainers.image.title="verl-stack" \
      org.opencontainers.image.description="verl 0.9.1 SFT + GRPO, pinned: CUDA 13.0, Python 3.12, torch 2.11.0, vLLM 0.24.0, flash-attn 2.8.3 (FLAVOR=cpu: CPU torch, dev constraints, no vLLM/flash-attn)" \
      org.opencontainers.image.licenses="Apache-2.0"
CMD ["python", "-m", "app", "--help"]
