# syntax=docker/dockerfile:1
# The Baton operator image. Build from the repository root:
#   docker build -f deploy/images/operator.Dockerfile -t <registry>/baton-operator:0.1.0 .
#
# Two stages: the builder has pip and a compiler toolchain for any wheel that needs one; the
# final stage gets only the virtual environment, runs as an unprivileged numeric user (the
# chart's runAsUser, so runAsNonRoot can verify it) and starts the console script.
#
# The operator imports neither torch nor the SDK (it talks HTTP to the sidecars), so its
# image installs the project without its dependencies, then only the operator's own.

ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/baton
WORKDIR /src
COPY pyproject.toml README.md ./
COPY trainer_sdk/ trainer_sdk/
COPY sidecar/ sidecar/
COPY operator/ operator/
# The operator's runtime dependencies, the same pins as pyproject.toml's "# operator" group.
RUN /opt/baton/bin/pip install "kopf>=1.37" "kubernetes>=30.1" "PyYAML>=6.0" \
        "aiohttp>=3.9" "prometheus_client>=0.20" \
 && /opt/baton/bin/pip install --no-deps .

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/baton /opt/baton
ENV PATH=/opt/baton/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# 65532 is the chart's runAsUser/runAsGroup (charts/baton/values.yaml podSecurityContext).
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["baton-operator"]
