# syntax=docker/dockerfile:1
#
# sluice container image.
#   docker build -t sluice .
#   docker run --rm -p 8080:8080 -p 9091:9091 sluice
# Use your own config with: -v /path/to/sluice.toml:/etc/sluice/sluice.toml:ro
# (its listeners must bind 0.0.0.0, not 127.0.0.1, to be reachable from outside).

########## build ##########
FROM rust:1-bookworm AS build

# DL3008 (pin apt package versions) is ignored on purpose: the image already pins
# the Debian release (bookworm), whose archive keeps only the current version of
# each package, so an exact pin breaks the build at the next security update.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY . .

# The cache mounts keep the crate registry and the target dir between builds
# (BuildKit); the binary is copied out of the cached target dir. It is the plain dist
# build: the profile-guided one (`make dist-pgo`, what `make install` ships) trains on a
# benchmark with nginx, wrk and Redis, which this stage does not have.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --profile dist --locked \
 && install -s -m 0755 target/dist/sluice /usr/local/bin/sluice

# The quick-start config listens on 127.0.0.1; in a container the listeners
# must bind all interfaces to be reachable through published ports. Only the
# `listen` lines change (upstreams on 127.0.0.1 stay as they are).
RUN sed -E '/^listen *=/ s/"127\.0\.0\.1:([0-9]+)"/"0.0.0.0:\1"/g' conf/sluice.toml > /sluice.toml \
 && grep -q '"0\.0\.0\.0:' /sluice.toml \
 && /usr/local/bin/sluice check --config /sluice.toml

########## runtime ##########
FROM debian:bookworm-slim

# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 sluice \
 && useradd --system --uid 10001 --gid sluice --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin sluice

COPY --from=build /usr/local/bin/sluice /usr/local/bin/sluice
COPY --from=build /sluice.toml /etc/sluice/sluice.toml

USER 10001:10001
EXPOSE 8080 9091

# No curl in the image: bash's /dev/tcp asks the admin listener for /healthz.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9091 && printf 'GET /healthz HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\nConnection: close\\r\\n\\r\\n' >&3 && read -r _ code _ <&3 && [ \"$code\" = 200 ]"]

# SIGTERM drains in-flight requests (grace_period), then exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/sluice"]
CMD ["run", "--config", "/etc/sluice/sluice.toml"]
