#!/usr/bin/env bash
# ShouldRateLimit calls per second that one sluice thread answers (DESIGN section 13), on the
# memory backend and on Redis: h2load (Debian's nghttp2-client) sends the same call, one gcra
# descriptor (remote_address), over CONNECTIONS HTTP/2 connections with STREAMS calls in
# flight on each, as Envoy multiplexes its calls. sluice runs with threads = 1; its CPU is
# read from /proc before and after, so calls per CPU-second compare with bench/run.sh's
# proxy rows (µs of proxy CPU per request).
# Usage: bench/rls.sh PATH/TO/sluice
# Environment: DURATION [5] seconds, CONNECTIONS [4], STREAMS [16], KEEP_TMP [0]
set -euo pipefail

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[ $# -eq 1 ] || { sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }
DURATION=${DURATION:-5}
CONNECTIONS=${CONNECTIONS:-4}
STREAMS=${STREAMS:-16}
KEEP_TMP=${KEEP_TMP:-0}

LOG_TAG=rls-bench
# shellcheck source=bench/lib.sh
. "$BENCH_DIR/lib.sh"
require_python
ensure_tools h2load redis-server redis-cli timeout setsid nginx
resolve_sluice "$1"
bench_tmp sluice-rls
start_upstream
start_redis

# One framed RateLimitRequest: domain "bench", one descriptor remote_address=127.0.0.1.
python3 - "$TMP/call.bin" <<'EOF'
import sys
def field(n, b): return bytes([n << 3 | 2, len(b)]) + b
entry = field(1, b"remote_address") + field(2, b"127.0.0.1")
msg = field(1, b"bench") + field(2, field(1, entry))
open(sys.argv[1], "wb").write(b"\0" + len(msg).to_bytes(4, "big") + msg)
EOF
mkdir -p "$TMP/rules"
cat >"$TMP/rules/bench.yaml" <<'EOF'
domain: bench
descriptors:
  - key: remote_address
    rate_limit:
      name: per_ip
      unit: second
      requests_per_unit: 100000000
      algorithm: gcra
EOF

ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

echo "| backend | calls/s | sluice CPU (% of one core) | µs of sluice CPU per call | calls per CPU-second |"
echo "|---|---|---|---|---|"
for backend in memory redis; do
    read -r port admin rls <<<"$(python3 "$LIB" ports 3)"
    {
        printf '[server]\nlisten = ["127.0.0.1:%s"]\nthreads = 1\naccess_log = "off"\n\n' "$port"
        printf '[admin]\nlisten = "127.0.0.1:%s"\n\n[limiter]\nbackend = "%s"\n' "$admin" "$backend"
        [ "$backend" = redis ] && printf 'url = "redis://127.0.0.1:%s/0"\ntimeout = "50ms"\n' "$REDIS_PORT"
        printf '\n[rls]\nlisten = "127.0.0.1:%s"\nconfig = ["%s/rules/*.yaml"]\n\n' "$rls" "$TMP"
        printf '[upstreams.origin]\nservers = ["127.0.0.1:%s"]\n\n' "$UP_PORT"
        printf '[[routes]]\nname = "bench"\npath_prefix = "/"\nupstream = "origin"\npolicies = []\n'
    } >"$TMP/conf/$backend.toml"
    start_sluice "rls-$backend" "$TMP/conf/$backend.toml" "$port" || die "sluice did not start"
    pid=$BG_PID
    url="http://127.0.0.1:$rls/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
    h2() {
        h2load -c "$CONNECTIONS" -m "$STREAMS" -D "$1" -d "$TMP/call.bin" \
            -H 'content-type: application/grpc' -H 'te: trailers' "$url"
    }
    h2 1 >/dev/null 2>&1 || true   # warm-up
    t0=$(ticks "$pid"); s0=$(date +%s.%N)
    h2 "$DURATION" >"$TMP/log/h2load-$backend.txt" 2>&1 || die "h2load failed: $(tail -n 3 "$TMP/log/h2load-$backend.txt")"
    t1=$(ticks "$pid"); s1=$(date +%s.%N)
    python3 - "$TMP/log/h2load-$backend.txt" "$t0" "$t1" "$s0" "$s1" "$backend" <<'EOF'
import os, re, sys
text = open(sys.argv[1]).read()
t0, t1, s0, s1 = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
done = int(re.search(r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded", text).group(2))
ok2xx = int(re.search(r"status codes: (\d+) 2xx", text).group(1))
rps = float(re.search(r"finished in [\d.]+\w*, ([\d.]+) req/s", text).group(1))
cpu = (t1 - t0) / os.sysconf("SC_CLK_TCK")
secs = s1 - s0
assert ok2xx == done, f"{ok2xx} of {done} calls answered 200"
print(f"| {sys.argv[6]} | {rps:,.0f} | {100 * cpu / secs:.0f} | {1e6 * cpu / done:.1f} | {done / cpu:,.0f} |")
EOF
    stop_bg "$pid"
done
echo
echo "h2load -c $CONNECTIONS -m $STREAMS -D $DURATION; sluice threads = 1 ($SLUICE_VERSION); $(nproc) CPU(s)"
