#!/usr/bin/env bash
# Where a proxy's CPU per request goes as connections grow: its user and kernel time per
# request (utime and stime of /proc/PID/stat over a wrk run) and its minor page faults per
# request, at each count of wrk connections given. The kernel's share grows with connections
# for any proxy (each socket's state is another cold line for the kernel too), so run nginx
# beside sluice to see which part is sluice's own.
#
# Usage: bench/cpu_split.sh SLUICE|nginx CONNECTIONS...   (e.g. target/release/sluice 64 1024)
#
# One worker (sluice `threads = 1`, nginx one worker without master) proxies GET / to an
# nginx upstream answering `return 200 "ok\n"` over keep-alive connections; wrk -t2, 5 s per
# count (DURATION), after a 1 s warm-up. Run it twice, alternating: this machine is noisy.

set -euo pipefail
[ $# -ge 2 ] || { echo "usage: bench/cpu_split.sh SLUICE|nginx CONNECTIONS..." >&2; exit 2; }
for t in nginx wrk python3; do
    command -v "$t" >/dev/null || { echo "cpu_split: $t is missing (apt install nginx wrk python3)" >&2; exit 1; }
done
PROXY=$1; shift
DURATION=${DURATION:-5s}
TMP=$(mktemp -d /tmp/cpu-split.XXXXXX)
chmod 755 "$TMP"
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$TMP"' EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
UP=$(port)
FRONT=$(port)
cat >"$TMP/upstream.conf" <<EOF
worker_processes 1; daemon off; master_process off; pid $TMP/upstream.pid; error_log $TMP/upstream.log;
events { worker_connections 8192; }
http { access_log off; keepalive_requests 1000000;
  server { listen 127.0.0.1:$UP backlog=4096; location / { return 200 "ok\n"; } } }
EOF
nginx -p "$TMP/" -c "$TMP/upstream.conf" &
PIDS+=($!)
if [ "$PROXY" = nginx ]; then
    cat >"$TMP/proxy.conf" <<EOF
worker_processes 1; daemon off; master_process off; pid $TMP/proxy.pid; error_log $TMP/proxy.log;
events { worker_connections 8192; }
http { access_log off;
  upstream origin { server 127.0.0.1:$UP; keepalive 1024; }
  server { listen 127.0.0.1:$FRONT backlog=4096; location / { proxy_pass http://origin;
    proxy_http_version 1.1; proxy_set_header Connection ""; } } }
EOF
    nginx -p "$TMP/" -c "$TMP/proxy.conf" &
else
    printf '[server]\nlisten = ["127.0.0.1:%s"]\nthreads = 1\naccess_log = "off"\n\n' "$FRONT" >"$TMP/sluice.toml"
    printf '[upstreams.origin]\nservers = ["127.0.0.1:%s"]\n\n' "$UP" >>"$TMP/sluice.toml"
    printf '[[routes]]\nname = "bench"\npath_prefix = "/"\nupstream = "origin"\n' >>"$TMP/sluice.toml"
    "$PROXY" run --config "$TMP/sluice.toml" >"$TMP/sluice.log" 2>&1 &
fi
PID=$!
PIDS+=("$PID")
sleep 1
wrk -t2 -c64 -d1s "http://127.0.0.1:$FRONT/" >/dev/null
name=$([ "$PROXY" = nginx ] && echo nginx || basename "$PROXY")
for c in "$@"; do
    before=$(awk '{print $10, $14, $15}' "/proc/$PID/stat")
    out=$(wrk -t2 -c"$c" -d"$DURATION" "http://127.0.0.1:$FRONT/")
    after=$(awk '{print $10, $14, $15}' "/proc/$PID/stat")
    n=$(echo "$out" | awk '/requests in/ {print $1}')
    python3 - "$name" "$c" "$n" "$before" "$after" "$(getconf CLK_TCK)" <<'PY'
import sys
name, c, n, before, after, tck = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6])
f0, u0, s0 = map(int, before.split()); f1, u1, s1 = map(int, after.split())
us = lambda ticks: ticks * 1e6 / tck / n
print(f"{name} {c} connections: {n} requests, user {us(u1 - u0):.1f} µs, kernel {us(s1 - s0):.1f} µs, "
      f"total {us(u1 - u0 + s1 - s0):.1f} µs per request, {(f1 - f0) / n:.3f} minor faults per request")
PY
done
