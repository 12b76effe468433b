#!/usr/bin/env bash
# bench/pgo.sh: the profile-guided build of the shipped binary (make dist-pgo).
#
#   1. builds sluice instrumented ([profile.dist] with -Cprofile-generate) in
#      target/pgo-generate;
#   2. trains it: bench/run.sh's sluice rows (no policies, memory, Redis, three policies,
#      under attack, HTTPS, two threads, API keys, JWTs, edge rules) and every algorithm,
#      short and one round;
#   3. merges the counts with llvm-profdata;
#   4. builds [profile.dist] again with -Cprofile-use into target/pgo:
#      target/pgo/dist/sluice.
#
# Pingora, tokio and the rest are built with the profile too: most of a request's user time
# is theirs (bench/results/where-the-cpu-goes.md), and PGO is the one lever on it that
# needs no change to their code. What it bought, and that it is not fitted to the rows it
# trains on, is in bench/results/ab-pgo.md.
#
# Skips everything when target/pgo/dist/sluice is newer than every source it depends on
# (FORCE=1 rebuilds). Needs what bench/run.sh needs (installed with apt-get when missing,
# as root) and an llvm-profdata that reads rustc's profiles (llvm-19 or newer).
set -euo pipefail

BENCH_DIR=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$BENCH_DIR")
LOG_TAG=pgo
# shellcheck source=bench/lib.sh
. "$BENCH_DIR/lib.sh"
CARGO=${CARGO:-cargo}
cd "$ROOT"

OUT=target/pgo/dist/sluice
if [ "${FORCE:-0}" != 1 ] && [ -x "$OUT" ] && [ -z "$(find src lua Cargo.toml Cargo.lock bench/run.sh bench/pgo.sh -newer "$OUT" -print -quit)" ]; then
    log "$OUT is up to date (FORCE=1 rebuilds it)"
    exit 0
fi

# rustc writes raw profiles of its LLVM's format; an llvm-profdata at least as new as
# LLVM 19 reads them (format 10). Debian 12 has llvm-19; rustup's llvm-tools match exactly.
llvm_major=$(rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')
profdata=""
for candidate in "$(rustc --print sysroot)/lib/rustlib/$(rustc -vV | sed -n 's/^host: //p')/bin/llvm-profdata" \
    $(ls -d /usr/lib/llvm-*/bin/llvm-profdata 2>/dev/null | sort -t- -k2 -n -r); do
    [ -x "$candidate" ] || continue
    version=$("$candidate" merge --version 2>/dev/null | sed -n 's/.*LLVM version \([0-9]*\).*/\1/p' | head -1 || true)
    if [ -n "$version" ] && [ "$version" -ge 19 ]; then profdata=$candidate; break; fi
done
if [ -z "$profdata" ]; then
    ensure_tools llvm-profdata-19
    profdata=$(command -v llvm-profdata-19)
fi
log "rustc's LLVM is $llvm_major; merging with $profdata"

work=$ROOT/target/pgo-generate

log "1/4 instrumented build (target/pgo-generate)"
CARGO_TARGET_DIR=$work RUSTFLAGS="-Cprofile-generate=$work/profiles" \
    $CARGO build --profile dist --locked

log "2/4 training on bench/run.sh's sluice rows"
# Build scripts and proc macros are instrumented too, and wrote their own counts while
# the build ran: only sluice's belong in the profile.
rm -rf "$work/profiles"
mkdir -p "$work/profiles"
# Every sluice process of the run writes into the same pool of raw profiles (%m). The
# verified-consumer rows (5k, 5j) and the edge rules (4e) train too: the shipped binary is
# shaped by what deployments run, and those rows are compared with trained ones.
DURATION=4s ROUNDS=1 WARMUP=1s ALG_DURATION=2s \
    CONTENDERS="4 5 6 7 8a 8b 9b 4w2 6w2 5k 5j 4e" OUT="$work/training.md" \
    "$BENCH_DIR/run.sh" "$work/dist/sluice" >"$work/training.log" 2>&1 \
    || die "training failed; see $work/training.log"
ls "$work"/profiles/*.profraw >/dev/null 2>&1 || die "training wrote no profile into $work/profiles"

log "3/4 merging"
"$profdata" merge -o "$work/merged.profdata" "$work"/profiles/*.profraw \
    || die "$profdata could not merge rustc's (LLVM $llvm_major) profiles: install a newer llvm (apt-get install llvm-19) or rustup's llvm-tools"
# Named by content: a new profile changes RUSTFLAGS, so cargo rebuilds every crate with it.
sum=$(sha256sum "$work/merged.profdata" | cut -c1-16)
mkdir -p target/pgo
rm -f target/pgo/sluice-*.profdata
profile=$ROOT/target/pgo/sluice-$sum.profdata
cp "$work/merged.profdata" "$profile"

log "4/4 optimised build (target/pgo)"
CARGO_TARGET_DIR=$ROOT/target/pgo RUSTFLAGS="-Cprofile-use=$profile" \
    $CARGO build --profile dist --locked
log "built $OUT"
