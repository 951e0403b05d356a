# The operator image: kopf, the Kubernetes client and tandem_operator only. No torch, no engine code.
#   docker build -f docker/operator.Dockerfile -t ghcr.io/tandem-dev/tandem-operator:0.1.0 .
#   make images          # the same with buildah, on a base made from Debian packages (hack/build-images.sh)
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app

# The `operator` extra of pyproject.toml, pinned the same way.
RUN pip install "kopf==1.45.2" "kubernetes>=37,<38" "pyyaml" "prometheus_client>=0.20,<1"

WORKDIR /app
COPY operator/tandem_operator /app/tandem_operator

# Fail the build if the operator ever pulls in torch or the engine.
RUN python -c "import sys, tandem_operator.handlers, tandem_operator.cli, tandem_operator.autoscaling.planner; \
bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'tandem_engine', 'tandem_router')]; \
sys.exit(f'operator imports {bad}' if bad else 0)"

# A passwd entry for the user pods run as: getpass.getuser() (kopf's peering id, torch's cache paths)
# raises KeyError for a UID without one.
RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
    --shell /usr/sbin/nologin tandem
USER 10001:10001
# `python -m tandem_operator ARGS` is `tandem operator ARGS`: ARGS go to `kopf run` unchanged.
ENTRYPOINT ["python", "-m", "tandem_operator"]
CMD ["--standalone", "--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz"]
