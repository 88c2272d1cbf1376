# corral container image: two targets from one file.
#
#   docker build --target cpu  -t corral:cpu  .     # pinned CPU torch (from PyTorch's CPU index)
#   docker build --target cuda -t corral:cuda .     # torch's CUDA wheels (PyPI); needs the NVIDIA driver +
#                                                   # container toolkit on the host, no CUDA in the image
#
# Build arguments (all optional; see docs/deployment.md):
#   BASE_IMAGE         a Debian bookworm image (default debian:bookworm-slim). Without a registry, pass a local
#                      one, e.g. made with debootstrap + `docker import` (tests/deploy/docker_stack.py does).
#   PIP_INDEX_URL      package index for everything but torch (default PyPI).
#   TORCH_INDEX_URL    where torch comes from (cpu: PyTorch's CPU index; cuda: PyPI, whose Linux wheel is CUDA).
#   TORCH_LOCAL_VERSION  local version label appended to constraints.txt's torch pin (cpu: +cpu).
# Files the build picks up when present (both directories are git-ignored apart from their README):
#   deploy/docker/certs/*.crt   extra CA certificates, trusted while building (TLS-intercepting proxies)
#   deploy/docker/wheels/*.whl  wheels pip prefers over the index (e.g. a torch wheel already downloaded)
#
# The legacy builder (no BuildKit) builds every stage above the target, so the CPU stages come first.

ARG BASE_IMAGE=debian:bookworm-slim

# ---- base: the Python the venv runs on (Debian's 3.11) --------------------------------------------------------
FROM ${BASE_IMAGE} AS base
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# libgomp1: the OpenMP runtime ggml's kernels (the `ggml` extra, built in the builder) run on.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 ca-certificates libgomp1 \
 && rm -rf /var/lib/apt/lists/*

# ---- builder: a venv with the project's own pins; extra CAs live only in this stage -------------------------
FROM base AS builder
# A C compiler and cmake build ggml (the `ggml` extra: GGUF models served from their own blocks); they stay here.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3-venv python3-dev gcc g++ make cmake \
 && rm -rf /var/lib/apt/lists/*
COPY deploy/docker/certs/ /tmp/certs/
RUN find /tmp/certs -name '*.crt' -exec cp {} /usr/local/share/ca-certificates/ \; && update-ca-certificates
ARG PIP_INDEX_URL=https://pypi.org/simple
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    PIP_FIND_LINKS=/tmp/wheels PIP_DEFAULT_TIMEOUT=120 CORRAL_CACHE_DIR=/var/cache/corral
RUN python3 -m venv /opt/corral/venv
COPY deploy/docker/wheels/ /tmp/wheels/
COPY deploy/docker/install-venv.sh /usr/local/bin/install-venv
COPY deploy/ggml/build-ggml.sh /usr/local/bin/build-ggml
COPY constraints.txt /src/meta/constraints.txt

# ---- source: the code, apart, so that a code change rebuilds only the last layers -----------------------------
FROM base AS source
COPY pyproject.toml README.md constraints.txt /src/project/
COPY corral /src/project/corral

# ---- CPU venv --------------------------------------------------------------------------------------------------
FROM builder AS build-cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_LOCAL_VERSION=+cpu
RUN install-venv torch
COPY pyproject.toml /src/meta/
RUN install-venv deps cpu
COPY --from=source /src/project /src/project
RUN install-venv project

# ---- runtime: non-root, no compilers, no pip caches, no extra CAs ----------------------------------------------
FROM base AS runtime
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/corral corral \
 && install -d -o corral -g corral /var/cache/corral
# CORRAL_CACHE_DIR holds the embedded default model (built into the image below) and, through XDG_CACHE_HOME,
# kernel caches (triton/torch on CUDA); compose and k8s mount a volume here.
ENV PATH=/opt/corral/venv/bin:$PATH HOME=/home/corral \
    CORRAL_HOST=0.0.0.0 CORRAL_PORT=8000 CORRAL_CACHE_DIR=/var/cache/corral \
    XDG_CACHE_HOME=/var/cache/corral/xdg
WORKDIR /home/corral
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 CMD ["python3", "-c", \
  "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('CORRAL_PORT', '8000'), timeout=4)"]
STOPSIGNAL SIGTERM
COPY deploy/docker/entrypoint.sh /usr/local/bin/corral-entrypoint
USER 10001:10001
ENTRYPOINT ["corral-entrypoint"]

FROM runtime AS cpu
COPY --from=build-cpu /opt/corral/venv /opt/corral/venv
COPY --from=build-cpu --chown=10001:10001 /var/cache/corral /var/cache/corral

# ---- CUDA venv: torch's CUDA wheels carry the CUDA runtime; the host provides the driver -------------------------
FROM builder AS build-cuda
ARG TORCH_INDEX_URL=https://pypi.org/simple
ARG TORCH_LOCAL_VERSION=
RUN install-venv torch
COPY pyproject.toml /src/meta/
RUN install-venv deps cuda
COPY --from=source /src/project /src/project
RUN install-venv project

FROM runtime AS cuda
COPY --from=build-cuda /opt/corral/venv /opt/corral/venv
COPY --from=build-cuda --chown=10001:10001 /var/cache/corral /var/cache/corral
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
