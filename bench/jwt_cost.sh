#!/usr/bin/env bash
# Uncached JWT verification cost per algorithm: runs examples/jwt_verify_cost.rs (sluice's
# own verifier, sluice::auth::jwt::verify, on one thread) and writes its Markdown table.
# Usage: bench/jwt_cost.sh [SECONDS_PER_BATCH]            (see bench/README.md)
#
# Environment: OUT [bench/results/jwt-cost.md]   where the report is written (also printed)
# Needs cargo and openssl (the RSA key is made by `openssl genpkey`, in memory).
set -euo pipefail
BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$BENCH_DIR/.." && pwd)
OUT=${OUT:-$BENCH_DIR/results/jwt-cost.md}
BATCH=${1:-0.3}
command -v openssl >/dev/null || { echo "jwt_cost: openssl is required: apt-get install -y openssl" >&2; exit 1; }

cd "$ROOT"
cargo build --release --example jwt_verify_cost >&2
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
{
    model=$(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo 2>/dev/null || true)
    echo "# sluice: JWT verification cost"
    echo
    echo "- machine: $(nproc) CPU(s), ${model:-unknown CPU}, kernel $(uname -r), load average at start $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "- date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "- command: \`bench/jwt_cost.sh $BATCH\` (\`cargo run --release --example jwt_verify_cost -- $BATCH\`), $(rustc --version), $(openssl version | cut -d' ' -f1-2)"
    echo
    "$ROOT/target/release/examples/jwt_verify_cost" "$BATCH"
} >"$tmp"
mkdir -p "$(dirname "$OUT")"
cp "$tmp" "$OUT"
cat "$OUT"
echo "jwt_cost: report written to $OUT" >&2
