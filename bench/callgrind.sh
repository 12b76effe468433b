#!/usr/bin/env bash
# Instructions per proxied request, counted by callgrind: a figure this noisy machine cannot
# blur (the same binary, config and requests give the same count whatever else runs).
#
# Usage: bench/callgrind.sh SLUICE [BASELINE_SLUICE]
#
# For each case (sluice without a policy; sluice with one memory gcra policy per client IP;
# with PREFETCH=1 also that policy on Redis with `prefetch`, one hot key, so requests are
# admitted from held units (DESIGN section 19); nginx proxying the same request as the
# reference), the proxy runs under
# `valgrind --tool=callgrind` twice: once serving N requests, once 2N, all GET / over
# CONNECTIONS keep-alive connections (one by default) to an nginx upstream that answers
# `return 200 "ok\n"`. The figure
# is (instructions at 2N - instructions at N) / N: start-up, the readiness probe and shutdown
# cancel out. sluice runs with `threads = 1`, nginx with one worker and no master; every
# thread of the process is counted. With BASELINE_SLUICE, its rows run beside this build's
# and the report adds the ratio.
#
# Environment (defaults in brackets):
#   REQUESTS [2000]   N
#   CONNECTIONS [1]   keep-alive connections, all in flight at once: each round sends one
#                     request on every connection, then reads every response (N a multiple)
#   PREFETCH [0]      1 = add the row "gcra, Redis with prefetch" (`max = 1024, hold = "10s"`:
#                     valgrind is slow, and a key is hot from an eighth of max within hold; a
#                     private redis-server); its cold start and takes cancel out in 2N - N
#   ADAPTIVE [0]      1 = add the row "no policy, adaptive upstream": the no-policy case with
#                     `adaptive = { min_limit = 256, initial_limit = 256 }` on the upstream
#                     (DESIGN section 22: every request takes a slot and is a latency sample,
#                     none is shed)
#   OUT [bench/results/callgrind.md]   where the Markdown report is written
#   KEEP_TMP [0]      1 = keep the temp dir (configs, logs, callgrind outputs)
#   TOOL [callgrind]  cachegrind = also simulate the caches (`--cache-sim=yes`, D1 32 KiB,
#                     last level LL): the report adds data cache misses per request, first
#                     level and last level, which is what grows with CONNECTIONS (each
#                     connection's state is another cold line when the working set is past LL)
#   LL [2097152,16,64]  cachegrind's last-level cache (size,ways,line): one core's L2 share;
#                     try 33554432,16,64 for a whole L3

set -euo pipefail
BENCH_DIR="$(cd "$(dirname "$0")" && pwd)"
LOG_TAG=callgrind
KEEP_TMP=${KEEP_TMP:-0}
# shellcheck source=bench/lib.sh
. "$BENCH_DIR/lib.sh"

N=${REQUESTS:-2000}
TOOL=${TOOL:-callgrind}
case $TOOL in
    callgrind) VG_ARGS=(--tool=callgrind) ;;
    cachegrind) VG_ARGS=(--tool=cachegrind --cache-sim=yes --D1=32768,8,64 --LL="${LL:-2097152,16,64}") ;;
    *) die "TOOL must be callgrind or cachegrind" ;;
esac
C=${CONNECTIONS:-1}
[ $((N % C)) -eq 0 ] || die "REQUESTS ($N) must be a multiple of CONNECTIONS ($C)"
OUT=${OUT:-$BENCH_DIR/results/callgrind.md}
[ $# -ge 1 ] || die "usage: bench/callgrind.sh SLUICE [BASELINE_SLUICE]"
require_python
ensure_tools valgrind nginx setsid timeout
resolve_sluice "$1"
NEW=$SLUICE
BASE=""
if [ $# -ge 2 ]; then resolve_sluice "$2"; BASE=$SLUICE; fi
bench_tmp sluice-callgrind
start_upstream

# requests PORT COUNT: COUNT GETs of / over $C keep-alive connections, one request in flight
# on each at a time; each must be a 200
requests() {
    python3 - "$1" "$2" "$C" <<'PY'
import asyncio, sys
port, count, conns = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

async def one(reader, writer):
    writer.write(b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 300)
    if not head.startswith(b"HTTP/1.1 200"):
        sys.exit(f"status: {head[:40]!r}")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    await reader.readexactly(length)

async def main():
    pairs = [await asyncio.open_connection("127.0.0.1", port) for _ in range(conns)]
    for _ in range(count // conns):
        await asyncio.gather(*(one(r, w) for r, w in pairs))
    for _, w in pairs:
        w.close()

asyncio.run(main())
PY
}

# sluice_config FILE PORT ADMIN_PORT POLICY(none|gcra|prefetch|adaptive)
sluice_config() {
    {
        printf '[server]\nlisten = ["127.0.0.1:%s"]\nthreads = 1\naccess_log = "off"\n' "$2"
        printf 'grace_period = "1s"\n\n[admin]\nlisten = "127.0.0.1:%s"\n\n' "$3"
        printf '[upstreams.origin]\nservers = ["127.0.0.1:%s"]\n' "$UP_PORT"
        [ "$4" = adaptive ] && printf 'adaptive = { min_limit = 256, initial_limit = 256 }\n'
        printf '\n'
        if [ "$4" = prefetch ]; then
            printf '[limiter]\nbackend = "redis"\nurl = "redis://127.0.0.1:%s/0"\ntimeout = "500ms"\n\n' "$REDIS_PORT"
        fi
        if [ "$4" != none ] && [ "$4" != adaptive ]; then
            printf '[policies.per_ip]\nalgorithm = "gcra"\nlimit = 100000000\nperiod = "1s"\nkey = ["client_ip"]\n'
            [ "$4" = prefetch ] && printf 'prefetch = { max = 1024, hold = "10s" }\n'
            printf '\n'
        fi
        printf '[[routes]]\nname = "bench"\npath_prefix = "/"\nupstream = "origin"\n'
        [ "$4" != none ] && [ "$4" != adaptive ] && printf 'policies = ["per_ip"]\n'
        true
    } >"$1"
}

# count NAME COUNT CMD...: run CMD under $TOOL, send COUNT requests to $PORT, stop it
# with SIGTERM (SIGQUIT for nginx), and print what it counted: instructions (callgrind), or
# instructions, D1 misses and LL misses, reads and writes together (cachegrind)
count() {
    local name=$1 n=$2 out; shift 2
    out="$TMP/$name.$n.callgrind"
    start_bg "$name.$n" valgrind "${VG_ARGS[@]}" --"$TOOL"-out-file="$out" "$@"
    local pid=$BG_PID
    python3 "$LIB" wait "$PORT" 120 "$pid" http >/dev/null \
        || { tail -n 20 "$TMP/log/$name.$n.log" >&2; die "$name did not answer under valgrind"; }
    requests "$PORT" "$n" || die "$name: a request failed"
    kill -"${STOP_SIGNAL:-TERM}" "$pid"
    local i
    for i in $(seq 600); do alive "$pid" || break; sleep 0.1; done
    alive "$pid" && die "$name did not exit within 60 s of SIGTERM"
    # The tool may still be writing its file as the process ends.
    for i in $(seq 1200); do grep -qE '^(summary|totals):' "$out" 2>/dev/null && break; sleep 0.1; done
    grep -qE '^(summary|totals):' "$out" 2>/dev/null || die "$name: $TOOL wrote no totals to $out"
    # cachegrind's events: Ir I1mr ILmr Dr D1mr DLmr Dw D1mw DLmw
    awk -v tool="$TOOL" '/^(summary|totals):/ {
        if (tool == "cachegrind") print $2 "," $6 + $9 "," $7 + $10; else print $2; exit }' "$out"
}

# per_request NAME CMD...: (count at 2N - count at N) / N, to one decimal; with cachegrind
# the instructions, then "|" and the D1 and LL misses as table cells
per_request() {
    local name=$1 a b; shift
    a=$(count "$name" "$N" "$@")
    b=$(count "$name" "$((2 * N))" "$@")
    python3 -c "
a, b = [$a], [$b]
d = [(y - x) / $N for x, y in zip(a, b)]
print(f'{d[0]:.1f}' + ''.join(f'|{v:.1f}' for v in d[1:]))"
}

ROWS=()
row() {
    local ir=${3%%|*} rest=""
    [ "$ir" != "$3" ] && rest=" | ${3#*|}" && rest=${rest//|/ | }
    ROWS+=("| $1 | $2 | $(python3 -c "print(f'{$ir / 1000:.1f}k')")$rest |")
    log "$1 $2: $3 per request"
}

CASES=(none gcra)
[ "${ADAPTIVE:-0}" = 1 ] && CASES+=(adaptive)
if [ "${PREFETCH:-0}" = 1 ]; then
    ensure_tools redis-server redis-cli
    start_redis
    CASES+=(prefetch)
fi
for policy in "${CASES[@]}"; do
    for bin in "$NEW" ${BASE:+"$BASE"}; do
        label="this build"
        [ "$bin" = "$BASE" ] && label="baseline"
        PORT=$(free_port)
        admin=$(free_port)
        sluice_config "$TMP/conf/$policy.toml" "$PORT" "$admin" "$policy"
        sluice_check "$TMP/conf/$policy.toml"
        ir=$(per_request "sluice-$policy" "$bin" run --config "$TMP/conf/$policy.toml")
        case $policy in
            none) what="no policy" ;;
            gcra) what="gcra, memory" ;;
            prefetch) what="gcra, Redis with prefetch" ;;
            adaptive) what="no policy, adaptive upstream" ;;
        esac
        row "sluice, $what" "$label" "$ir"
        eval "IR_${policy}_$([ "$label" = baseline ] && echo base || echo new)=${ir%%|*}"
    done
done

PORT=$(free_port)
nginx_conf "$TMP/conf/nginx" "$PORT" 1 "    upstream origin { server 127.0.0.1:$UP_PORT; keepalive 64; }" '        location / {
            proxy_pass http://origin;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }'
nginx -p "$TMP/conf/nginx/" -c "$TMP/conf/nginx/nginx.conf" -t >/dev/null 2>&1 || die "nginx rejected its config"
ir=$(STOP_SIGNAL=QUIT per_request nginx nginx -e "$TMP/conf/nginx/error.log" -p "$TMP/conf/nginx/" \
    -c "$TMP/conf/nginx/nginx.conf" -g 'daemon off; master_process off;')
row "nginx proxy, keepalive" "reference" "$ir"

{
    echo "# Instructions per proxied request ($TOOL)"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'); $(valgrind --version); $(nginx -v 2>&1)"
    echo "- command: \`REQUESTS=$N CONNECTIONS=$C$([ "${PREFETCH:-0}" = 1 ] && echo " PREFETCH=1")$([ "${ADAPTIVE:-0}" = 1 ] && echo " ADAPTIVE=1")$([ "$TOOL" = cachegrind ] && echo " TOOL=cachegrind LL=${LL:-2097152,16,64}") bench/callgrind.sh $*\`"
    echo "- each figure: (instructions at $((2 * N)) requests - at $N) / $N, $C keep-alive connection(s) with one request in flight on each, GET / to an nginx \`return 200\` upstream; sluice threads = 1, nginx one worker without master"
    echo
    if [ "$TOOL" = cachegrind ]; then
        echo "| proxy | build | instructions / request | D1 misses / request | LL misses / request |"
        echo "|---|---|---:|---:|---:|"
    else
        echo "| proxy | build | instructions / request |"
        echo "|---|---|---:|"
    fi
    printf '%s\n' "${ROWS[@]}"
    if [ -n "$BASE" ]; then
        echo
        echo "this build / baseline: no policy $(python3 -c "print(f'{$IR_none_new / $IR_none_base:.3f}')")x, gcra $(python3 -c "print(f'{$IR_gcra_new / $IR_gcra_base:.3f}')")x"
    fi
} >"$OUT"
log "report written to $OUT"
cat "$OUT"
