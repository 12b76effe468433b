#!/usr/bin/env bash
# Prefetch (DESIGN.md section 19): one hot key through 2 sluice instances on one Redis, at
# local speed or not. The rows of issue #33, in one run:
#
#   memory    gcra on the memory backend (each instance its own state): the proxy CPU reference
#   redis     gcra on Redis, without prefetch: one script call per request
#   prefetch  gcra on Redis with `prefetch = { max = 1024, hold = "250ms" }` (the limit is
#             1,000,000 a second: a take of 1,024 is 0.1% of it; each instance asks for ~2,000
#             units a hold, so max sets the size of a take, and so the number of calls)
#
# Usage: bench/prefetch.sh SLUICE
#
# Each row and round starts 2 fresh sluice instances (threads = 1, proxying to one nginx
# upstream that answers `return 200 "ok\n"`) with one policy keyed on ["route"] (one hot key)
# and a limit nothing reaches (1000000 per 1s, burst the default), then runs one wrk per
# instance (-t1, CONNECTIONS/2 connections each, in parallel): WARMUP unmeasured, then DURATION
# measured. Per row: Redis script calls (EVAL/EVALSHA/FCALL, INFO commandstats) per admitted
# (2xx) request, Redis CPU (INFO used_cpu_user + used_cpu_sys) per admitted request, both
# sluice processes' CPU (utime + stime from /proc) per request, and requests/s of both
# together. Rows alternate (A B C, then C B A, ...); the median of ROUNDS rounds is reported.
#
# Environment (defaults in brackets):
#   ROUNDS [3]          rounds
#   DURATION [5s]       measured wrk run per row and round
#   WARMUP [1s]         unmeasured wrk run before it (prefetch sizes from the recent rate)
#   CONNECTIONS [256]   wrk connections in all, half to each instance
#   PREFETCH [max = 1024, hold = "250ms"]   the prefetch row's setting
#   OUT [bench/results/prefetch.md]   where the Markdown report is written
#   KEEP_TMP [0]        1 = keep the temp dir (configs, logs, raw wrk output)
#
# Targets (issue #33): script calls per admitted request <= 0.02 with prefetch; proxy CPU per
# request with prefetch <= 1.05x the memory backend's; Redis CPU per admitted request with
# prefetch <= 0.1x the row without. Everything listens on 127.0.0.1 only, on free ports;
# every process started here is killed on exit; every load is bounded in time.

set -euo pipefail
BENCH_DIR="$(cd "$(dirname "$0")" && pwd)"
LOG_TAG=prefetch
KEEP_TMP=${KEEP_TMP:-0}
# shellcheck source=bench/lib.sh
. "$BENCH_DIR/lib.sh"

ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-5s}
WARMUP=${WARMUP:-1s}
CONNECTIONS=${CONNECTIONS:-256}
PREFETCH=${PREFETCH:-'max = 1024, hold = "250ms"'}
OUT=${OUT:-$BENCH_DIR/results/prefetch.md}
[ $# -eq 1 ] || die "usage: bench/prefetch.sh SLUICE"
for v in ROUNDS CONNECTIONS; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "$v must be a positive integer (got '${!v}')"
done
[ "$CONNECTIONS" -ge 2 ] || die "CONNECTIONS must be >= 2 (half to each instance)"
require_python
ensure_tools wrk nginx redis-server redis-cli timeout setsid
resolve_sluice "$1"
DUR_S=$(python3 "$LIB" seconds "$DURATION")
WARMUP_S=0
[ "$WARMUP" != 0 ] && WARMUP_S=$(python3 "$LIB" seconds "$WARMUP")
TICK=$(getconf CLK_TCK)
HALF=$((CONNECTIONS / 2))

bench_tmp sluice-prefetch
mkdir -p "$TMP/runs"
start_upstream
start_redis

# conf FILE PORT ADMIN ROW
conf() {
    local backend=redis
    [ "$4" = memory ] && backend=memory
    {
        printf '[server]\nlisten = ["127.0.0.1:%s"]\nthreads = 1\naccess_log = "off"\ngrace_period = "1s"\n\n' "$2"
        printf '[admin]\nlisten = "127.0.0.1:%s"\n\n' "$3"
        printf '[limiter]\nbackend = "%s"\n' "$backend"
        [ "$backend" = redis ] && printf 'url = "redis://127.0.0.1:%s/0"\ntimeout = "50ms"\n' "$REDIS_PORT"
        printf '\n[upstreams.origin]\nservers = ["127.0.0.1:%s"]\n\n' "$UP_PORT"
        printf '[policies.hot]\nalgorithm = "gcra"\nlimit = 1000000\nperiod = "1s"\nkey = ["route"]\n'
        [ "$4" = prefetch ] && printf 'prefetch = { %s }\n' "$PREFETCH"
        printf '\n[[routes]]\nname = "bench"\npath_prefix = "/"\nupstream = "origin"\npolicies = ["hot"]\n'
    } >"$1"
}

# wrk_pair SECONDS DURATION OUTBASE: one wrk per instance, in parallel, bounded
wrk_pair() {
    local i pids=() rc=0
    for i in 0 1; do
        timeout -k 5 $(($1 + 30)) wrk -t1 -c"$HALF" -d"$2" "http://127.0.0.1:${PORTS[$i]}/" >"$3.$i.txt" 2>&1 &
        pids+=("$!")
        PGIDS+=("$!")
    done
    for i in "${pids[@]}"; do
        wait "$i" || rc=$?
        drop_pgid "$i"
    done
    return $rc
}

redis_cpu() { redis_cli INFO cpu | awk -F: '/^used_cpu_(user|sys):/ {s += $2} END {printf "%.6f\n", s}'; }
script_calls() {
    redis_cli INFO commandstats | awk -F'[:=,]' '/^cmdstat_(eval|evalsha|eval_ro|evalsha_ro|fcall|fcall_ro):/ {s += $3} END {print s + 0}'
}
proc_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# one ROW ROUND: start both instances, warm up, measure, stop; append a line to $TMP/runs.tsv
one() {
    local row=$1 round=$2 i base="$TMP/runs/$1.r$2" rc=0
    PORTS=() PIDS=()
    for i in 0 1; do
        local port admin
        port=$(free_port); admin=$(free_port)
        conf "$TMP/conf/$row.$i.toml" "$port" "$admin" "$row"
        start_sluice "$row.r$round.$i" "$TMP/conf/$row.$i.toml" "$port" || die "$row: sluice $i did not start"
        PORTS+=("$port"); PIDS+=("$BG_PID"); ADMINS[$i]=$admin
    done
    redis_cli FLUSHALL >/dev/null
    [ "$WARMUP_S" != 0 ] && { wrk_pair "$WARMUP_S" "$WARMUP" "$base.warmup" || true; }
    log "round $round: $row: 2 x wrk -t1 -c$HALF -d$DURATION"
    local c0 r0 p0 c1 r1 p1
    redis_cli CONFIG RESETSTAT >/dev/null
    c0=$(script_calls); r0=$(redis_cpu); p0=$(( $(proc_ticks "${PIDS[0]}") + $(proc_ticks "${PIDS[1]}") ))
    wrk_pair "$DUR_S" "$DURATION" "$base.wrk" || rc=$?
    p1=$(( $(proc_ticks "${PIDS[0]}") + $(proc_ticks "${PIDS[1]}") )); c1=$(script_calls); r1=$(redis_cpu)
    redis_cli INFO commandstats >"$base.commandstats.txt" || true
    [ $rc -eq 0 ] || { note "$row round $round: wrk exited $rc"; FAILED=1; }
    for i in 0 1; do
        python3 "$LIB" get "${ADMINS[$i]}" /metrics >"$base.metrics.$i.txt" 2>&1 || true
        alive "${PIDS[$i]}" || { note "$row round $round: sluice $i exited during the load"; FAILED=1; }
    done
    for i in 0 1; do stop_bg "${PIDS[$i]}"; done
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$row" "$round" "$base.wrk.0.txt" "$base.wrk.1.txt" \
        "$((c1 - c0))" "$(python3 -c "print(f'{($r1 - $r0) * 1e6:.0f}')")" "$((p1 - p0))" \
        "$base.metrics.0.txt" "$base.metrics.1.txt" "$base.commandstats.txt" >>"$TMP/runs.tsv"
}

declare -a ADMINS PORTS PIDS
ORDER=(memory redis prefetch)
for round in $(seq "$ROUNDS"); do
    if [ $((round % 2)) -eq 0 ]; then list=(prefetch redis memory); else list=("${ORDER[@]}"); fi
    for row in "${list[@]}"; do one "$row" "$round"; done
done

mkdir -p "$(dirname "$OUT")"
python3 - "$TMP/runs.tsv" "$DUR_S" "$TICK" >"$TMP/table.md" <<'PY'
import re, statistics, sys
sys.path.insert(0, __import__("os").environ.get("BENCH_DIR", "."))
path, dur, tick = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])

def wrk(f):
    t = open(f).read()
    req = int(re.search(r"(\d+) requests in ([\d.]+)(m?s)", t).group(1))
    m = re.search(r"Requests/sec:\s+([\d.]+)", t)
    non2xx = int((re.search(r"Non-2xx or 3xx responses: (\d+)", t) or [0, 0])[1])
    err = re.search(r"Socket errors: (.*)", t)
    return req, float(m.group(1)), non2xx, err.group(1) if err else ""

def prefetch_units(f):
    out = {}
    for line in open(f, errors="replace"):
        m = re.match(r'sluice_prefetch_units_total\{[^}]*kind="(\w+)"[^}]*\}\s+([\d.e+]+)', line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0) + float(m.group(2))
    return out

runs = {}
notes = []
for line in open(path):
    row, rnd, w0, w1, calls, rcpu, pticks, m0, m1, cs = line.rstrip("\n").split("\t")
    script_us = 0
    try:
        for l in open(cs):
            m = re.match(r"cmdstat_(?:eval|evalsha|eval_ro|evalsha_ro|fcall|fcall_ro):calls=\d+,usec=(\d+)", l)
            if m:
                script_us += int(m.group(1))
    except OSError:
        pass
    a, b = wrk(w0), wrk(w1)
    req, rps, non2xx = a[0] + b[0], a[1] + b[1], a[2] + b[2]
    adm = req - non2xx
    for e in (a[3], b[3]):
        if e:
            notes.append(f"{row} round {rnd}: wrk socket errors: {e}")
    if non2xx:
        notes.append(f"{row} round {rnd}: {non2xx} non-2xx responses of {req}")
    units = {}
    for m in (m0, m1):
        for k, v in prefetch_units(m).items():
            units[k] = units.get(k, 0) + v
    runs.setdefault(row, []).append(dict(
        rps=rps, req=req, adm=adm,
        calls=int(calls) / adm, rcpu=int(rcpu) / adm, pcpu=int(pticks) * 1e6 / tick / req,
        units=units, us_call=script_us / int(calls) if int(calls) else 0))

def med(row, k):
    return statistics.median(r[k] for r in runs[row])

label = {"memory": "gcra, memory backend (each instance its own)",
         "redis": "gcra, Redis, no prefetch",
         "prefetch": "gcra, Redis, prefetch"}
print("| row | req/s (both) | admitted / round | script calls / admitted | Redis CPU µs / admitted | proxy CPU µs / request |")
print("|---|---:|---:|---:|---:|---:|")
for row in ("memory", "redis", "prefetch"):
    print(f"| {label[row]} | {med(row, 'rps'):,.0f} | {med(row, 'adm'):,.0f} | {med(row, 'calls'):.4f} | "
          f"{med(row, 'rcpu'):.3f} | {med(row, 'pcpu'):.2f} |")
print()
calls = med("prefetch", "calls")
pratio = med("prefetch", "pcpu") / med("memory", "pcpu")
rratio = med("prefetch", "rcpu") / med("redis", "rcpu")
ok = lambda b: "**met**" if b else "**MISSED**"
print("Targets (issue #33), medians:")
print()
print(f"- script calls per admitted request with prefetch: {calls:.4f} (target <= 0.02): {ok(calls <= 0.02)}")
print(f"- proxy CPU per request, prefetch / memory backend: {med('prefetch', 'pcpu'):.2f} / "
      f"{med('memory', 'pcpu'):.2f} µs = {pratio:.3f}x (target <= 1.05x): {ok(pratio <= 1.05)}")
print(f"- Redis CPU per admitted request, prefetch / no prefetch: {med('prefetch', 'rcpu'):.3f} / "
      f"{med('redis', 'rcpu'):.3f} µs = {rratio:.3f}x (target <= 0.1x): {ok(rratio <= 0.1)}")
print(f"- for reference: proxy CPU per request, no prefetch / memory backend: "
      f"{med('redis', 'pcpu') / med('memory', 'pcpu'):.3f}x; req/s prefetch / memory: "
      f"{med('prefetch', 'rps') / med('memory', 'rps'):.3f}x, prefetch / no prefetch: "
      f"{med('prefetch', 'rps') / med('redis', 'rps'):.3f}x")
print()
print("Per round (req/s; script calls / admitted; Redis CPU µs / admitted; proxy CPU µs / request;"
      " script time µs / call (commandstats usec); prefetch units taken / used / returned / dropped, both instances, warm-up included):")
print()
for row in ("memory", "redis", "prefetch"):
    cells = []
    for r in runs[row]:
        u = r["units"]
        extra = ""
        if u:
            extra = " [" + " / ".join(f"{u.get(k, 0):,.0f}" for k in ("taken", "used", "returned", "dropped")) + "]"
        cells.append(f"{r['rps']:,.0f}; {r['calls']:.4f}; {r['rcpu']:.3f}; {r['pcpu']:.2f}; {r['us_call']:.0f}{extra}")
    print(f"- {row}: " + " · ".join(cells))
if notes:
    print()
    print("Notes:")
    print()
    for n in notes:
        print(f"- {n}")
PY

{
    model=$(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo 2>/dev/null || true)
    echo "# Prefetch: one hot key through 2 sluice instances on one Redis"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'); machine: $(nproc) CPU(s), ${model:-unknown CPU}; load average at the end $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "- command: \`ROUNDS=$ROUNDS DURATION=$DURATION WARMUP=$WARMUP CONNECTIONS=$CONNECTIONS bench/prefetch.sh $*\`"
    echo "- versions: sluice: $SLUICE_VERSION; $(redis-server --version | cut -d' ' -f1-3); $(nginx -v 2>&1 | head -n1); $(wrk -v 2>&1 | head -n1 | cut -d' ' -f1-2)"
    echo "- setup: 2 sluice instances (\`threads = 1\`, proxying to one nginx \`return 200\` upstream), policy \`gcra\`, limit 1000000 per 1s, \`key = [\"route\"]\` (one hot key); prefetch row: \`prefetch = { $PREFETCH }\`; load: one \`wrk -t1 -c$HALF -d$DURATION\` per instance in parallel after a $WARMUP warm-up, fresh instances per row and round; $ROUNDS round(s), order reversed on even rounds; median per row"
    echo "- figures: script calls = EVAL/EVALSHA/FCALL calls (INFO commandstats delta); Redis CPU = used_cpu_user + used_cpu_sys delta; proxy CPU = both sluice processes' utime + stime (/proc, 1/$TICK s ticks) / requests; admitted = 2xx"
    echo
    cat "$TMP/table.md"
} >"$OUT"
log "report written to $OUT"
cat "$OUT"
if [ $FAILED -ne 0 ]; then
    log "some runs FAILED (see Notes)"
    exit 1
fi
