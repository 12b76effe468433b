#!/usr/bin/env bash
# Runs scripts/prometheus-scenario.py: a real Prometheus (Debian's `prometheus` package)
# scraping two live sluice instances every second through a scripted scenario, asserting
# the dashboard's queries and the alert rules against what it stores (see that file).
#
# Usage: scripts/check-prometheus.sh path/to/sluice    (make test: target/release/sluice)
#
# Needs prometheus, promtool, redis-server, openssl and python3. As root with apt-get it
# installs what is missing; otherwise it says what to install and exits 1.
set -euo pipefail

[[ $# -eq 1 ]] || { echo "usage: $0 path/to/sluice" >&2; exit 64; }
[[ -x $1 && -f $1 ]] || { echo "FAIL: $1 is not an executable file (build it first: cargo build --release)" >&2; exit 1; }

missing=()
command -v prometheus >/dev/null || missing+=(prometheus)
command -v promtool >/dev/null || missing+=(prometheus)
command -v redis-server >/dev/null || missing+=(redis-server)
command -v openssl >/dev/null || missing+=(openssl)
command -v python3 >/dev/null || missing+=(python3)
if [[ ${#missing[@]} -gt 0 ]]; then
    mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
    if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
        echo "FAIL: missing ${missing[*]}: install with: sudo apt-get install -y ${missing[*]}" >&2
        exit 1
    fi
    echo "check-prometheus: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

exec python3 "$(dirname "${BASH_SOURCE[0]}")/prometheus-scenario.py" "$1"
