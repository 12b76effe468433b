#!/usr/bin/env bash
# The Debian package as an operator meets it (DESIGN §23), in a Debian container booted with
# systemd as PID 1 (an image made from Debian's packages with mmdebstrap, as
# scripts/container-bases.sh makes its bases, once, then reused): `apt install` of the .deb,
# the unit enabled and active, the quick start's /hello and its 429 and /metrics, an edited
# config applied by `systemctl reload` with the same MainPID, an upgrade that keeps the
# edited conffile and restarts, an upgrade whose installed config fails `sluice check` that
# keeps the old process serving, a `systemctl stop` that drains an in-flight request, and an
# `apt purge` that stops it and leaves nothing behind. Also lintian and `systemd-analyze security` on it.
# Usage: scripts/deb-test.sh DEB   (root; `make deb-test` builds DEB and installs podman,
# runc, mmdebstrap and lintian when missing)
set -euo pipefail
cd "$(dirname "$0")/.."
export CONTAINERS_CONF="$PWD/scripts/containers.conf"
# shellcheck source=scripts/container-bases.sh
source scripts/container-bases.sh

deb="$(realpath "$1")"
image=sluice-systemd:bookworm
box="sluice-deb-$$"
work="$(mktemp -d)"
slow_pid=""
cleanup() {
    podman rm -f -t 0 "$box" >/dev/null 2>&1 || true
    [ -n "$slow_pid" ] && kill "$slow_pid" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
# A command that fails outside a check says where (functions included: -E), instead of
# ending the test silently.
set -E
trap 'echo "FAIL: line $LINENO: $BASH_COMMAND (exit $?)" >&2' ERR

fail() {
    echo "FAIL: $*" >&2
    podman exec "$box" journalctl -u sluice --no-pager -n 30 2>/dev/null | sed 's/^/  journal: /' >&2 || true
    exit 1
}
ok() { echo "ok: $*"; }
in_box() { podman exec "$box" "$@"; }
# put FILE PATH: FILE's bytes into PATH in the container, as an editor saving it would.
put() { podman exec -i "$box" sh -c "cat > $2" < "$1"; }
main_pid() { in_box systemctl show -p MainPID --value sluice; }
# Waits until a URL inside the container answers 200 (at most 20 s).
wait_ok() {
    for _ in $(seq 1 100); do
        [ "$(in_box curl -s -o /dev/null -w '%{http_code}' "$1")" = 200 ] && return 0
        sleep 0.2
    done
    fail "$1 never answered 200"
}
# Waits until /hello answers the body given (at most 10 s).
wait_hello() {
    local body=""
    for _ in $(seq 1 50); do
        # Refused while a (re)started sluice is not listening yet: curl exits 7.
        body=$(in_box curl -s http://127.0.0.1:8080/hello || true)
        [ "$body" = "$1" ] && return 0
        sleep 0.2
    done
    fail "/hello answered '$body', not '$1'"
}
# repack VERSION: the package under test with another version, as a rebuild would make it.
repack() {
    rm -rf "$work/root"
    dpkg-deb -R "$deb" "$work/root"
    sed -i "s/^Version: .*/Version: $1/" "$work/root/DEBIAN/control"
    dpkg-deb -Zgzip -z1 --build "$work/root" "$work/sluice_$1.deb" >/dev/null
    podman cp "$work/sluice_$1.deb" "$box:/srv/"
}
# apt_install FILE: as an operator runs it, no prompt (a conffile prompt would fail it).
apt_install() {
    in_box env DEBIAN_FRONTEND=noninteractive apt-get install -y "/srv/$1" </dev/null 2>&1
}

# 0. The package itself: lintian, and the unit's exposure as systemd rates it.
echo "lintian $(lintian --version | awk '{print $2}') on $(basename "$deb"):"
lintian --fail-on error --display-info "$deb" | sed 's/^/  /'
ok "lintian reports no errors"
dpkg-deb -x "$deb" "$work/unpacked"
exposure=$(systemd-analyze security --offline=true --no-pager \
    "$work/unpacked/usr/lib/systemd/system/sluice.service" 2>&1 | tail -1)
echo "  $exposure"
level=$(grep -oE 'level for sluice.service: [0-9.]+' <<<"$exposure" | awk '{print $NF}')
[ -n "$level" ] && (( $(echo "$level <= 2.0" | bc) )) || fail "systemd-analyze security: $exposure"
ok "systemd-analyze security rates the unit $level (at most 2.0)"
depends=$(dpkg-deb -f "$deb" Depends)
grep -q 'procps' <<<"$depends" && grep -q 'libc6' <<<"$depends" || fail "Depends: $depends"
ok "Depends: $depends"

# 1. A booted Debian with systemd, without procps: the package must bring what the unit runs.
if ! have "$image"; then
    echo "making $image with mmdebstrap"
    debian_image "$image" --change 'CMD ["/sbin/init"]' -- --variant=minbase \
        --include=systemd,systemd-sysv,curl,ca-certificates
fi
start=$(date +%s)
podman run -d --name "$box" --systemd=always --cap-add=SYS_ADMIN "$image" /sbin/init >/dev/null
# Until systemd's socket is there, systemctl cannot connect: it says nothing on stdout.
state=""
for _ in $(seq 1 100); do
    state=$(in_box timeout 60 systemctl is-system-running --wait 2>/dev/null || true)
    [ -n "$state" ] && break
    sleep 0.2
done
case "$state" in
    running | degraded) ;;
    *) fail "the container's systemd is '$state'" ;;
esac
echo "booted in $(( $(date +%s) - start )) s: $state"
in_box dpkg -s procps >/dev/null 2>&1 && fail "the image already has procps"
podman cp "$deb" "$box:/srv/sluice.deb"
in_box apt-get update -qq
apt_install sluice.deb | tail -3 | sed 's/^/  apt: /'
in_box dpkg -s procps >/dev/null 2>&1 || fail "installing sluice did not install procps"
ok "apt installed $(in_box dpkg-query -W -f '${Package} ${Version}' sluice) and procps with it"
for f in /usr/bin/sluice /lib/systemd/system/sluice.service /etc/sluice/sluice.toml \
        /usr/share/sluice/grafana/sluice.json /usr/share/sluice/prometheus/alerts.yml \
        /usr/share/man/man1/sluice.1.gz /usr/share/man/man1/sluice-run.1.gz \
        /usr/share/bash-completion/completions/sluice /usr/share/zsh/vendor-completions/_sluice \
        /usr/share/doc/sluice/changelog.Debian.gz; do
    in_box test -s "$f" || fail "$f is not installed"
done
grep -q '/etc/sluice/sluice.toml' <<<"$(in_box dpkg-query -W -f '${Conffiles}' sluice)" \
    || fail "/etc/sluice/sluice.toml is not a conffile"
ok "binary, unit, conffile, dashboard, alert rules, man pages, completions, changelog"

# 2. Enabled and started on install, as the unit's dynamic user.
[ "$(in_box systemctl is-enabled sluice)" = enabled ] || fail "sluice is not enabled"
[ "$(in_box systemctl is-active sluice)" = active ] || fail "sluice is not active"
pid=$(main_pid)
uid=$(in_box ps -o uid= -p "$pid" | tr -d ' ')
[ -n "$uid" ] && [ "$uid" != 0 ] || fail "sluice runs as uid '$uid'"
ok "systemctl is-active sluice: active (enabled; MainPID $pid runs as the dynamic uid $uid)"

# 3. The quick start.
wait_ok http://127.0.0.1:9091/healthz
wait_hello "hello from sluice"
code=200 n=1
while [ "$code" = 200 ] && [ $n -lt 20 ]; do
    code=$(in_box curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8080/hello)
    n=$((n + 1))
done
# per_ip in conf/sluice.toml: gcra, 5 per 10 s, so the 6th request is refused.
[ "$code" = 429 ] && [ $n = 6 ] || fail "expected the 6th /hello to get 429, got $code at request $n"
ok "/hello answered 'hello from sluice', the 6th got 429"
# Read whole, then searched: `grep -q` in a pipe would close it early, and pipefail would fail.
metrics=$(in_box curl -s http://127.0.0.1:9091/metrics || true)
grep -q 'sluice_decisions_total{decision="rejected",policy="per_ip",route="hello"}' <<<"$metrics" \
    || fail "/metrics has no rejected per_ip decisions for route hello"
ok "/metrics counts the rejections"

# 4. An edited config, applied by `systemctl reload`: /hello's body changes, the limit rises,
#    and a route to an upstream on the host that takes 2 s to answer comes before the last.
gateway=$(podman inspect -f '{{range .NetworkSettings.Networks}}{{.Gateway}}{{end}}' "$box")
slow=$(python3 -c 'import socket; s=socket.socket(); s.bind(("0.0.0.0",0)); print(s.getsockname()[1])')
python3 scripts/slow-upstream.py "$slow" &
slow_pid=$!
python3 - "$gateway:$slow" > "$work/edited.toml" <<'EOF'
import sys
conf = open("conf/sluice.toml").read()
conf = conf.replace('body = "hello from sluice\\n"', 'body = "hello from the edited config\\n"')
conf = conf.replace("limit = 5\n", "limit = 1000\n")
slow = f'[upstreams.slow]\nservers = ["{sys.argv[1]}"]\n\n'
conf = conf.replace("[policies.per_ip]", slow + "[policies.per_ip]")
route = '[[routes]]\nname = "slow"\npath = "/slow"\nupstream = "slow"\n\n'
last = conf.rindex("[[routes]]")
print(conf[:last] + route + conf[last:], end="")
EOF
grep -q 'hello from the edited config' "$work/edited.toml" && grep -q 'limit = 1000' "$work/edited.toml" \
    || fail "conf/sluice.toml changed: the edit no longer applies"
put "$work/edited.toml" /etc/sluice/sluice.toml
in_box systemctl reload sluice
wait_hello "hello from the edited config"
[ "$(main_pid)" = "$pid" ] || fail "reload changed MainPID from $pid to $(main_pid)"
ok "systemctl reload applied the edited config (MainPID $pid unchanged)"

# 5. An upgrade to a rebuilt package keeps the edited conffile and restarts sluice on it.
version=$(dpkg-deb -f "$deb" Version)
repack "$version+debtest2"
out=$(apt_install "sluice_$version+debtest2.deb") || fail "upgrade failed: $out"
[ "$(in_box dpkg-query -W -f '${Version}' sluice)" = "$version+debtest2" ] || fail "not upgraded: $out"
in_box grep -q 'hello from the edited config' /etc/sluice/sluice.toml || fail "the upgrade replaced the edited conffile"
new_pid=$(main_pid)
[ "$new_pid" != "$pid" ] && [ "$new_pid" != 0 ] || fail "the upgrade did not restart sluice (MainPID $new_pid)"
wait_hello "hello from the edited config"
ok "the upgrade to $version+debtest2 kept the edited conffile and restarted sluice (MainPID $pid -> $new_pid)"
pid=$new_pid

# 6. An upgrade whose installed config fails `sluice check`: the old process keeps serving.
cp "$work/edited.toml" "$work/broken.toml"
echo 'no_such_key = 1' >> "$work/broken.toml"
put "$work/broken.toml" /etc/sluice/sluice.toml
repack "$version+debtest3"
out=$(apt_install "sluice_$version+debtest3.deb") || fail "upgrade with a broken config failed: $out"
[ "$(in_box dpkg-query -W -f '${Version}' sluice)" = "$version+debtest3" ] || fail "not upgraded: $out"
grep -q 'not restarted after the upgrade' <<<"$out" && grep -q 'sluice.toml:[0-9]*:[0-9]*: unknown key' <<<"$out" \
    || fail "the upgrade did not say why sluice was not restarted: $out"
[ "$(main_pid)" = "$pid" ] || fail "the upgrade replaced the running sluice (MainPID $pid -> $(main_pid))"
[ "$(in_box systemctl is-active sluice)" = active ] || fail "sluice is not active after the refused restart"
wait_hello "hello from the edited config"
grep -E 'not restarted|unknown key|fix ' <<<"$out" | sed 's/^/  apt: /'
ok "the upgrade to $version+debtest3 with a failing config kept MainPID $pid serving"
put "$work/edited.toml" /etc/sluice/sluice.toml
in_box systemctl restart sluice
wait_hello "hello from the edited config"
pid=$(main_pid)

# 7. `systemctl stop` while a request is in flight: it completes, sluice exits 0.
in_box curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8080/slow > "$work/slow.code" &
inflight=$!
sleep 0.5
start=$(date +%s.%N)
in_box systemctl stop sluice
took=$(echo "$(date +%s.%N) - $start" | bc)
wait "$inflight" || true
[ "$(cat "$work/slow.code")" = 200 ] || fail "the in-flight request got '$(cat "$work/slow.code")'"
result=$(in_box systemctl show -p Result --value sluice)
status=$(in_box systemctl show -p ExecMainStatus --value sluice)
[ "$result" = success ] && [ "$status" = 0 ] || fail "stop: Result=$result ExecMainStatus=$status"
# journald reads the unit's stdout on its own time: the line may come just after the stop.
drained=""
for _ in $(seq 1 25); do
    grep -q 'draining' <<<"$(in_box journalctl -u sluice --no-pager)" && drained=yes && break
    sleep 0.2
done
[ -n "$drained" ] || fail "no draining in the journal"
ok "systemctl stop drained the in-flight request in $(printf '%.1f' "$took") s: Result=$result, exit $status"

# 8. `apt purge` of a running sluice stops it and leaves no unit, no files, no state.
in_box systemctl start sluice || fail "systemctl start failed"
wait_hello "hello from the edited config"
in_box dpkg-query -L sluice > "$work/files"
in_box env DEBIAN_FRONTEND=noninteractive apt-get purge -y sluice </dev/null >/dev/null 2>&1 \
    || fail "apt purge failed"
status=$(in_box dpkg-query -W -f '${Status}' sluice 2>/dev/null || true)
[ -z "$status" ] || [ "$status" = "unknown ok not-installed" ] || fail "after purge dpkg says: $status"
[ "$(in_box systemctl show -p LoadState --value sluice)" = not-found ] || fail "the unit is still loaded"
in_box pgrep -x sluice >/dev/null && fail "sluice still runs after the purge: $(in_box pgrep -a -x sluice)"
left=$(podman exec -i "$box" sh -c 'while read -r f; do [ -f "$f" ] && echo "$f"; done; true' < "$work/files")
[ -z "$left" ] || fail "purge left: $left"
left=$(in_box find / -xdev \( -path /proc -o -path /sys -o -path /srv \) -prune -o -name '*sluice*' -print)
[ -z "$left" ] || fail "purge left: $left"
ok "apt purge stopped sluice and left no unit, no file, no state (no path named *sluice* outside /srv)"
echo "deb test passed"
