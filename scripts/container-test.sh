#!/usr/bin/env bash
# Builds the image from the Dockerfile as a user would (podman, on base images made by
# scripts/container-bases.sh) and checks it from outside: the quick start's /hello and its
# 429, /metrics, the HEALTHCHECK, the uid the process runs as, a mounted config, and a stop
# that drains an in-flight request and exits 0 within the grace period.
# Usage: scripts/container-test.sh   (root; `make container-test` installs podman, runc and
# mmdebstrap when missing)
set -euo pipefail
cd "$(dirname "$0")/.."
export CONTAINERS_CONF="$PWD/scripts/containers.conf"

image=sluice:test
quick="sluice-quick-$$"
mounted="sluice-mounted-$$"
work="$(mktemp -d)"
slow_pid=""
cleanup() {
    podman rm -f "$quick" "$mounted" >/dev/null 2>&1 || true
    [ -n "$slow_pid" ] && kill "$slow_pid" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

fail() {
    echo "FAIL: $*" >&2
    for c in "$quick" "$mounted"; do
        podman logs "$c" 2>/dev/null | tail -20 | sed "s/^/  $c: /" >&2 || true
    done
    exit 1
}
ok() { echo "ok: $*"; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# Polls a URL until it answers 200 (at most 20 s).
wait_ok() {
    for _ in $(seq 1 200); do
        [ "$(curl -s -o /dev/null -w '%{http_code}' "$1")" = 200 ] && return 0
        sleep 0.1
    done
    fail "$1 never answered 200"
}

scripts/container-bases.sh
# The docker format, since the OCI image format has no HEALTHCHECK.
start=$(date +%s)
podman build --format docker -t "$image" .
echo "built $image in $(( $(date +%s) - start )) s: $(podman image inspect -f '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1/1e6}')"

# 1. The quick start, as the README runs it, on published ports.
app=$(free_port) admin=$(free_port)
podman run -d --name "$quick" -p "127.0.0.1:$app:8080" -p "127.0.0.1:$admin:9091" "$image" >/dev/null
wait_ok "http://127.0.0.1:$admin/healthz"
body=$(curl -s "http://127.0.0.1:$app/hello")
[ "$body" = "hello from sluice" ] || fail "/hello answered '$body'"
ok "/hello answered 200 '$body'"
code=200 n=1
while [ "$code" = 200 ] && [ $n -lt 20 ]; do
    code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$app/hello")
    n=$((n + 1))
done
# per_ip in conf/sluice.toml: gcra, 5 per 10 s, so the 6th request is refused.
[ "$code" = 429 ] && [ $n = 6 ] || fail "expected the 6th /hello to get 429, got $code at request $n"
curl -s -D - -o /dev/null "http://127.0.0.1:$app/hello" | grep -qi '^retry-after:' \
    || fail "the 429 carries no Retry-After"
ok "the 6th /hello got 429 with Retry-After"

metrics=$(curl -s "http://127.0.0.1:$admin/metrics")
grep -q 'sluice_decisions_total{decision="rejected",policy="per_ip",route="hello"}' <<<"$metrics" \
    || fail "/metrics has no rejected per_ip decisions for route hello"
grep -q '^sluice_build_info' <<<"$metrics" || fail "/metrics has no sluice_build_info"
ok "/metrics counts the rejections"

podman healthcheck run "$quick" >/dev/null || fail "the HEALTHCHECK command failed"
health=$(podman inspect -f '{{.State.Health.Status}}' "$quick")
[ "$health" = healthy ] || fail "health is '$health'"
ok "the HEALTHCHECK reports $health"

pid=$(podman inspect -f '{{.State.Pid}}' "$quick")
uid=$(ps -o uid= -p "$pid" | tr -d ' ')
[ "$uid" = 10001 ] || fail "sluice runs as uid $uid"
ok "sluice runs as uid $uid (seen from the host)"
podman rm -f "$quick" >/dev/null

# 2. A mounted config with an upstream on the host that takes 2 s to answer, stopped while a
#    request to it is in flight.
gateway=$(podman network inspect podman -f '{{range .Subnets}}{{.Gateway}}{{end}}')
slow=$(free_port)
python3 scripts/slow-upstream.py "$slow" &
slow_pid=$!
cat > "$work/sluice.toml" <<EOF
[server]
listen = ["0.0.0.0:8080"]
grace_period = "8s"

[admin]
listen = "0.0.0.0:9091"

[upstreams.slow]
servers = ["$gateway:$slow"]

[[routes]]
name = "mounted"
path = "/mounted"
respond = { status = 200, body = "from the mounted config\n" }

[[routes]]
name = "slow"
path = "/slow"
upstream = "slow"
EOF
chmod 0644 "$work/sluice.toml"
app=$(free_port) admin=$(free_port)
podman run -d --name "$mounted" -p "127.0.0.1:$app:8080" -p "127.0.0.1:$admin:9091" \
    -v "$work/sluice.toml:/etc/sluice/sluice.toml:ro" "$image" >/dev/null
wait_ok "http://127.0.0.1:$admin/healthz"
body=$(curl -s "http://127.0.0.1:$app/mounted")
[ "$body" = "from the mounted config" ] || fail "/mounted answered '$body'"
ok "the mounted config is the one served"

# The file is rewritten in place (a file's bind mount keeps its inode: `sed -i` would not be
# seen) and reloaded with SIGHUP.
reloaded=$(sed 's/from the mounted config/reloaded from the mounted config/' "$work/sluice.toml")
printf '%s\n' "$reloaded" > "$work/sluice.toml"
podman kill --signal HUP "$mounted" >/dev/null
for _ in $(seq 1 50); do
    body=$(curl -s "http://127.0.0.1:$app/mounted")
    [ "$body" = "reloaded from the mounted config" ] && break
    sleep 0.1
done
[ "$body" = "reloaded from the mounted config" ] || fail "after SIGHUP /mounted answered '$body'"
ok "podman kill --signal HUP reloaded the mounted config"

curl -s -o "$work/slow.out" -w '%{http_code}' "http://127.0.0.1:$app/slow" > "$work/slow.code" &
inflight=$!
sleep 0.5
start=$(date +%s.%N)
podman stop -t 8 "$mounted" >/dev/null
took=$(echo "$(date +%s.%N) - $start" | bc)
wait "$inflight" || true
[ "$(cat "$work/slow.code")" = 200 ] && [ "$(cat "$work/slow.out")" = "slow answer" ] \
    || fail "the in-flight request got $(cat "$work/slow.code") '$(cat "$work/slow.out")'"
exit_code=$(podman inspect -f '{{.State.ExitCode}}' "$mounted")
[ "$exit_code" = 0 ] || fail "sluice exited $exit_code on stop"
(( $(echo "$took < 8" | bc) )) || fail "stop took ${took}s, past the 8 s grace period (killed)"
podman logs "$mounted" 2>&1 | grep -q 'draining' || fail "no draining in the log"
ok "podman stop drained the in-flight request and exited 0 in $(printf '%.1f' "$took") s (grace 8 s)"
echo "container test passed"
