#!/usr/bin/env bash
# sluice soak test: half of peak load for SOAK_SECONDS on the Redis backend; RSS and fds must stay flat.
# Usage: bench/soak.sh PATH/TO/sluice        (see bench/README.md, `make soak`)
#
# Environment (defaults in brackets):
#   SOAK_SECONDS [600]        length of the paced load
#   SOAK_INTERVAL [10]        seconds between samples of RSS, open fds and req/s
#   SOAK_BASELINE [60]        the baseline sample: t = this many seconds (end of the first minute)
#   SOAK_MAX_GROWTH_PCT [10]  allowed growth of RSS and of the fd count over the baseline
#   SOAK_MAX_ERROR_PCT [0.1]  allowed share of requests answered neither 2xx nor 429, or failed
#   PEAK_DURATION [5s]        the unpaced wrk run that finds peak load (after a 1 s warm-up)
#   CONNECTIONS [64]  THREADS [2]   wrk connections and threads, for peak and soak alike
#   WORKERS [1]               sluice `[server] threads` (the other core serves wrk, nginx, Redis)
#   IPS [1000]  KEYS [500]    distinct client addresses / API keys in the load (>= 200 each)
#   OUT [bench/results/soak-latest.md]   where the Markdown result is written
#   KEEP_TMP [0]              1 = keep the temp dir (configs, logs, samples, raw wrk output)
#
# Rule (also written into the result): samples are taken every SOAK_INTERVAL s from the
# start of the paced load; the baseline is the sample at t = SOAK_BASELINE s. The soak FAILS
# (exit 1) if any later sample's VmRSS (/proc/PID/status) or open fd count (/proc/PID/fd)
# is more than SOAK_MAX_GROWTH_PCT % above the baseline's, if sluice dies, if a sample is
# missing, or if more than SOAK_MAX_ERROR_PCT % of the requests got a status other than
# 2xx/429 (sluice_http_requests_total) or a wrk socket error. Exit 0 = PASS, 2 = bad usage/config.
#
# Everything listens on 127.0.0.1 only, on free ports, in a temp dir; every process this
# script starts is killed on exit; the load and the sampling loop are bounded in time.
set -euo pipefail

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
INVOCATION="$0 $*"

usage() {
    sed -n '2,26p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}
[ $# -eq 1 ] || usage
case "$1" in -h|--help) usage ;; esac

SOAK_SECONDS=${SOAK_SECONDS:-600}
SOAK_INTERVAL=${SOAK_INTERVAL:-10}
SOAK_BASELINE=${SOAK_BASELINE:-60}
SOAK_MAX_GROWTH_PCT=${SOAK_MAX_GROWTH_PCT:-10}
SOAK_MAX_ERROR_PCT=${SOAK_MAX_ERROR_PCT:-0.1}
PEAK_DURATION=${PEAK_DURATION:-5s}
CONNECTIONS=${CONNECTIONS:-64}
THREADS=${THREADS:-2}
WORKERS=${WORKERS:-1}
IPS=${IPS:-1000}
KEYS=${KEYS:-500}
OUT=${OUT:-$BENCH_DIR/results/soak-latest.md}
KEEP_TMP=${KEEP_TMP:-0}

LOG_TAG=soak
# shellcheck source=bench/lib.sh
. "$BENCH_DIR/lib.sh"

for v in SOAK_SECONDS SOAK_INTERVAL SOAK_BASELINE CONNECTIONS THREADS WORKERS IPS KEYS; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "$v must be a positive integer (got '${!v}')"
done
for v in SOAK_MAX_GROWTH_PCT SOAK_MAX_ERROR_PCT; do
    [[ ${!v} =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "$v must be a number (got '${!v}')"
done
[ "$CONNECTIONS" -ge "$THREADS" ] || die "CONNECTIONS ($CONNECTIONS) must be >= THREADS ($THREADS)"
[ "$IPS" -ge 200 ] && [ "$KEYS" -ge 200 ] || die "IPS and KEYS must be >= 200 (else ordinary clients hit the limits)"
[ "$SOAK_BASELINE" -ge "$SOAK_INTERVAL" ] || die "SOAK_BASELINE must be >= SOAK_INTERVAL"
[ "$SOAK_SECONDS" -ge $((SOAK_BASELINE + SOAK_INTERVAL)) ] \
    || die "SOAK_SECONDS ($SOAK_SECONDS) must leave at least one sample after SOAK_BASELINE ($SOAK_BASELINE)"

require_python
PEAK_S=$(python3 "$LIB" seconds "$PEAK_DURATION")
ensure_tools wrk nginx redis-server redis-cli timeout setsid
resolve_sluice "$1"

bench_tmp sluice-soak

# soak_conf FILE PORT ADMIN_PORT LIMIT: Redis backend, two gcra policies (client_ip, API key)
soak_conf() {
    cat >"$1" <<EOF
[server]
listen = ["127.0.0.1:$2"]
threads = $WORKERS
access_log = "off"
trusted_proxies = ["127.0.0.1/32"]
client_ip_header = "x-forwarded-for"

[admin]
listen = "127.0.0.1:$3"

[limiter]
backend = "redis"
url = "redis://127.0.0.1:$REDIS_PORT/0"
timeout = "50ms"

[upstreams.origin]
servers = ["127.0.0.1:$UP_PORT"]

[policies.per_ip]
algorithm = "gcra"
limit = $4
period = "1s"
key = ["client_ip"]

[policies.per_key]
algorithm = "gcra"
limit = $4
period = "1s"
key = ["header:x-api-key"]

[[routes]]
name = "soak"
path_prefix = "/"
upstream = "origin"
policies = ["per_ip", "per_key"]
EOF
}

# wrk_soak SECONDS OUTFILE RATE(0 = unpaced): wrk with bench/soak.lua, bounded by timeout
wrk_soak() {
    run_bounded "$1" "$2" wrk -t"$THREADS" -c"$CONNECTIONS" -d"$1s" --latency -s "$BENCH_DIR/soak.lua" \
        "http://127.0.0.1:$PORT/" -- "$3" "$THREADS" "$IPS" "$KEYS"
}

start_upstream
start_redis

# Pre-flight: both configs must pass `sluice check` before any load is spent.
read -r PORT ADMIN <<<"$(python3 "$LIB" ports 2)"
soak_conf "$TMP/conf/peak.toml" "$PORT" "$ADMIN" 100000000
soak_conf "$TMP/conf/preflight.toml" "$PORT" "$ADMIN" 1000
sluice_check "$TMP/conf/peak.toml"
sluice_check "$TMP/conf/preflight.toml"
log "sluice check accepted the configs ($SLUICE_VERSION)"

FREE_AT_START=$(free -h)
LOAD_AT_START=$(cut -d' ' -f1-3 /proc/loadavg)

# ------------------------------------------------------------------ peak
start_sluice peak "$TMP/conf/peak.toml" "$PORT" || die "sluice did not start (see above)"
PEAK_PID=$BG_PID
wrk_soak 1 "$TMP/peak.warmup.txt" 0 || true
log "peak: wrk -t$THREADS -c$CONNECTIONS -d${PEAK_S}s, unpaced"
wrk_soak "$PEAK_S" "$TMP/peak.wrk.txt" 0 || die "the peak wrk run failed: $(tail -n 3 "$TMP/peak.wrk.txt")"
alive "$PEAK_PID" || die "sluice died during the peak run: $(tail -n 3 "$TMP/log/peak.log")"
python3 "$LIB" wrk "$TMP/peak.wrk.txt" >&2 || die "no result from the peak wrk run"
stop_bg "$PEAK_PID"
PEAK_RPS=$(awk '/^Requests\/sec:/ {printf "%d", $2}' "$TMP/peak.wrk.txt")
[ "${PEAK_RPS:-0}" -ge 100 ] || die "peak is only '${PEAK_RPS:-?}' req/s: something is wrong"
TARGET_RPS=$((PEAK_RPS / 2))
# The hot address and the hot key each send 2% of the requests: twice the limit.
LIMIT=$(( (TARGET_RPS + 99) / 100 ))
[ "$LIMIT" -ge 10 ] || LIMIT=10
COLD_MARGIN=$(( (IPS < KEYS ? IPS : KEYS) / 100 ))
log "peak $PEAK_RPS req/s -> soak at $TARGET_RPS req/s, limits $LIMIT per 1s"

# ------------------------------------------------------------------ soak
redis_cli FLUSHALL >/dev/null
read -r PORT ADMIN <<<"$(python3 "$LIB" ports 2)"
soak_conf "$TMP/conf/soak.toml" "$PORT" "$ADMIN" "$LIMIT"
start_sluice soak "$TMP/conf/soak.toml" "$PORT" || die "sluice did not start (see above)"
SLUICE_PID=$BG_PID
SAMPLES=$((SOAK_SECONDS / SOAK_INTERVAL + 1))
log "paced load: ${SOAK_SECONDS}s at $TARGET_RPS req/s, $SAMPLES samples every ${SOAK_INTERVAL}s (sluice pid $SLUICE_PID)"

# wrk runs 2 s longer than the sampling, so that the last sample is still under load
timeout -k 5 $((SOAK_SECONDS + 60)) wrk -t"$THREADS" -c"$CONNECTIONS" -d"$((SOAK_SECONDS + 2))s" --latency \
    -s "$BENCH_DIR/soak.lua" "http://127.0.0.1:$PORT/" -- "$TARGET_RPS" "$THREADS" "$IPS" "$KEYS" \
    >"$TMP/soak.wrk.txt" 2>&1 &
WRK_PID=$!
PGIDS+=("$WRK_PID")
sample_rc=0
timeout -k 5 $((SOAK_SECONDS + 60)) python3 "$LIB" soak-sample "$SLUICE_PID" "$ADMIN" "$SOAK_INTERVAL" \
    "$SAMPLES" "$TMP/samples.tsv" &
SAMPLER_PID=$!
PGIDS+=("$SAMPLER_PID")
wait "$SAMPLER_PID" || sample_rc=$?
drop_pgid "$SAMPLER_PID"
if [ $sample_rc -ne 0 ]; then
    note "sampling stopped early (exit $sample_rc); the load was stopped"
    kill -INT -- "-$WRK_PID" 2>/dev/null || true   # wrk prints what it measured on SIGINT
fi
wrk_rc=0
wait "$WRK_PID" || wrk_rc=$?
drop_pgid "$WRK_PID"
[ $wrk_rc -eq 0 ] || note "wrk exited $wrk_rc: $(tail -n 3 "$TMP/soak.wrk.txt" | tr '\n' ' ')"

SLUICE_ALIVE=0
if alive "$SLUICE_PID"; then
    SLUICE_ALIVE=1
    python3 "$LIB" get "$ADMIN" /metrics >"$TMP/metrics.final.txt" 2>/dev/null \
        || { note "the final /metrics scrape failed"; rm -f "$TMP/metrics.final.txt"; }
    if [ -e "$TMP/metrics.final.txt" ]; then
        read -r ea all <<<"$(awk '/^sluice_decisions_total\{/ {a += $NF; if ($0 ~ /decision="error_allowed"/) e += $NF}
            END {printf "%d %d", e, a}' "$TMP/metrics.final.txt")"
        [ "${ea:-0}" -eq 0 ] || note "$ea of $all policy decisions ($(awk -v e="$ea" -v a="$all" \
            'BEGIN {printf "%.1f", 100 * e / (a ? a : 1)}')%) fell back to on_error = allow (error_allowed): Redis answered too slowly (> 50 ms, the limiter timeout) or the circuit breaker was open; see the backend errors under decisions"
    fi
else
    note "sluice died during the soak; last lines of its log: $(tail -n 5 "$TMP/log/soak.log" | tr '\n' ' ')"
fi
python3 "$LIB" wrk "$TMP/soak.wrk.txt" >&2 || true

model=$(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo 2>/dev/null || true)
{
    echo "DATE=$(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "MACHINE=$(nproc) CPU(s) (nproc), ${model:-unknown CPU}, kernel $(uname -r), load average at start $LOAD_AT_START"
    echo "FREE=${FREE_AT_START//$'\n'/\\n}"
    echo "COMMAND=SOAK_SECONDS=$SOAK_SECONDS SOAK_INTERVAL=$SOAK_INTERVAL SOAK_BASELINE=$SOAK_BASELINE SOAK_MAX_GROWTH_PCT=$SOAK_MAX_GROWTH_PCT SOAK_MAX_ERROR_PCT=$SOAK_MAX_ERROR_PCT PEAK_DURATION=$PEAK_DURATION CONNECTIONS=$CONNECTIONS THREADS=$THREADS WORKERS=$WORKERS IPS=$IPS KEYS=$KEYS $INVOCATION"
    echo "VERSIONS=sluice: $SLUICE_VERSION; $(redis-server --version | cut -d' ' -f1-3); $(nginx -v 2>&1 | head -n1); $(wrk -v 2>&1 | head -n1 | cut -d' ' -f1-2)"
    for v in SOAK_SECONDS SOAK_INTERVAL SOAK_BASELINE SOAK_MAX_GROWTH_PCT SOAK_MAX_ERROR_PCT PEAK_DURATION \
        CONNECTIONS THREADS WORKERS IPS KEYS TARGET_RPS LIMIT COLD_MARGIN SLUICE_ALIVE; do
        echo "$v=${!v}"
    done
    echo "SOAK_SAMPLES=$SAMPLES"
} >"$TMP/params.txt"

rc=0
python3 "$LIB" soak-report "$TMP" >"$TMP/report.md" || rc=$?
[ -s "$TMP/report.md" ] || die "no report was produced"
mkdir -p "$(dirname "$OUT")"
cp "$TMP/report.md" "$OUT"
echo
cat "$TMP/report.md"
echo
log "result written to $OUT"
[ $rc -eq 0 ] || { log "soak FAILED"; exit 1; }
