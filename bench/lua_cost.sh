#!/usr/bin/env bash
# Redis server CPU per decision of sluice's Lua scripts, one algorithm at a time.
#
# Usage: bench/lua_cost.sh [[LABEL=]LUA_DIR ...]      (default: current=<repo>/lua)
#        bench/lua_cost.sh --script ALGORITHM [LUA_DIR]   print that script and exit
#        bench/lua_cost.sh --library [LUA_DIR]   print the Redis 7 function library and exit
#
# It measures the script form (EVALSHA), which sluice uses on servers without Redis
# functions; bench/lua_zipf.py measures the function library sluice calls by FCALL.
#
# For each algorithm it builds the script sluice sends for a one-policy request on that
# algorithm, the way src/limiter/scripts.rs `source()` assembles it (common.lua, the
# algorithm's file -- leaky_bucket also gets gcra.lua, ahead of it -- the generated line
# naming the algorithm, then decide.lua; a unit test in scripts.rs holds the two to the
# same text), loads it into a private redis-server, drives it with redis-benchmark
# (EVALSHA, mode "decide", now "" so the script reads TIME, a limit nothing reaches) and
# reads `usec_per_call` of `cmdstat_evalsha` from INFO commandstats: the server CPU of
# one decision, TIME/GET/SET included. For gcra the call is
#   EVALSHA <sha> 1 k{a}:p:gcra decide1 "" "gcra 100000000 1000 100000000 " 1
# A LUA_DIR from before the current script contract (generated `local ALGORITHMS = {...}`
# line, nine ARGV fields per check; or six, before issue #42) is built and called the way
# it expects.
#
# Several LUA_DIRs (say a copy of lua/ from before a change, then lua/) are measured A/B:
# every round measures every (algorithm, dir) pair, in reverse order on even rounds, and
# the table shows the median and the minimum over the rounds. The machine is noisy:
# compare medians and minima of several rounds, never one run.
#
# Environment (defaults in brackets):
#   ROUNDS [5]          rounds
#   REQUESTS [30000]    redis-benchmark -n per measurement
#   CLIENTS [4]         redis-benchmark -c
#   ALGORITHMS          subset, e.g. "gcra token_bucket"
#                       [fixed_window sliding_window sliding_log token_bucket gcra leaky_bucket concurrency]
#   PORT [16600]        port of the private redis-server (127.0.0.1); must be free
#   REDIS_SERVER [redis-server]  REDIS_CLI [redis-cli]  REDIS_BENCHMARK [redis-benchmark]
#
# Everything it starts (one redis-server, no persistence, in a temp dir) is stopped on exit.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROUNDS=${ROUNDS:-5}
REQUESTS=${REQUESTS:-30000}
CLIENTS=${CLIENTS:-4}
ALGORITHMS=${ALGORITHMS:-fixed_window sliding_window sliding_log token_bucket gcra leaky_bucket concurrency}
PORT=${PORT:-16600}
REDIS_SERVER=${REDIS_SERVER:-redis-server}
REDIS_CLI=${REDIS_CLI:-redis-cli}
REDIS_BENCHMARK=${REDIS_BENCHMARK:-redis-benchmark}

die() { echo "lua_cost: error: $*" >&2; exit 1; }
log() { echo "lua_cost: $*" >&2; }

case "${1:-}" in -h|--help) sed -n '2,38p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2 ;; esac

# The script of a one-policy call on algorithm $2, from lua dir $1 (as scripts.rs source()).
assemble() {
    local dir=$1 alg=$2 f files=("$2")
    [ "$alg" = leaky_bucket ] && files=(gcra leaky_bucket)
    cat "$dir/common.lua"
    for f in "${files[@]}"; do
        printf '\n'
        cat "$dir/$f.lua"
    done
    if grep -q 'NAME and ALGORITHM' "$dir/decide.lua"; then
        printf "\nlocal ALGORITHM, NAME, ALGORITHMS = %s, '%s', nil\n" "$alg" "$alg"
    else
        printf '\nlocal ALGORITHMS = { %s = %s, }\n' "$alg" "$alg"
    fi
    cat "$dir/decide.lua"
    # Since #42 decide.lua defines the entry point as a function; a script calls it.
    if grep -q '^local function decide(keys, argv)' "$dir/decide.lua"; then
        printf '\nreturn decide(KEYS, ARGV)\n'
    fi
}

# The function library of lua dir $1 (as scripts.rs library()): every algorithm and
# decide.lua, registered as function sluice_<the first 16 hex digits of the SHA-1 of that
# text>, which is also the library's name.
library() {
    local dir=$1 alg names="" body
    body=$(mktemp)
    cat "$dir/common.lua" >"$body"
    for alg in fixed_window sliding_window sliding_log token_bucket gcra leaky_bucket concurrency; do
        printf '\n' >>"$body"
        cat "$dir/$alg.lua" >>"$body"
        names+=" $alg = $alg,"
    done
    printf '\nlocal ALGORITHM, NAME, ALGORITHMS = nil, nil, {%s }\n' "$names" >>"$body"
    cat "$dir/decide.lua" >>"$body"
    local name
    name=sluice_$(sha1sum "$body" | cut -c1-16)
    printf '#!lua name=%s\n' "$name"
    cat "$body"
    printf "\nredis.register_function('%s', decide)\n" "$name"
    rm -f "$body"
}

if [ "${1:-}" = --library ]; then
    library "${2:-$ROOT/lua}"
    exit 0
fi
if [ "${1:-}" = --script ]; then
    if [ $# -lt 2 ] || [ ! -f "${3:-$ROOT/lua}/$2.lua" ]; then
        die "usage: $0 --script ALGORITHM [LUA_DIR]"
    fi
    assemble "${3:-$ROOT/lua}" "$2"
    exit 0
fi
for v in ROUNDS REQUESTS CLIENTS PORT; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "$v must be a positive integer (got '${!v}')"
done
for tool in "$REDIS_SERVER" "$REDIS_CLI" "$REDIS_BENCHMARK"; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool not found (apt-get install -y redis-server redis-tools)"
done

LABELS=()
DIRS=()
[ $# -gt 0 ] || set -- "current=$ROOT/lua"
for spec in "$@"; do
    if [[ $spec == *=* ]]; then label=${spec%%=*} dir=${spec#*=}; else label=$(basename "$spec") dir=$spec; fi
    if [ ! -f "$dir/decide.lua" ] || [ ! -f "$dir/common.lua" ]; then
        die "$dir: not a lua/ directory (no common.lua/decide.lua)"
    fi
    LABELS+=("$label")
    DIRS+=("$(cd "$dir" && pwd)")
done
for a in $ALGORITHMS; do
    [ -f "${DIRS[0]}/$a.lua" ] || die "unknown algorithm '$a'"
done

TMP=$(mktemp -d)
SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ]; then
        kill "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

cli() { "$REDIS_CLI" -p "$PORT" "$@"; }

if cli ping >/dev/null 2>&1; then
    die "port $PORT already answers; pick another with PORT=..."
fi
"$REDIS_SERVER" --port "$PORT" --bind 127.0.0.1 --save '' --appendonly no \
    --dir "$TMP" --daemonize no --loglevel warning >"$TMP/redis.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 100); do cli ping >/dev/null 2>&1 && break; sleep 0.05; done
cli ping >/dev/null 2>&1 || die "redis-server did not start: $(cat "$TMP/redis.log")"
log "$("$REDIS_SERVER" --version | cut -d' ' -f1-3) on port $PORT; $ROUNDS rounds of $REQUESTS calls, $CLIENTS clients"

# ARGV after the key, '|'-separated, for lua dir $1 and algorithm $2: decide with now ""
# (read TIME), one check of cost 1 that nothing will deny (concurrency: lease 1).
args_for() {
    local dir=$1 alg=$2 lease=0
    [ "$alg" = concurrency ] && lease=1
    if grep -q 'local FIELDS = 9' "$dir/decide.lua"; then
        # mode, now, charged_at; algorithm, limit, period, burst, max_delay, lease_ms,
        # cost, enforce, lease
        echo "decide|||$alg|100000000|1000|100000000||60000|1|1|$lease"
    elif grep -q 'local FIELDS = 2' "$dir/decide.lua"; then
        # mode with enforce flag, now; the rule in one argument, cost (issue #42)
        if [ "$alg" = concurrency ]; then
            echo "decide1||$alg 100000000 1000 60000 $lease|1"
        else
            echo "decide1||$alg 100000000 1000 100000000 |1"
        fi
    elif [ "$alg" = concurrency ]; then
        # mode with enforce flag, now; algorithm, limit, period, lease_ms, lease, cost
        echo "decide1||$alg|100000000|1000|60000|$lease|1"
    else
        # mode with enforce flag, now; algorithm, limit, period, burst, max_delay, cost
        echo "decide1||$alg|100000000|1000|100000000||1"
    fi
}

declare -A SHA
for i in "${!DIRS[@]}"; do
    for alg in $ALGORITHMS; do
        assemble "${DIRS[$i]}" "$alg" >"$TMP/$i-$alg.lua"
        sha=$(cli -x SCRIPT LOAD <"$TMP/$i-$alg.lua")
        [[ $sha =~ ^[0-9a-f]{40}$ ]] || die "${LABELS[$i]} $alg: SCRIPT LOAD failed: $sha"
        SHA[$i,$alg]=$sha
        # One call by hand: the script must answer {now, charged, then a verdict}.
        IFS='|' read -r -a argv <<<"$(args_for "${DIRS[$i]}" "$alg")"
        # (Each dir's own state: another layout may have left the key.)
        cli FLUSHALL >/dev/null
        reply=$(cli EVALSHA "$sha" 1 "k{a}:p:$alg" "${argv[@]}" 2>&1 | tr -d '\0' | tr '\n' ' ')
        # Since #42 a packed string of five 64-bit integers (40 bytes).
        [[ $reply =~ ^[0-9]+(\ [0-9]+){4,6}\ $ ]] ||
            [ "$(cli --no-raw EVALSHA "$sha" 1 "k{a}:p:$alg" "${argv[@]}" | cut -c1-2)" = '"\' ] ||
            die "${LABELS[$i]} $alg: unexpected reply: $reply"
    done
done

# One measurement: usec_per_call of EVALSHA for (dir index $1, algorithm $2).
measure() {
    local i=$1 alg=$2 stats calls failed
    IFS='|' read -r -a argv <<<"$(args_for "${DIRS[$i]}" "$alg")"
    cli FLUSHALL >/dev/null
    cli CONFIG RESETSTAT >/dev/null
    "$REDIS_BENCHMARK" -p "$PORT" -n "$REQUESTS" -c "$CLIENTS" -q \
        EVALSHA "${SHA[$i,$alg]}" 1 "k{a}:p:$alg" "${argv[@]}" >/dev/null
    stats=$(cli INFO commandstats | tr -d '\r' | grep '^cmdstat_evalsha:') || die "no cmdstat_evalsha"
    calls=$(sed -E 's/.*[:,]calls=([0-9]+).*/\1/' <<<"$stats")
    failed=$(sed -nE 's/.*failed_calls=([0-9]+).*/\1/p' <<<"$stats")
    [ "$calls" -ge "$REQUESTS" ] || die "${LABELS[$i]} $alg: only $calls calls: $stats"
    [ "${failed:-0}" -eq 0 ] || die "${LABELS[$i]} $alg: failed calls: $stats"
    sed -E 's/.*usec_per_call=([0-9.]+).*/\1/' <<<"$stats"
}

PAIRS=()
for alg in $ALGORITHMS; do
    for i in "${!DIRS[@]}"; do PAIRS+=("$i $alg"); done
done
declare -A RESULTS
for round in $(seq "$ROUNDS"); do
    order=("${PAIRS[@]}")
    if [ $((round % 2)) -eq 0 ]; then
        order=()
        for ((j = ${#PAIRS[@]} - 1; j >= 0; j--)); do order+=("${PAIRS[$j]}"); done
    fi
    line=""
    for pair in "${order[@]}"; do
        read -r i alg <<<"$pair"
        u=$(measure "$i" "$alg")
        RESULTS[$i,$alg]="${RESULTS[$i,$alg]:-} $u"
        line+=" ${LABELS[$i]}/$alg=$u"
    done
    log "round $round:$line"
done

# median and min of the numbers in $1
stats_of() {
    tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{ v[NR] = $1 } END {
        m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
        printf "%.2f|%.2f", m, v[1] }'
}

header="| algorithm |"
rule="|---|"
for label in "${LABELS[@]}"; do
    header+=" $label median | $label min |"
    rule+="---:|---:|"
done
echo
echo "usec_per_call of EVALSHA (Redis server CPU per one-policy decision), $ROUNDS rounds × $REQUESTS calls, -c $CLIENTS"
echo
echo "$header"
echo "$rule"
for alg in $ALGORITHMS; do
    row="| $alg |"
    for i in "${!DIRS[@]}"; do
        IFS='|' read -r med min <<<"$(stats_of "${RESULTS[$i,$alg]}")"
        row+=" $med | $min |"
    done
    echo "$row"
done
