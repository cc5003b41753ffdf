# syntax=docker/dockerfile:1
#
# rekindle in a container: the `rekindle` launcher and the example programs (ddp,
# single_device, collectives_perf, ckpt_bench, ddp_bench, plot_loss) in a small Debian image.
#
#   docker build -t rekindle:0.1.0 .
#   docker run --rm rekindle:0.1.0 run --standalone --nproc-per-node 2 ddp --steps 50
#
# For PyTorch programs, copy the launcher into your own image:
#   COPY --from=rekindle:0.1.0 /usr/local/bin/rekindle /usr/local/bin/rekindle
# See docs/kubernetes.md.

ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm

FROM rust:${RUST_VERSION}-slim-${DEBIAN_RELEASE} AS build
# protoc: the etcd client's gRPC code is generated at build time.
RUN apt-get update \
 && apt-get install -y --no-install-recommends "protobuf-compiler=3.21.*" \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The registry and target caches survive between builds (BuildKit); the binaries are copied
# out of the cached target directory into /out.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --workspace \
      --bin rekindle --bin ddp --bin single_device --bin collectives_perf \
      --bin ckpt_bench --bin ddp_bench --bin plot_loss \
 && mkdir -p /out \
 && cp target/release/rekindle target/release/ddp target/release/single_device \
       target/release/collectives_perf target/release/ckpt_bench target/release/ddp_bench \
       target/release/plot_loss /out/

FROM debian:${DEBIAN_RELEASE}-slim
# The binaries need only glibc and libgcc_s, which the slim image has. Workers run as an
# unprivileged user; checkpoints go to a volume it can write (see examples/k8s).
RUN groupadd --gid 10001 rekindle \
 && useradd --create-home --uid 10001 --gid 10001 rekindle \
 && mkdir -p /checkpoints /var/log/rekindle \
 && chown rekindle:rekindle /checkpoints /var/log/rekindle
COPY --from=build /out/ /usr/local/bin/
USER 10001:10001
WORKDIR /home/rekindle
ENTRYPOINT ["rekindle"]
CMD ["--help"]
