#!/usr/bin/env bash
# What a config's size costs (DESIGN §16): for 1k, 10k and 100k tenant routes (one host
# each, all counted under one `metrics_as` label, then a catch-all), `sluice check` time,
# start time (until /healthz and the listener answer), SIGHUP reload time (until
# sluice_config_reloads_total{result="success"} moves), RSS after start and /metrics size;
# and the same for one route. Then TLS handshakes per second with 1 and with 10,000
# certificates (CERTS=0 skips it). Prints Markdown tables.
#
# Usage: bench/scale.sh path/to/sluice        (SIZES="1000 10000 100000" by default)
set -euo pipefail
BIN=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
SIZES=${SIZES:-"1000 10000 100000"}
METRICS_AS=${METRICS_AS:-1}
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
now() { date +%s.%N; }
ms_since() { python3 -c "import sys; print(round((float(sys.argv[2]) - float(sys.argv[1])) * 1000))" "$1" "$(now)"; }

# gen N PORT ADMIN: N host routes with metrics_as (N=0: just the catch-all).
gen() {
    python3 - "$@" <<'PY'
import sys
n, port, admin, metrics_as = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "1"
out = [f'[server]\nlisten = ["127.0.0.1:{port}"]\naccess_log = "off"\nthreads = 1\n',
       f'[admin]\nlisten = "127.0.0.1:{admin}"\n',
       '[policies.per_ip]\nalgorithm = "gcra"\nlimit = 1000000\nperiod = "1s"\nkey = ["client_ip"]\n']
label = '\nmetrics_as = "tenants"' if metrics_as else ''
for i in range(n):
    out.append(f'[[routes]]\nname = "t{i}"\nhosts = ["tenant-{i}.example.com"]{label}\n'
               f'respond = {{ status = 200 }}\npolicies = ["per_ip"]\n')
out.append('[[routes]]\nname = "catch_all"\nrespond = { status = 200 }\npolicies = ["per_ip"]\n')
print("\n".join(out))
PY
}

echo "| routes | check | start | reload | RSS | /metrics |"
echo "|---:|---:|---:|---:|---:|---:|"
for n in 0 $SIZES; do
    port=$(free_port); admin=$(free_port)
    gen "$n" "$port" "$admin" "$METRICS_AS" > "$tmp/c.toml"
    t=$(now); "$BIN" check --config "$tmp/c.toml" >/dev/null; check=$(ms_since "$t")
    t=$(now)
    "$BIN" run --config "$tmp/c.toml" >/dev/null 2>"$tmp/err.log" &
    pid=$!
    until curl -sf "http://127.0.0.1:$admin/healthz" >/dev/null 2>&1 && curl -s -o /dev/null "http://127.0.0.1:$port/"; do
        kill -0 $pid 2>/dev/null || { cat "$tmp/err.log" >&2; exit 1; }
        sleep 0.01
    done
    start=$(ms_since "$t")
    rss=$(awk '/VmRSS/ {printf "%.0f MB", $2/1024}' /proc/$pid/status)
    size=$(curl -s "http://127.0.0.1:$admin/metrics" | wc -c)
    reloads() { curl -s "http://127.0.0.1:$admin/metrics" | awk '/^sluice_config_reloads_total\{result="success"\}/ {print $2}'; }
    before=$(reloads)
    t=$(now); kill -HUP $pid
    until [ "$(reloads)" != "$before" ]; do sleep 0.01; done
    reload=$(ms_since "$t")
    kill $pid; wait $pid 2>/dev/null || true
    echo "| $((n + 1)) | ${check} ms | ${start} ms | ${reload} ms | $rss | $((size / 1024)) KiB |"
done

# Certificates chosen by SNI: full TLS handshakes per second (one Python client, a new
# connection each, SNI set) against one [[certificates]] entry and against 10,000
# (tenant-N.example.com, the same throw-away certificate and key files, asked for by the
# name of the 5,000th entry).
[ "${CERTS:-1}" = 0 ] && exit 0
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=tenant.example.com \
    -addext 'subjectAltName=DNS:*.example.com' -keyout "$tmp/k.pem" -out "$tmp/c.pem" 2>/dev/null
echo
echo "| certificates | full handshakes/s (one client, 5 s) |"
echo "|---:|---:|"
for n in 1 10000; do
    port=$(free_port); admin=$(free_port)
    python3 - "$n" "$port" "$admin" "$tmp" > "$tmp/t.toml" <<'PY'
import sys
n, port, admin, tmp = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
print(f'[server]\ntls_listen = ["127.0.0.1:{port}"]\naccess_log = "off"\nthreads = 1\n[admin]\nlisten = "127.0.0.1:{admin}"\n')
for i in range(n):
    print(f'[[certificates]]\nhosts = ["tenant-{i}.example.com"]\ncert = "{tmp}/c.pem"\nkey = "{tmp}/k.pem"\n')
print('[[routes]]\nname = "r"\nrespond = { status = 200 }\n')
PY
    "$BIN" run --config "$tmp/t.toml" >/dev/null 2>"$tmp/err.log" &
    pid=$!
    until curl -sf "http://127.0.0.1:$admin/healthz" >/dev/null 2>&1; do
        kill -0 $pid 2>/dev/null || { cat "$tmp/err.log" >&2; exit 1; }
        sleep 0.05
    done
    name=tenant-$((n / 2)).example.com
    rate=$(python3 - "$port" "$name" <<'PY'
import socket, ssl, sys, time
port, name = int(sys.argv[1]), sys.argv[2]
ctx = ssl.create_default_context()
ctx.check_hostname = False
ctx.verify_mode = ssl.CERT_NONE
done, end = 0, time.monotonic() + 5
while time.monotonic() < end:
    with socket.create_connection(("127.0.0.1", port)) as raw:
        with ctx.wrap_socket(raw, server_hostname=name):
            done += 1
print(done / 5)
PY
)
    kill $pid; wait $pid 2>/dev/null || true
    printf '| %s | %.0f |\n' "$n" "$rate"
done
