# bench/lib.sh: shell helpers shared by bench/run.sh and bench/soak.sh (sourced, not run).
#
# The sourcing script sets, before sourcing: BENCH_DIR (this directory) and LOG_TAG (the
# prefix of its messages); before `bench_tmp`: KEEP_TMP (1 = keep the temp dir).
# Everything listens on 127.0.0.1 only, on free ports; every process started with
# start_bg / run_bounded is killed on exit; every load is bounded in time.

LIB="$BENCH_DIR/benchlib.py"

die() { echo "$LOG_TAG: error: $*" >&2; exit 1; }
log() { echo "$LOG_TAG: $*" >&2; }

require_python() {
    command -v python3 >/dev/null 2>&1 && python3 -c 'import sys; sys.exit(sys.version_info < (3, 8))' \
        || die "python3 (>= 3.8) is required: apt-get install -y python3"
}

# ------------------------------------------------------------------ tools
export PATH="$PATH:/usr/sbin:/sbin"
TMP_POLICY_RCD=""

# ensure_tools CMD...: install the Debian package of every missing command with apt-get
# (as root; otherwise print the exact apt-get line and exit 1), starting no service.
ensure_tools() {
    local pkgs=() p c
    for c in "$@"; do
        command -v "$c" >/dev/null 2>&1 && continue
        case $c in
            redis-cli) pkgs+=(redis-tools) ;;
            timeout) pkgs+=(coreutils) ;;
            setsid) pkgs+=(util-linux) ;;
            llvm-profdata-19) pkgs+=(llvm-19) ;;
            *) pkgs+=("$c") ;;
        esac
    done
    [ ${#pkgs[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "$LOG_TAG: missing tools. Install them with:" >&2
        echo "    sudo apt-get install -y ${pkgs[*]}" >&2
        exit 1
    fi
    log "installing ${pkgs[*]} with apt-get"
    local updated=0
    for p in "${pkgs[@]}"; do
        if [ $updated -eq 0 ] && ! apt-cache show "$p" >/dev/null 2>&1; then
            apt-get update -qq >&2 || die "apt-get update failed"
            updated=1
        fi
    done
    # Debian packages start their service (nginx on *:80, ...) on install; forbid that.
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        TMP_POLICY_RCD=/usr/sbin/policy-rc.d
    fi
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >&2; then
        [ $updated -eq 0 ] && apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >&2 \
            || die "apt-get install ${pkgs[*]} failed"
    fi
    if [ -n "$TMP_POLICY_RCD" ]; then rm -f "$TMP_POLICY_RCD"; TMP_POLICY_RCD=""; fi
    for c in "$@"; do
        command -v "$c" >/dev/null 2>&1 || die "$c still missing after apt-get install"
    done
}

# resolve_sluice PATH: sets SLUICE (absolute) and SLUICE_VERSION, or dies
resolve_sluice() {
    SLUICE=$1
    case "$SLUICE" in
        */*) [ -e "$SLUICE" ] && SLUICE="$(cd "$(dirname "$SLUICE")" && pwd)/$(basename "$SLUICE")" ;;
        *) SLUICE=$(command -v "$SLUICE" || echo "$SLUICE") ;;
    esac
    [ -x "$SLUICE" ] || die "sluice binary '$SLUICE' not found or not executable (build it: cargo build --release)"
    SLUICE_VERSION=$("$SLUICE" --version 2>&1 | head -n1) || die "'$SLUICE --version' failed: $SLUICE_VERSION"
    [ -n "$SLUICE_VERSION" ] || die "'$SLUICE --version' printed nothing: not a usable sluice build"
}

# ------------------------------------------------------------------ processes
PGIDS=()
FAILED=0
TMP=""

# bench_tmp NAME: create the temp dir $TMP (with log/ and conf/) and the exit/signal traps
bench_tmp() {
    TMP=$(mktemp -d "${TMPDIR:-/tmp}/$1.XXXXXX")
    chmod 755 "$TMP"          # nginx workers run as an unprivileged user
    mkdir -p "$TMP/log" "$TMP/conf"
    trap cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
}

cleanup() {
    local rc=$? g i
    trap - EXIT INT TERM
    for g in "${PGIDS[@]}"; do kill -TERM -- "-$g" 2>/dev/null || true; done
    for i in $(seq 50); do
        local alive=0
        for g in "${PGIDS[@]}"; do kill -0 -- "-$g" 2>/dev/null && alive=1; done
        [ $alive -eq 0 ] && break
        sleep 0.1
    done
    for g in "${PGIDS[@]}"; do kill -KILL -- "-$g" 2>/dev/null || true; done
    wait 2>/dev/null || true
    [ -n "$TMP_POLICY_RCD" ] && rm -f "$TMP_POLICY_RCD"
    if [ -n "$TMP" ]; then
        if [ "$KEEP_TMP" = 1 ] || [ $rc -ne 0 ]; then
            log "configs, logs and raw wrk output kept in $TMP"
        else
            rm -rf "$TMP"
        fi
    fi
    exit $rc
}

note() { echo "$*" >>"$TMP/notes.txt"; log "NOTE: $*"; }

# start_bg NAME CMD...: run CMD in its own session (process group = its pid), log to $TMP/log/NAME.log
start_bg() {
    local name=$1; shift
    setsid "$@" >"$TMP/log/$name.log" 2>&1 </dev/null &
    BG_PID=$!
    PGIDS+=("$BG_PID")
}

# stop_bg PID: SIGTERM its process group, SIGKILL after 10 s
stop_bg() {
    local pid=$1 i
    kill -TERM -- "-$pid" 2>/dev/null || true
    for i in $(seq 100); do
        kill -0 -- "-$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL -- "-$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    drop_pgid "$pid"
}

drop_pgid() {
    local g keep=()
    for g in "${PGIDS[@]}"; do [ "$g" = "$1" ] || keep+=("$g"); done
    PGIDS=("${keep[@]+"${keep[@]}"}")
}

alive() { kill -0 "$1" 2>/dev/null && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }

# run_bounded SECONDS OUTFILE CMD...: run CMD (output to OUTFILE), killed after SECONDS + 30 s
# (in the background and waited for, so that a signal to this script is handled at once;
#  timeout(1) puts itself and CMD in their own process group, which cleanup kills)
run_bounded() {
    local secs=$1 out=$2 rc=0 pid
    shift 2
    timeout -k 5 $((secs + 30)) "$@" >"$out" 2>&1 &
    pid=$!
    PGIDS+=("$pid")
    wait "$pid" || rc=$?
    drop_pgid "$pid"
    return $rc
}

free_port() { python3 "$LIB" ports 1; }

# wait_http PORT PID NAME: poll GET / for up to 15 s (over TLS when SCHEME=https)
wait_http() {
    if ! python3 "$LIB" wait "$1" 15 "$2" "${SCHEME:-http}" >/dev/null; then
        log "---- last lines of $TMP/log/$3.log ----"
        tail -n 30 "$TMP/log/$3.log" >&2 || true
        return 1
    fi
}

# ------------------------------------------------------------------ nginx, redis
# nginx_conf DIR PORT WORKERS HTTP_EXTRA SERVER_BODY [LISTEN_FLAGS, e.g. "ssl"]
nginx_conf() {
    local dir=$1 port=$2 workers=$3 http_extra=$4 server_body=$5 flags=${6:-}
    mkdir -p "$dir"
    cat >"$dir/nginx.conf" <<EOF
worker_processes $workers;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
worker_rlimit_nofile 65536;
events { worker_connections 16384; }
http {
    access_log off;
    default_type text/plain;
    keepalive_requests 100000000;
    keepalive_timeout 75s;
    client_body_temp_path $dir/client_body;
    proxy_temp_path $dir/proxy;
    fastcgi_temp_path $dir/fastcgi;
    uwsgi_temp_path $dir/uwsgi;
    scgi_temp_path $dir/scgi;
$http_extra
    server {
        listen 127.0.0.1:$port $flags;
$server_body
    }
}
EOF
}

# start_nginx NAME DIR: validate, then run in the foreground of its own process group
start_nginx() {
    local name=$1 dir=$2
    nginx -e "$dir/error.log" -p "$dir/" -c "$dir/nginx.conf" -t >"$TMP/log/$name.check" 2>&1 \
        || { cat "$TMP/log/$name.check" >&2; die "nginx rejected $dir/nginx.conf"; }
    start_bg "$name" nginx -e "$dir/error.log" -p "$dir/" -c "$dir/nginx.conf" -g 'daemon off;'
}

# start_upstream: nginx with one worker answering `return 200 "ok\n"`, and under /sse/ a
# 64 KiB Server-Sent-Events stream as an OpenAI-compatible API sends it (chunks of text,
# then the usage, then [DONE]); sets UP_PORT, UP_PID
start_upstream() {
    UP_PORT=$(free_port)
    mkdir -p "$TMP/sse"
    python3 - "$TMP/sse/stream" <<'PY'
import sys
text = 'data: {"choices":[{"index":0,"delta":{"content":"' + "token " * 40 + '"}}],"usage":null}\n\n'
end = ('data: {"choices":[],"usage":{"prompt_tokens":100,"completion_tokens":900,'
       '"total_tokens":1000}}\n\ndata: [DONE]\n\n')
body = text * ((65536 - len(end)) // len(text))
body += ": " + "x" * (65536 - len(body) - len(end) - 3) + "\n" + end
assert len(body) == 65536
open(sys.argv[1], "w").write(body)
PY
    nginx_conf "$TMP/conf/upstream" "$UP_PORT" 1 "" '        location / {
            return 200 "ok\n";
        }
        location /sse/ {
            alias '"$TMP"'/sse/;
            default_type text/event-stream;
        }'
    start_nginx upstream "$TMP/conf/upstream"
    UP_PID=$BG_PID
    wait_http "$UP_PORT" "$UP_PID" upstream || die "the upstream nginx did not start"
    log "upstream nginx on 127.0.0.1:$UP_PORT"
}

redis_cli() { timeout 10 redis-cli -h 127.0.0.1 -p "$REDIS_PORT" "$@"; }

# start_redis: a private redis-server without persistence; sets REDIS_PORT, REDIS_PID
start_redis() {
    local i
    REDIS_PORT=$(free_port)
    mkdir -p "$TMP/redis"
    start_bg redis redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --protected-mode yes \
        --save '' --appendonly no --daemonize no --dir "$TMP/redis" --logfile ''
    REDIS_PID=$BG_PID
    for i in $(seq 100); do
        [ "$(redis_cli PING 2>/dev/null)" = PONG ] && break
        alive "$REDIS_PID" || { tail "$TMP/log/redis.log" >&2; die "redis-server exited"; }
        sleep 0.1
    done
    [ "$(redis_cli PING 2>/dev/null)" = PONG ] || die "redis-server did not answer PING"
    log "redis-server on 127.0.0.1:$REDIS_PORT"
}

# ------------------------------------------------------------------ sluice
# sluice_check FILE: `sluice check` must accept it, else stop the whole run loudly
sluice_check() {
    local out rc=0
    out=$(timeout 60 "$SLUICE" check --config "$1" 2>&1) || rc=$?
    if [ $rc -ne 0 ]; then
        {
            echo
            echo "$LOG_TAG: FATAL: '$SLUICE check --config $1' rejected the config (exit $rc):"
            echo "$out" | sed 's/^/    /'
            echo "$LOG_TAG: the config was:"
            cat -n "$1" | sed 's/^/    /'
        } >&2
        exit 2
    fi
}

# start_sluice NAME FILE PORT: check, start, wait until it answers. Sets BG_PID. Returns 1 if it never answered.
start_sluice() {
    local name=$1 file=$2 port=$3
    sluice_check "$file"
    start_bg "$name" "$SLUICE" run --config "$file"
    if ! wait_http "$port" "$BG_PID" "$name"; then
        if alive "$BG_PID"; then
            note "$name ($file) did not answer GET / on 127.0.0.1:$port within 15 s"
        else
            note "$name ($file) exited before answering: $(tail -n 1 "$TMP/log/$name.log")"
        fi
        FAILED=1
        stop_bg "$BG_PID"
        return 1
    fi
}
