# syntax=docker/dockerfile:1
# The actor image: the `volley` binary on distroless (glibc, CA certificates, no shell, no
# package manager), running as uid 65532. Build from the repository root:
#   docker build -f deploy/docker/actor.Dockerfile -t volley-actor .
# Dependencies are compiled in their own layer (cargo-chef), so a change to Volley's sources
# rebuilds only Volley's crates. The learner image (learner.Dockerfile) builds the same way.

ARG RUST_VERSION=1.95
ARG CARGO_CHEF_VERSION=0.1.78

# Build on bookworm: its glibc (2.36) is the runtime's (distroless cc-debian12).
FROM rust:${RUST_VERSION}-slim-bookworm AS chef
ARG CARGO_CHEF_VERSION
RUN cargo install cargo-chef --locked --version "${CARGO_CHEF_VERSION}"
WORKDIR /src

# The dependency recipe changes only when Cargo.toml or Cargo.lock files do.
FROM chef AS planner
COPY . .
RUN cargo chef prepare --recipe-path recipe.json

FROM chef AS builder
COPY --from=planner /src/recipe.json recipe.json
RUN cargo chef cook --release --locked --package volley --bin volley --recipe-path recipe.json
COPY . .
RUN cargo build --release --locked --package volley --bin volley \
    && install -D -m 0755 target/release/volley /out/volley

FROM gcr.io/distroless/cc-debian12:nonroot AS runtime
COPY --from=builder /out/volley /usr/local/bin/volley
USER 65532:65532
# Metrics, /healthz and /readyz on all interfaces; logs as JSON lines for the cluster's
# collector. Every flag can be set through its VOLLEY_* variable (volley actor --help).
ENV VOLLEY_METRICS_ADDR=0.0.0.0:9100 \
    VOLLEY_LOG_FORMAT=json \
    RUST_LOG=info
EXPOSE 9100
ENTRYPOINT ["/usr/local/bin/volley"]
CMD ["actor"]
