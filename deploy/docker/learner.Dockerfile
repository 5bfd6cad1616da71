# syntax=docker/dockerfile:1
# The learner image: the `volley` binary on NVIDIA's CUDA *runtime* image, which ships the
# shared libraries the CUDA backend opens at run time through cudarc (NVRTC to compile the
# kernels, cuBLAS for matrix products; libcuda itself comes from the host driver through the
# NVIDIA container toolkit). Nothing CUDA is needed to build: cudarc loads the libraries
# dynamically, so the binary also runs on machines without a GPU (`--backend auto` falls back
# to the CPU). Runs as uid 65532. Build from the repository root:
#   docker build -f deploy/docker/learner.Dockerfile -t volley-learner .
# The CUDA major version of the runtime image must match the one cudarc was built for (12):
# cudarc looks for libnvrtc.so.12 and libcublas.so.12.

ARG RUST_VERSION=1.95
ARG CARGO_CHEF_VERSION=0.1.78
ARG CUDA_RUNTIME_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# Build on bookworm (glibc 2.36), older than the runtime's Ubuntu 24.04 (glibc 2.39): a binary
# runs on a glibc at least as new as the one it was linked against.
FROM rust:${RUST_VERSION}-slim-bookworm AS chef
ARG CARGO_CHEF_VERSION
RUN cargo install cargo-chef --locked --version "${CARGO_CHEF_VERSION}"
WORKDIR /src

FROM chef AS planner
COPY . .
RUN cargo chef prepare --recipe-path recipe.json

FROM chef AS builder
COPY --from=planner /src/recipe.json recipe.json
RUN cargo chef cook --release --locked --package volley --bin volley --recipe-path recipe.json
COPY . .
RUN cargo build --release --locked --package volley --bin volley \
    && install -D -m 0755 target/release/volley /out/volley

FROM ${CUDA_RUNTIME_IMAGE} AS runtime
# A non-root user with a fixed uid, and the checkpoint directory it owns (a fresh volume
# mounted there inherits the ownership in Docker; Kubernetes uses fsGroup 65532).
RUN groupadd --gid 65532 volley \
    && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /var/lib/volley --shell /usr/sbin/nologin volley \
    && install -d -o 65532 -g 65532 -m 0750 /var/lib/volley /var/lib/volley/checkpoints
COPY --from=builder /out/volley /usr/local/bin/volley
USER 65532:65532
WORKDIR /var/lib/volley
# The base image sets NVIDIA_VISIBLE_DEVICES=all and NVIDIA_DRIVER_CAPABILITIES=compute,utility.
ENV VOLLEY_METRICS_ADDR=0.0.0.0:9100 \
    VOLLEY_CHECKPOINT_DIR=/var/lib/volley/checkpoints \
    VOLLEY_LOG_FORMAT=json \
    RUST_LOG=info
EXPOSE 9100
ENTRYPOINT ["/usr/local/bin/volley"]
CMD ["learner"]
