# syntax=docker/dockerfile:1
#
# The rollstream image: one image for every role (`rollstream consumer|admission|trainer|...`).
#
# CPU (default):
#   docker build -t rollstream:dev .
# CUDA (any base with glibc; Python is installed from the distribution when the base has none):
#   docker build -t rollstream:cu128 \
#     --build-arg BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# Without g++ in the runtime image (only CPU trainer ranks need it):
#   --build-arg RUNTIME_PACKAGES=
# Another torch:
#   --build-arg TORCH_SPEC=torch==2.13.0   (the CPU index serves CPU-only wheels; the cuXXX
#                                          indexes serve the matching CUDA builds)
#
# The chart runs the image as uid 10001 with a read-only root filesystem and HOME=/tmp.

ARG BASE=python:3.11-slim

# ------------------------------------------------------------------------------ build
FROM ${BASE} AS build

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    DEBIAN_FRONTEND=noninteractive \
    DS_BUILD_OPS=0

# CUDA bases ship no Python: take the distribution's (3.10+ on Ubuntu 22.04 and later).
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:${PATH}

# torch first, from its own index, so the project's `torch>=2.2,<3` is already satisfied
RUN pip install --upgrade pip setuptools wheel \
    && pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
COPY domain ./domain
COPY producers ./producers
COPY consumers ./consumers
COPY trainer ./trainer
COPY rollstream ./rollstream
# no build isolation: deepspeed's build must see the torch installed above
RUN pip install --no-build-isolation . \
    && python -c "import rollstream.cli, torch; print('torch', torch.__version__)"

# ------------------------------------------------------------------------------ runtime
FROM ${BASE} AS runtime

ENV DEBIAN_FRONTEND=noninteractive
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 \
        && rm -rf /var/lib/apt/lists/*; \
    fi

# A CPU trainer rank (trainer.gpu.count=0) compiles DeepSpeed's shared-memory comm op with
# g++ on first use (into $HOME/.cache/torch_extensions; the chart's HOME is /tmp). CUDA images
# whose trainers run on GPUs can leave it out: --build-arg RUNTIME_PACKAGES=
ARG RUNTIME_PACKAGES=g++
RUN if [ -n "${RUNTIME_PACKAGES}" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends ${RUNTIME_PACKAGES} \
        && rm -rf /var/lib/apt/lists/*; \
    fi

RUN groupadd --system --gid 10001 rollstream \
    && useradd --system --uid 10001 --gid rollstream --home-dir /home/rollstream \
       --create-home --shell /usr/sbin/nologin rollstream

COPY --from=build /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/rollstream

LABEL org.opencontainers.image.title="rollstream" \
      org.opencontainers.image.description="Asynchronous rollout pipeline for GRPO-style RL of LLM agents over Redis Streams" \
      org.opencontainers.image.licenses="Apache-2.0"

USER 10001:10001
WORKDIR /home/rollstream
# /metrics, /healthz, /readyz
EXPOSE 9400

ENTRYPOINT ["rollstream"]
CMD ["--help"]
