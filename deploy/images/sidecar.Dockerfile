# syntax=docker/dockerfile:1
# The Baton sidecar image, injected by the operator into every training pod as the native
# sidecar `baton-sidecar`. Build from the repository root:
#   docker build -f deploy/images/sidecar.Dockerfile -t <registry>/baton-sidecar:0.1.0 .
#
# The sidecar imports only torch-free modules of the SDK (trainer_sdk.wire, trainer_sdk.control,
# and for the memory tier's replication trainer_sdk.replication and trainer_sdk.format.layout), so the image
# installs the project without its dependencies (no torch: the image stays small and starts
# fast), then only what the sidecar imports.

ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/baton
WORKDIR /src
COPY pyproject.toml README.md ./
COPY trainer_sdk/ trainer_sdk/
COPY sidecar/ sidecar/
COPY operator/ operator/
# The sidecar's runtime dependencies, the same pins as pyproject.toml's "# sidecar" group,
# and xxhash and blake3: the memory tier's replication checks shard digests (XXH3-128 for
# format v4, BLAKE3 for v2-v3; trainer_sdk.format.layout).
RUN /opt/baton/bin/pip install "aiohttp>=3.9" "prometheus_client>=0.20" "xxhash>=3.0" "blake3>=1.0" \
 && /opt/baton/bin/pip install --no-deps .

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/baton /opt/baton
ENV PATH=/opt/baton/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# The same numeric user as the operator image; training pods in a "restricted" namespace
# must also run as non-root.
USER 65532:65532
EXPOSE 9440
ENTRYPOINT ["baton-sidecar"]
