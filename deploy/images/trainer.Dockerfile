# syntax=docker/dockerfile:1
# An example of adding Baton's trainer SDK to your own training image. Start from the image
# you already use (a CUDA PyTorch image, say); the SDK needs torch, numpy, isal, xxhash, blake3,
# safetensors
# and (for s3:// checkpoints) boto3, and installs nothing that competes with your torch.
#   docker build -f deploy/images/trainer.Dockerfile -t <registry>/my-trainer:1.0 \
#       --build-arg BASE_IMAGE=<your training image> .

ARG BASE_IMAGE=python:3.12.8-slim-bookworm
FROM ${BASE_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md /tmp/baton/
COPY trainer_sdk/ /tmp/baton/trainer_sdk/
COPY sidecar/ /tmp/baton/sidecar/
COPY operator/ /tmp/baton/operator/
# --no-deps keeps the base image's torch; then only the SDK's own small dependencies.
RUN pip install "numpy>=1.26" "isal>=1.6" "xxhash>=3.0" "blake3>=1.0" "safetensors>=0.4.3" \
    "boto3>=1.34" \
 && pip install --no-deps /tmp/baton \
 && rm -rf /tmp/baton
COPY examples/ /workspace/examples/
WORKDIR /workspace
# Training pods in a "restricted" namespace run as non-root (the examples use 1000).
USER 1000:1000
