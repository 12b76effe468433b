#!/usr/bin/env python3
"""Helpers for bench/run.sh and bench/soak.sh (Python 3 standard library only).

    benchlib.py ports N              N distinct free TCP ports on 127.0.0.1
    benchlib.py seconds DURATION     "10s", "1m", "500ms", "7" -> whole seconds (rounded up)
    benchlib.py wait PORT SECS [PID] poll GET / on 127.0.0.1:PORT until any HTTP answer
    benchlib.py get PORT PATH        print the body of GET PATH on 127.0.0.1:PORT
    benchlib.py wrk FILE             one-line summary of a wrk output file
    benchlib.py cpusnap ROOTPID FILE [PGID]  CPU ticks outside ROOTPID's tree, and of PGID
    benchlib.py report RUNDIR        print the Markdown report for a finished run
    benchlib.py authdata DIR KEYS TOKENS SEED
                                     consumers.toml, jwks.json, ES256 tokens and the Zipf
                                     tables (Lua, for zipf.lua) of the consumer rows, into DIR
    benchlib.py probe PORT STATUS COUNT [NAME=VALUE|NAME=@FILE ...]
                                     GET / with those headers up to COUNT times, until STATUS
    benchlib.py soak-sample PID ADMIN_PORT INTERVAL COUNT OUT
                                     COUNT samples, INTERVAL s apart, of PID's RSS and fds and
                                     of sluice's request counters, as TSV to OUT
    benchlib.py soak-report RUNDIR   print the soak report; exit 0 on PASS, 1 on FAIL

Only 127.0.0.1 is ever contacted.
"""

import http.client
import math
import os
import re
import socket
import statistics
import sys
import time

HOST = "127.0.0.1"


# --------------------------------------------------------------------------- utils
def free_ports(n):
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
            p = s.getsockname()[1]
            if p not in ports:
                ports.append(p)
    finally:
        for s in socks:
            s.close()
    return ports


def seconds(text):
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)?\s*", text)
    if not m:
        raise SystemExit(f"bad duration: {text!r} (use e.g. 10s, 1m)")
    v = float(m.group(1))
    unit = m.group(2) or "s"
    v *= {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    return max(1, math.ceil(v))


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is not alive
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def wait_http(port, secs, pid=None, scheme="http"):
    deadline = time.monotonic() + secs
    last = "no answer"
    while time.monotonic() < deadline:
        if pid is not None and not pid_alive(pid):
            print(f"process {pid} exited while waiting for 127.0.0.1:{port}", file=sys.stderr)
            return 1
        try:
            if scheme == "https":
                import ssl
                c = http.client.HTTPSConnection(HOST, port, timeout=1,
                                                context=ssl._create_unverified_context())
            else:
                c = http.client.HTTPConnection(HOST, port, timeout=1)
            c.request("GET", "/")
            r = c.getresponse()
            r.read()
            c.close()
            print(r.status)
            return 0
        except (OSError, http.client.HTTPException) as e:
            last = repr(e)
        time.sleep(0.1)
    print(f"127.0.0.1:{port} did not answer GET / within {secs}s ({last})", file=sys.stderr)
    return 1


def http_get(port, path):
    c = http.client.HTTPConnection(HOST, port, timeout=5)
    c.request("GET", path)
    r = c.getresponse()
    body = r.read().decode("utf-8", "replace")
    c.close()
    sys.stdout.write(body)
    return 0 if r.status == 200 else 1


# --------------------------------------------------------------------------- other load
def _proc_table():
    procs = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                f_ = f.read().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        # fields after "comm)": state ppid pgrp ... utime(14) stime cutime cstime ... starttime(22)
        procs[int(d)] = {"ppid": int(f_[1]), "pgrp": int(f_[2]),
                         "ticks": sum(int(x) for x in f_[11:15]),
                         "own": int(f_[11]) + int(f_[12]), "start": int(f_[19])}
    return procs


def cpu_snapshot(root, path, pgid=None):
    """Record CPU ticks (own + reaped children) of every process that is neither `root`
    and its descendants nor a kernel thread, so that a later snapshot shows how much
    CPU the rest of the machine used meanwhile; and the CPU ticks of the processes of
    process group `pgid` (the contender)."""
    procs = _proc_table()
    pg = sum(p["own"] for p in procs.values() if pgid is not None and p["pgrp"] == pgid)
    mine = {root, 2}
    changed = True
    while changed:
        changed = False
        for pid, p in procs.items():
            if pid not in mine and p["ppid"] in mine:
                mine.add(pid)
                changed = True
    snap = {f"{pid}:{p['start']}": p["ticks"] for pid, p in procs.items() if pid not in mine}
    with open(path, "w") as f:
        f.write(repr({"t": time.monotonic(), "procs": snap, "pg": pg if pgid else None}))


def cpu_between(path0, path1):
    """(% of the whole machine's CPU used by other processes between two snapshots,
        CPU seconds used by the contender's process group or None)"""
    import ast
    with open(path0) as f:
        a = ast.literal_eval(f.read())
    with open(path1) as f:
        b = ast.literal_eval(f.read())
    hz = os.sysconf("SC_CLK_TCK")
    ticks = 0
    for k, v in b["procs"].items():
        ticks += v - a["procs"].get(k, 0)
    # processes that vanished: their time moved into their parent's cutime, already counted
    for k, v in a["procs"].items():
        if k not in b["procs"]:
            ticks -= v
    secs = max(b["t"] - a["t"], 1e-6)
    other = max(0.0, 100.0 * ticks / hz / secs / (os.cpu_count() or 1))
    pg = (b["pg"] - a["pg"]) / hz if a.get("pg") is not None and b.get("pg") is not None else None
    return other, pg, secs


# --------------------------------------------------------------------------- parsers
_UNIT_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0, "h": 3600000.0}


def parse_wrk(text):
    """Parse `wrk --latency` output. Returns a dict, or None if wrk did not finish."""
    out = {}
    m = re.search(r"^\s*(\d+) requests in ([0-9.]+)(us|ms|s|m|h),", text, re.M)
    if not m:
        return None
    out["requests"] = int(m.group(1))
    out["seconds"] = float(m.group(2)) * _UNIT_MS[m.group(3)] / 1000.0
    m = re.search(r"^Requests/sec:\s+([0-9.]+)", text, re.M)
    out["rps"] = float(m.group(1)) if m else out["requests"] / max(out["seconds"], 1e-9)
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    out["non2xx"] = int(m.group(1)) if m else 0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    out["sockerr"] = dict(zip(("connect", "read", "write", "timeout"),
                              map(int, m.groups()))) if m else {}
    lat = {}
    blk = text.split("Latency Distribution", 1)
    if len(blk) == 2:
        for pm in re.finditer(r"^\s+(\d+(?:\.\d+)?)%\s+([0-9.]+)(us|ms|s|m|h)\s*$", blk[1], re.M):
            lat[float(pm.group(1))] = float(pm.group(2)) * _UNIT_MS[pm.group(3)]
    out["p50"] = lat.get(50.0)
    out["p99"] = lat.get(99.0)
    return out


SCRIPT_CMDS = ("evalsha", "evalsha_ro", "eval", "eval_ro", "fcall", "fcall_ro")
HARNESS_CMDS = ("info", "config")


def parse_commandstats(text):
    """INFO commandstats -> {cmd: (calls, usec)}; subcommands like config|resetstat kept."""
    stats = {}
    for m in re.finditer(r"^cmdstat_([^:]+):calls=(\d+),usec=(\d+),", text, re.M):
        stats[m.group(1).lower()] = (int(m.group(2)), int(m.group(3)))
    return stats


def redis_summary(text, requests):
    st = parse_commandstats(text)
    base = lambda c: c.split("|", 1)[0]  # noqa: E731  ("config|resetstat" -> "config")
    all_calls = sum(c for k, (c, _) in st.items() if base(k) not in HARNESS_CMDS)
    all_usec = sum(u for k, (_, u) in st.items() if base(k) not in HARNESS_CMDS)
    sc_calls = sum(st.get(k, (0, 0))[0] for k in SCRIPT_CMDS)
    sc_usec = sum(st.get(k, (0, 0))[1] for k in SCRIPT_CMDS)
    ev_calls, ev_usec = st.get("evalsha", (0, 0))
    req = max(requests, 1)
    return {
        "cmds": all_calls,
        "cmds_per_req": all_calls / req,
        "script_calls": sc_calls,
        "script_per_req": sc_calls / req,
        "evalsha_calls": ev_calls,
        "evalsha_upc": (ev_usec / ev_calls) if ev_calls else None,
        "script_upc": (sc_usec / sc_calls) if sc_calls else None,
        "usec_per_req": all_usec / req,
        # The scripts' own time (their TIME/GET/SET... included, counted once): Redis CPU
        # per decision, since every request is one decision (one entry of a batch call).
        "script_usec_per_req": sc_usec / req,
        "req_per_script": (req / sc_calls) if sc_calls else None,
        "by_cmd": {k: v[0] for k, v in st.items() if base(k) not in HARNESS_CMDS},
    }


def parse_decisions(text):
    """sluice /metrics -> {"decision": count} summed over routes and policies, plus
    backend errors ("backend error KIND") and deny-cache hits."""
    out = {}
    for metric, label, prefix in (("sluice_decisions_total", "decision", ""),
                                  ("sluice_backend_errors_total", "kind", "backend error "),
                                  ("sluice_deny_cache_hits_total", None, "deny-cache hits")):
        for m in re.finditer(r'^' + metric + r'(?:\{([^}]*)\})?\s+([0-9.eE+]+)', text, re.M):
            if label:
                d = re.search(label + r'="([^"]*)"', m.group(1) or "")
                if not d:
                    continue
                name = prefix + d.group(1)
            else:
                name = prefix
            out[name] = out.get(name, 0) + float(m.group(2))
    return {k: v for k, v in out.items() if v or not k.startswith(("backend", "deny"))}


def parse_outcomes(text):
    """sluice /metrics -> {"status NNN": count, "auth RESULT": count}: what sluice answered
    (sluice_http_requests_total, summed over routes) and, on routes with auth, how the
    credentials came out (sluice_auth_total: ok, invalid, banned, ...); zeros left out."""
    out = {}
    for metric, label, prefix in (("sluice_http_requests_total", "status", "status "),
                                  ("sluice_auth_total", "result", "auth ")):
        for m in re.finditer(r'^' + metric + r'\{([^}]*)\}\s+([0-9.eE+]+)', text, re.M):
            d = re.search(label + r'="([^"]*)"', m.group(1))
            v = float(m.group(2))
            if d and v:
                out[prefix + d.group(1)] = out.get(prefix + d.group(1), 0) + v
    return out


# --------------------------------------------------------------------------- report
def read_manifest(path):
    rows = []
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if line:
                rows.append(line.split("\t"))
    return rows


def med(vals):
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def fmt_num(v, nd=0):
    if v is None:
        return "n/a"
    return f"{v:,.{nd}f}"


def fmt_ms(v):
    if v is None:
        return "n/a"
    if v < 10:
        return f"{v:.3f}"
    if v < 100:
        return f"{v:.2f}"
    return f"{v:.1f}"


def fmt_ratio(a, b):
    if a is None or not b:
        return "n/a"
    return f"{a / b:.2f}"


def load(rundir, manifest):
    """manifest rows: id, label, round, wrk file, redis file|-, metrics file|-"""
    runs = {}
    order = []
    for row in read_manifest(os.path.join(rundir, manifest)):
        cid, label, rnd, wrkf, redisf, metf = (row + ["-"] * 6)[:6]
        if cid not in runs:
            runs[cid] = {"label": label, "rounds": []}
            order.append(cid)
        with open(wrkf) as f:
            w = parse_wrk(f.read())
        if w is None:
            runs[cid]["rounds"].append({"failed": True, "file": wrkf})
            continue
        w["round"] = int(rnd)
        base = wrkf[:-len(".wrk.txt")] if wrkf.endswith(".wrk.txt") else wrkf
        if os.path.exists(base + ".cpu0") and os.path.exists(base + ".cpu1"):
            try:
                w["other"], pg, secs = cpu_between(base + ".cpu0", base + ".cpu1")
                if pg is not None:
                    w["core_pct"] = 100.0 * pg / secs
                    w["cpu_us_req"] = 1e6 * pg / max(w["requests"], 1)
            except (OSError, ValueError, SyntaxError):
                pass
        if redisf != "-" and os.path.exists(redisf):
            with open(redisf) as f:
                w["redis"] = redis_summary(f.read(), w["requests"])
        if metf != "-" and os.path.exists(metf):
            with open(metf) as f:
                text = f.read()
            w["decisions"] = parse_decisions(text)
            w["outcomes"] = parse_outcomes(text)
        runs[cid]["rounds"].append(w)
    return order, runs


def summarize(run):
    ok = [r for r in run["rounds"] if not r.get("failed")]
    s = {"n": len(ok), "failed": len(run["rounds"]) - len(ok)}
    if not ok:
        return s
    s["rps"] = med([r["rps"] for r in ok])
    s["rps_all"] = [r["rps"] for r in sorted(ok, key=lambda r: r["round"])]
    s["other_all"] = [r.get("other") for r in sorted(ok, key=lambda r: r["round"])]
    s["core_pct"] = med([r.get("core_pct") for r in ok])
    s["cpu_us_req"] = med([r.get("cpu_us_req") for r in ok])
    s["p50"] = med([r["p50"] for r in ok])
    s["p99"] = med([r["p99"] for r in ok])
    s["non2xx_pct"] = med([100.0 * r["non2xx"] / max(r["requests"], 1) for r in ok])
    s["non2xx"] = med([r["non2xx"] for r in ok])
    s["requests"] = med([r["requests"] for r in ok])
    s["sockerr"] = {}
    for r in ok:
        for k, v in r["sockerr"].items():
            s["sockerr"][k] = s["sockerr"].get(k, 0) + v
    red = [r["redis"] for r in ok if "redis" in r]
    if red:
        s["redis"] = {k: med([x[k] for x in red]) for k in
                      ("cmds", "cmds_per_req", "script_calls", "script_per_req",
                       "evalsha_calls", "evalsha_upc", "script_upc", "usec_per_req",
                       "script_usec_per_req", "req_per_script")}
        s["redis"]["by_cmd"] = red[-1]["by_cmd"]
    dec = [r["decisions"] for r in ok if "decisions" in r]
    if dec:
        s["decisions"] = dec[-1]
    outc = [r["outcomes"] for r in ok if r.get("outcomes")]
    if outc:
        s["outcomes"] = outc[-1]
    return s


def key_ratios(sums):
    """The ratios issue 13 sets targets for, from the rows present."""
    def get(cid, field):
        return sums.get(cid, {}).get(field)

    def ratio(a, b):
        return f"{a / b:.2f}×" if a is not None and b else None

    rows = [
        ("gcra, memory / no policies (req/s)", ratio(get("5", "rps"), get("4", "rps"))),
        ("gcra, Redis / no policies (req/s)", ratio(get("6", "rps"), get("4", "rps"))),
        ("three policies, Redis / no policies (req/s)", ratio(get("7", "rps"), get("4", "rps"))),
        ("no policies: proxy CPU per request / nginx proxy's",
         ratio(get("4", "cpu_us_req"), get("2", "cpu_us_req"))),
        ("gcra, Redis: p99 / no policies' p99", ratio(get("6", "p99"), get("4", "p99"))),
        ("gcra on x-user, memory, 100,000 Zipf keys (5z) / no policies (req/s)",
         ratio(get("5z", "rps"), get("4", "rps"))),
        ("request_id, two header rules and strip_prefix (4e) / no policies (4), req/s (target ≥ 0.97)",
         ratio(get("4e", "rps"), get("4", "rps"))),
        ("request_id, two header rules and strip_prefix (4e) / no policies (4), proxy CPU per request",
         ratio(get("4e", "cpu_us_req"), get("4", "cpu_us_req"))),
        ("catch-all after 10,000 host routes (4h) / one route (4), proxy CPU per request (target ≤ 1.05)",
         ratio(get("4h", "cpu_us_req"), get("4", "cpu_us_req"))),
        ("catch-all after 10,000 prefix routes (4p) / one route (4), proxy CPU per request (target ≤ 1.05)",
         ratio(get("4p", "cpu_us_req"), get("4", "cpu_us_req"))),
        ("API keys (5k) / the same policy without auth (5z), req/s (target ≥ 0.97)",
         ratio(get("5k", "rps"), get("5z", "rps"))),
        ("API keys (5k) / the same policy without auth (5z), proxy CPU per request",
         ratio(get("5k", "cpu_us_req"), get("5z", "cpu_us_req"))),
        ("cached ES256 JWTs (5j) / the same policy without auth (5z), req/s (target ≥ 0.95)",
         ratio(get("5j", "rps"), get("5z", "rps"))),
        ("cached ES256 JWTs (5j) / the same policy without auth (5z), proxy CPU per request",
         ratio(get("5j", "cpu_us_req"), get("5z", "cpu_us_req"))),
        ("gcra, Redis, 100,000 Zipf keys (6z) / no policies (req/s)",
         ratio(get("6z", "rps"), get("4", "rps"))),
        ("gcra, Redis, 100,000 Zipf keys (6z) / one hot key (6), req/s",
         ratio(get("6z", "rps"), get("6", "rps"))),
        ("banned invalid-token flood (8c) / deny-cache 429 (8a), proxy CPU per request (target ≤ 1.1)",
         ratio(get("8c", "cpu_us_req"), get("8a", "cpu_us_req"))),
        ("threads = 2 / threads = 1, no policies (proxy CPU per request)",
         ratio(get("4w2", "cpu_us_req"), get("4", "cpu_us_req"))),
        ("threads = 2 / threads = 1, gcra on Redis (proxy CPU per request)",
         ratio(get("6w2", "cpu_us_req"), get("6", "cpu_us_req"))),
        ("Envoy + sluice's rate limit service (10r) / Envoy alone (10e), req/s (target ≥ 0.9)",
         ratio(get("10r", "rps"), get("10e", "rps"))),
    ]
    for cid, what in (("6", "gcra, Redis, one hot key (6)"),
                      ("6z", "gcra, Redis, 100,000 Zipf keys (6z)")):
        red = sums.get(cid, {}).get("redis")
        if red:
            rows.append((f"{what}: Redis µs per decision", f"{red['script_usec_per_req']:.2f} µs"))
            if red["req_per_script"]:
                rows.append((f"{what}: decisions per script call", f"{red['req_per_script']:.1f}"))
    rows = [(k, v) for k, v in rows if v is not None]
    if not rows:
        return []
    return ["", "## Key ratios (this run)", "", "| ratio | value |", "|---|---:|"] + [
        f"| {k} | {v} |" for k, v in rows]


def report(rundir):
    lines = []
    with open(os.path.join(rundir, "header.md")) as f:
        lines.append(f.read().rstrip("\n"))
    order, runs = load(rundir, "manifest.tsv")
    sums = {cid: summarize(runs[cid]) for cid in order}
    base_up = sums.get("1", {}).get("rps")
    base_sl = sums.get("4", {}).get("rps")
    notes = []

    if order:
        nrounds = max(s["n"] + s["failed"] for s in sums.values())
        lines += ["", f"## Throughput and latency (median of {nrounds} round(s))", "",
                  "| # | contender | req/s | p50 (ms) | p99 (ms) | non-2xx (% of requests) "
                  "| ratio to upstream direct | ratio to sluice no policies "
                  "| proxy CPU (% of a core) | proxy CPU µs / request "
                  "| req/s per round (other load) |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for cid in order:
            s, label = sums[cid], runs[cid]["label"]
            if "rps" not in s:
                lines.append(f"| {cid} | {label} | FAILED | | | | | | | | |")
                continue
            rounds = " / ".join(fmt_num(v) + (f" ({o:.0f}%)" if o is not None else "")
                                for v, o in zip(s["rps_all"], s["other_all"]))
            worst = max([o for o in s["other_all"] if o is not None], default=0)
            if worst >= 10:
                notes.append(f"contender {cid}: other processes used up to {worst:.0f}% of the "
                             "machine's CPU during a measured run: its numbers are disturbed")
            own_sl = base_sl
            if cid.endswith("*"):
                own_sl = sums.get("4*", {}).get("rps")
            elif cid.endswith("w2"):
                own_sl = sums.get("4w2", {}).get("rps")
            lines.append(
                f"| {cid} | {label} | {fmt_num(s['rps'])} | {fmt_ms(s['p50'])} | {fmt_ms(s['p99'])} "
                f"| {fmt_num(s['non2xx'])} ({s['non2xx_pct']:.1f}%) "
                f"| {fmt_ratio(s['rps'], base_up)} | {fmt_ratio(s['rps'], own_sl)} "
                f"| {fmt_num(s['core_pct'])} | {fmt_num(s['cpu_us_req'], 1)} | {rounds} |")
            if s["failed"]:
                notes.append(f"contender {cid}: {s['failed']} round(s) produced no wrk result")
            errs = {k: v for k, v in s.get("sockerr", {}).items() if v}
            if errs:
                notes.append(f"contender {cid}: wrk socket errors (all rounds) "
                             + ", ".join(f"{k} {v}" for k, v in errs.items()))

        twins = [cid for cid in order if cid + "*" in sums and "rps" in sums[cid]
                 and "rps" in sums[cid + "*"]]
        if twins:
            lines += ["", "## A/B: this build against the baseline (same rounds)", "",
                      "| # | contender | req/s ratio | p99 ratio | proxy CPU µs / request | "
                      "baseline µs / request | CPU ratio |",
                      "|---|---|---:|---:|---:|---:|---:|"]
            for cid in twins:
                a, b = sums[cid], sums[cid + "*"]
                lines.append(
                    f"| {cid} | {runs[cid]['label']} | {fmt_ratio(a['rps'], b['rps'])} "
                    f"| {fmt_ratio(a['p99'], b['p99'])} | {fmt_num(a['cpu_us_req'], 1)} "
                    f"| {fmt_num(b['cpu_us_req'], 1)} | {fmt_ratio(a['cpu_us_req'], b['cpu_us_req'])} |")

        lines += key_ratios(sums)

        tls_sl, tls_ngx = sums.get("9b", {}), sums.get("9a", {})
        if "rps" in tls_sl and "rps" in tls_ngx:
            cpu = ""
            if tls_sl.get("cpu_us_req") and tls_ngx.get("cpu_us_req"):
                cpu = (f"; proxy CPU per request {tls_sl['cpu_us_req']:.1f} µs against "
                       f"{tls_ngx['cpu_us_req']:.1f} µs ({tls_sl['cpu_us_req'] / tls_ngx['cpu_us_req']:.2f}×)")
            lines += ["", f"HTTPS keep-alive: sluice (9b) / nginx (9a) = "
                          f"{fmt_ratio(tls_sl['rps'], tls_ngx['rps'])} in req/s{cpu}."]

        red_ids = [cid for cid in order if "redis" in sums[cid]]
        if red_ids:
            lines += ["", "## Redis cost per request (median of rounds)", "",
                      "Counted on the private redis-server between `CONFIG RESETSTAT` and "
                      "`INFO commandstats` around the measured wrk run (INFO/CONFIG excluded). "
                      "Commands that a script runs (TIME, GET, SET, ...) are counted by Redis too, "
                      "so \"script calls / request\" is the number of round trips for decisions "
                      "and evalsha usec_per_call includes the script's own commands; "
                      "\"Redis usec / request\" sums every command's usec, so it counts those "
                      "twice. Concurrent decisions share a script call (a batch): \"requests / "
                      "script call\" is its mean size, and \"Redis µs / decision\" is the "
                      "scripts' time per request, their own commands counted once.", "",
                      "| # | contender | Redis commands / request | script calls / request "
                      "| requests / script call | evalsha usec_per_call | Redis usec / request "
                      "| Redis µs / decision | commands seen |",
                      "|---|---|---:|---:|---:|---:|---:|---:|---|"]
            for cid in red_ids:
                r = sums[cid]["redis"]
                seen = ", ".join(f"{k} {v:,}" for k, v in sorted(r["by_cmd"].items())) or "none"
                upc = r["evalsha_upc"] if r["evalsha_upc"] is not None else r["script_upc"]
                batch = r["req_per_script"]
                lines.append(
                    f"| {cid} | {runs[cid]['label']} | {r['cmds_per_req']:.3f} | "
                    f"{r['script_per_req']:.3f} | {'' if batch is None else f'{batch:.1f}'} | "
                    f"{fmt_ms(upc)} | {r['usec_per_req']:.2f} | {r['script_usec_per_req']:.2f} | "
                    f"{seen} |")

        dec_ids = [cid for cid in order if "decisions" in sums[cid]]
        if dec_ids:
            notes.append("sluice decisions (sluice_decisions_total, last round): " + "; ".join(
                f"{cid}: " + (", ".join(f"{k} {v:,.0f}" for k, v in sorted(sums[cid]["decisions"].items()))
                              or "none")
                for cid in dec_ids))
        out_ids = [cid for cid in order if "outcomes" in sums[cid]]
        if out_ids:
            notes.append("sluice responses by status, and credentials by outcome on routes with auth "
                          "(sluice_http_requests_total, sluice_auth_total; whole process, last round): "
                          + "; ".join(f"{cid}: " + ", ".join(
                              f"{k} {v:,.0f}" for k, v in sorted(sums[cid]["outcomes"].items()))
                              for cid in out_ids))

    a_order, a_runs = load(rundir, "alg_manifest.tsv")
    if a_order:
        lines += ["", "## Redis CPU per decision, by algorithm", "",
                  "One policy of each algorithm on the Redis backend (deny_cache = 0), "
                  "one short wrk run each; usec_per_call is Redis' own execution time of "
                  "the script command (cmdstat_evalsha); one call decides every request "
                  "queued while the previous one ran, so µs / decision = usec_per_call × "
                  "calls / request.", "",
                  "| algorithm | usec_per_call | calls | calls / request | µs / decision | req/s | non-2xx (%) |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for alg in a_order:
            s = summarize(a_runs[alg])
            if "rps" not in s:
                lines.append(f"| {alg} | FAILED | | | | | |")
                continue
            r = s.get("redis")
            if r is None:
                lines.append(f"| {alg} | n/a | n/a | n/a | n/a | {fmt_num(s['rps'])} | {s['non2xx_pct']:.1f}% |")
                continue
            if "decisions" in s:
                notes.append(f"algorithm {alg}: " + ", ".join(
                    f"{k} {v:,.0f}" for k, v in sorted(s["decisions"].items())))
            o = s["other_all"][0] if s["other_all"] else None
            if o is not None and o >= 10:
                notes.append(f"algorithm {alg}: other processes used {o:.0f}% of the machine's "
                             "CPU during the run: its numbers are disturbed")
            upc = r["evalsha_upc"] if r["evalsha_upc"] is not None else r["script_upc"]
            calls = r["evalsha_calls"] if r["evalsha_upc"] is not None else r["script_calls"]
            per_decision = upc * r['script_per_req'] if upc is not None else None
            lines.append(
                f"| {alg} | {fmt_ms(upc)} | {fmt_num(calls)} | {r['script_per_req']:.3f} "
                f"| {fmt_ms(per_decision)} | {fmt_num(s['rps'])} | {s['non2xx_pct']:.1f}% |")

    extra = os.path.join(rundir, "notes.txt")
    if os.path.exists(extra):
        with open(extra) as f:
            notes += [l.rstrip("\n") for l in f if l.strip()]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    print("\n".join(lines))
    return 0


# --------------------------------------------------------------------------- auth/zipf data
# Consumers, API keys, ES256 tokens and the Zipf tables of the rows 5z, 5k, 5j, 6z and 8c,
# made at bench time in the run's temp dir (nothing here is secret or kept).
JWT_ISSUER = "https://bench.test/"
JWT_AUDIENCE = "bench"
JWT_KID = "bench-es256"
JWT_EXP = 4102444800  # 2100-01-01: far future


def b64url(data):
    import base64
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def der_ecdsa_to_raw(der, size=32):
    """DER ECDSA-Sig-Value (SEQUENCE { INTEGER r, INTEGER s }) -> r || s, each `size` bytes."""
    def read_len(buf, i):
        n = buf[i]
        i += 1
        if n < 0x80:
            return n, i
        k = n & 0x7F
        return int.from_bytes(buf[i:i + k], "big"), i + k

    if der[0] != 0x30:
        raise ValueError("not a DER SEQUENCE")
    _, i = read_len(der, 1)
    out = b""
    for _ in range(2):
        if der[i] != 0x02:
            raise ValueError("not a DER INTEGER")
        n, i = read_len(der, i + 1)
        v = der[i:i + n].lstrip(b"\x00")
        i += n
        if len(v) > size:
            raise ValueError("ECDSA integer too long")
        out += v.rjust(size, b"\x00")
    return out


def zipf_cdf(n, s=1.0):
    """Cumulative Zipf(s) probabilities of ranks 1..n; the last is exactly 1.0."""
    acc, cdf = 0.0, []
    for k in range(1, n + 1):
        acc += 1.0 / k ** s
        cdf.append(acc)
    cdf = [c / acc for c in cdf]
    cdf[-1] = 1.0
    return cdf


def lua_str(v):
    return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_zipf_lua(path, header, values, cdf, what):
    """A Lua file for bench/zipf.lua: `return { header =, cdf = {...}, values = {...} }`.
    One entry per line; LuaJIT keeps a constructor's constants in a template table, so
    100,000 entries are no problem."""
    with open(path, "w") as f:
        f.write(f"-- generated by bench/benchlib.py for bench/zipf.lua: {what}\n")
        f.write(f"return {{\nheader = {lua_str(header)},\ncdf = {{\n")
        f.writelines(f"{c!r},\n" for c in cdf)
        f.write("},\nvalues = {\n")
        f.writelines(lua_str(v) + ",\n" for v in values)
        f.write("},\n}\n")


def auth_data(out, n_keys, n_tokens, seed):
    """Writes into OUT: consumers.toml (n_keys consumers c1..cN, plan free, one API key each
    by its SHA-256), jwks.json (one EC P-256 key), and the Zipf(s = 1) tables for
    bench/zipf.lua: zipf-users.lua (X-User: cN, no auth), zipf-keys.lua (X-Api-Key),
    zipf-jwt.lua (Authorization: Bearer, n_tokens ES256 tokens of c1..cM), plus
    bad.jwt: a well-formed token whose signature does not check (row 8c), and
    probe-key.txt / probe-jwt.txt: c1's key and token for run.sh's pre-load probe."""
    import hashlib
    import json
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    os.makedirs(out, exist_ok=True)
    names = [f"c{i}" for i in range(1, n_keys + 1)]
    keys = ["bk_" + hashlib.sha256(f"sluice-bench:{seed}:{i}".encode()).hexdigest()[:40]
            for i in range(1, n_keys + 1)]
    with open(os.path.join(out, "consumers.toml"), "w") as f:
        f.write("# generated by bench/benchlib.py authdata: bench consumers, one API key each\n")
        for name, key in zip(names, keys):
            f.write(f'[[consumers]]\nname = "{name}"\nplan = "free"\n'
                    f'keys = ["sha256:{hashlib.sha256(key.encode()).hexdigest()}"]\n')
    cdf = zipf_cdf(n_keys)
    write_zipf_lua(os.path.join(out, "zipf-users.lua"), "X-User", names, cdf,
                   f"{n_keys} client-named users, Zipf s = 1")
    write_zipf_lua(os.path.join(out, "zipf-keys.lua"), "X-Api-Key", keys, cdf,
                   f"{n_keys} API keys, Zipf s = 1")

    # ES256: a throw-away P-256 key made by openssl; tokens signed by openssl dgst.
    pem = os.path.join(out, "jwt-key.pem")
    key = subprocess.run(["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout"],
                         check=True, capture_output=True).stdout
    key = subprocess.run(["openssl", "pkey", "-out", pem], input=key, check=True,
                         capture_output=True)
    os.chmod(pem, 0o600)
    pub = subprocess.run(["openssl", "ec", "-in", pem, "-pubout", "-outform", "DER"],
                         check=True, capture_output=True).stdout
    point = pub[-65:]
    if point[0] != 4:
        raise SystemExit("authdata: unexpected EC public key encoding")
    jwks = {"keys": [{"kty": "EC", "crv": "P-256", "kid": JWT_KID, "use": "sig", "alg": "ES256",
                      "x": b64url(point[1:33]), "y": b64url(point[33:65])}]}
    with open(os.path.join(out, "jwks.json"), "w") as f:
        json.dump(jwks, f)
    head = b64url(json.dumps({"alg": "ES256", "typ": "JWT", "kid": JWT_KID},
                             separators=(",", ":")).encode())

    def mint(sub):
        body = b64url(json.dumps({"iss": JWT_ISSUER, "aud": JWT_AUDIENCE, "sub": sub,
                                  "exp": JWT_EXP}, separators=(",", ":")).encode())
        signing_input = f"{head}.{body}".encode()
        der = subprocess.run(["openssl", "dgst", "-sha256", "-sign", pem], input=signing_input,
                             check=True, capture_output=True).stdout
        return f"{head}.{body}.{b64url(der_ecdsa_to_raw(der))}"

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        tokens = list(pool.map(mint, names[:n_tokens]))
    write_zipf_lua(os.path.join(out, "zipf-jwt.lua"), "Authorization",
                   ["Bearer " + t for t in tokens], zipf_cdf(n_tokens),
                   f"{n_tokens} ES256 tokens of consumers c1..c{n_tokens}, Zipf s = 1")
    # A token of c1 whose signature is another message's: well-formed, bad signature.
    h, b, _ = tokens[0].split(".")
    bad_sig = tokens[1].split(".")[2] if len(tokens) > 1 else b64url(bytes(64))
    with open(os.path.join(out, "bad.jwt"), "w") as f:
        f.write(f"{h}.{b}.{bad_sig}\n")
    # What run.sh's pre-load probe sends: consumer c1's API key, and c1's token.
    with open(os.path.join(out, "probe-key.txt"), "w") as f:
        f.write(keys[0] + "\n")
    with open(os.path.join(out, "probe-jwt.txt"), "w") as f:
        f.write(f"Bearer {tokens[0]}\n")
    return 0


def http_status(port, path, headers):
    c = http.client.HTTPConnection(HOST, port, timeout=5)
    try:
        c.request("GET", path, headers=headers)
        r = c.getresponse()
        r.read()
        return r.status
    finally:
        c.close()


def probe(port, expect, count, header_args):
    """GET / up to COUNT times with the headers NAME=VALUE (VALUE @FILE: the file's first
    line); prints the statuses; exit 0 as soon as one is EXPECT, 1 if none was."""
    headers = {}
    for a in header_args:
        name, value = a.split("=", 1)
        if value.startswith("@"):
            with open(value[1:]) as f:
                value = f.readline().strip()
        headers[name] = value
    seen = []
    for _ in range(count):
        try:
            st = http_status(port, "/", headers)
        except (OSError, http.client.HTTPException) as e:
            st = f"error ({e})"
        seen.append(str(st))
        if st == expect:
            print(" ".join(seen))
            return 0
    print(" ".join(seen))
    return 1


# --------------------------------------------------------------------------- soak
SOAK_COLS = ("k", "t", "elapsed", "rss_kb", "fds", "requests", "s2xx", "s429", "sother",
             "connections")


def proc_rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise OSError("no VmRSS")


def proc_fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def parse_requests(text):
    """sluice /metrics -> (all requests, 2xx, 429, other statuses, open client connections|None)"""
    tot = s2 = s429 = oth = 0
    for m in re.finditer(r'^sluice_http_requests_total\{([^}]*)\}\s+([0-9.eE+]+)', text, re.M):
        st = re.search(r'status="([^"]*)"', m.group(1))
        v = int(float(m.group(2)))
        tot += v
        code = st.group(1) if st else ""
        if code.startswith("2"):
            s2 += v
        elif code == "429":
            s429 += v
        else:
            oth += v
    conns = None
    for m in re.finditer(r'^sluice_connections(?:\{[^}]*\})?\s+([0-9.eE+]+)', text, re.M):
        conns = (conns or 0) + int(float(m.group(1)))
    return tot, s2, s429, oth, conns


def scrape(port):
    c = http.client.HTTPConnection(HOST, port, timeout=5)
    try:
        c.request("GET", "/metrics")
        r = c.getresponse()
        return r.read().decode("utf-8", "replace")
    finally:
        c.close()


def soak_sample(pid, admin, interval, count, out):
    """COUNT samples at t = 0, INTERVAL, 2*INTERVAL, ... (monotonic clock, no drift).
    Stops early, exit 3, if PID is gone. One TSV line per sample, flushed at once."""
    t0 = time.monotonic()
    with open(out, "w") as f:
        f.write("\t".join(SOAK_COLS) + "\n")
        for k in range(count):
            wait = t0 + k * interval - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            elapsed = time.monotonic() - t0
            if not pid_alive(pid):
                print(f"soak: sluice (pid {pid}) is gone at t={elapsed:.0f}s", file=sys.stderr)
                return 3
            try:
                rss, fds = proc_rss_kb(pid), proc_fds(pid)
            except OSError as e:
                print(f"soak: cannot read /proc/{pid}: {e}", file=sys.stderr)
                return 3
            try:
                req = parse_requests(scrape(admin))
            except (OSError, http.client.HTTPException):
                req = (None,) * 5
            row = [k, k * interval, f"{elapsed:.1f}", rss, fds] + ["-" if v is None else v for v in req]
            f.write("\t".join(map(str, row)) + "\n")
            f.flush()
            print(f"soak: t={k * interval:>4}s  RSS {rss / 1024:7.1f} MiB  fds {fds:4}  "
                  f"requests {req[0] if req[0] is not None else '-'}", file=sys.stderr)
    return 0


def read_params(path):
    params = {}
    with open(path) as f:
        for line in f:
            if "=" in line:
                k, v = line.rstrip("\n").split("=", 1)
                params[k] = v
    return params


def soak_verdict(rows, baseline_t, max_growth_pct):
    """(baseline row | None, [failure reasons]) for the RSS/fd rule."""
    base = next((r for r in rows if r["t"] >= baseline_t), None)
    if base is None:
        return None, [f"no sample at or after t = {baseline_t} s (the baseline)"]
    fails = []
    lim = 1 + max_growth_pct / 100.0
    for r in rows:
        if r["t"] <= base["t"]:
            continue
        for col, name in (("rss_kb", "RSS"), ("fds", "open fds")):
            if r[col] > base[col] * lim:
                fails.append(f"{name} at t = {r['t']} s is {r[col]:,}, "
                             f"{100.0 * (r[col] / base[col] - 1):+.1f}% over {base[col]:,} at t = {base['t']} s")
    return base, fails


def soak_report(rundir):
    P = read_params(os.path.join(rundir, "params.txt"))
    interval = int(P["SOAK_INTERVAL"])
    baseline_t = int(P["SOAK_BASELINE"])
    growth = float(P["SOAK_MAX_GROWTH_PCT"])
    max_err = float(P["SOAK_MAX_ERROR_PCT"])
    target = float(P["TARGET_RPS"])
    rows = []
    with open(os.path.join(rundir, "samples.tsv")) as f:
        next(f, None)
        for line in f:
            v = line.rstrip("\n").split("\t")
            if len(v) != len(SOAK_COLS):
                continue
            r = dict(zip(SOAK_COLS, v))
            for c in ("k", "t", "rss_kb", "fds"):
                r[c] = int(r[c])
            for c in ("requests", "s2xx", "s429", "sother", "connections"):
                r[c] = None if r[c] == "-" else int(r[c])
            r["elapsed"] = float(r["elapsed"])
            rows.append(r)
    with open(os.path.join(rundir, "soak.wrk.txt")) as f:
        w = parse_wrk(f.read())
    peak = None
    if os.path.exists(os.path.join(rundir, "peak.wrk.txt")):
        with open(os.path.join(rundir, "peak.wrk.txt")) as f:
            peak = parse_wrk(f.read())
    final = None
    if os.path.exists(os.path.join(rundir, "metrics.final.txt")):
        with open(os.path.join(rundir, "metrics.final.txt")) as f:
            text = f.read()
        final = parse_requests(text)
        others = {}
        for m in re.finditer(r'^sluice_http_requests_total\{([^}]*)\}\s+([0-9.eE+]+)', text, re.M):
            st = re.search(r'status="([^"]*)"', m.group(1))
            code = st.group(1) if st else "?"
            if not code.startswith("2") and code != "429" and float(m.group(2)):
                others[code] = others.get(code, 0) + int(float(m.group(2)))
        decisions = parse_decisions(text)
    else:
        decisions = {}

    fails, notes = [], []
    expected = int(P["SOAK_SAMPLES"])
    if P.get("SLUICE_ALIVE") != "1":
        fails.append("sluice died during the soak")
    if len(rows) < expected:
        fails.append(f"only {len(rows)} of {expected} samples were taken")
    base, growth_fails = soak_verdict(rows, baseline_t, growth)
    fails += growth_fails
    if w is None:
        fails.append("wrk produced no result")
        err_pct = None
    else:
        sock = sum(w["sockerr"].values())
        other = final[3] if final else None
        if other is None:
            fails.append("no final /metrics scrape: cannot count non-2xx/429 responses")
            err_pct = None
        else:
            errors = other + sock
            err_pct = 100.0 * errors / max(w["requests"], 1)
            if err_pct > max_err:
                fails.append(f"error rate {err_pct:.3f}% > {max_err}% ({other:,} responses neither 2xx "
                             f"nor 429, {sock:,} wrk socket errors, of {w['requests']:,} requests)")
        if w["rps"] < 0.9 * target:
            notes.append(f"the load reached only {w['rps']:,.0f} req/s, {100 * w['rps'] / target:.0f}% of "
                         f"the {target:,.0f} req/s target (a busy machine?)")
    verdict = "PASS" if not fails else "FAIL"

    L = []
    L += ["# sluice soak test", "",
          f"**Verdict: {verdict}**", ""]
    L += [f"- date: {P.get('DATE', '?')}",
          f"- machine: {P.get('MACHINE', '?')}",
          f"- command: `{P.get('COMMAND', '?')}`",
          f"- versions: {P.get('VERSIONS', '?')}",
          f"- parameters: SOAK_SECONDS={P['SOAK_SECONDS']} SOAK_INTERVAL={interval} "
          f"SOAK_BASELINE={baseline_t} SOAK_MAX_GROWTH_PCT={growth:g} SOAK_MAX_ERROR_PCT={max_err:g} "
          f"CONNECTIONS={P['CONNECTIONS']} THREADS={P['THREADS']} WORKERS={P['WORKERS']} "
          f"PEAK_DURATION={P['PEAK_DURATION']} IPS={P['IPS']} KEYS={P['KEYS']}",
          ""]
    L += ["`free -h` at the start:", "", "```", P.get("FREE", "").replace("\\n", "\n"), "```", ""]
    L += ["## Set-up", "",
          "redis-server (private, no persistence) ← sluice (Redis backend, "
          f"`[server] threads = {P['WORKERS']}`) → nginx upstream (`return 200 \"ok\\n\"`, 1 worker); "
          "load from wrk with `bench/soak.lua` on 127.0.0.1: "
          f"{P['IPS']} client addresses (X-Forwarded-For from the trusted peer 127.0.0.1) and "
          f"{P['KEYS']} API keys (X-Api-Key), plus one hot address and one hot key that each send "
          "2% of the requests; 1% of the requests carry `Connection: close` (connection churn).",
          "",
          f"Policies: `per_ip` gcra on `client_ip` and `per_key` gcra on `header:x-api-key`, each "
          f"{P['LIMIT']} per 1s: half of what the hot address / key sends, about 1/{P['COLD_MARGIN']} "
          "of that for any other one, so about 2% of the requests get 429.",
          ""]
    if peak:
        L.append(f"- peak: {peak['rps']:,.0f} req/s (unpaced wrk, {P['PEAK_DURATION']}, same requests, "
                 "on a sluice with the same policies and limits nobody reaches)")
    L.append(f"- target: {target:,.0f} req/s (half of peak), paced by `bench/soak.lua`")
    if w:
        L.append(f"- achieved: {w['rps']:,.0f} req/s over {w['seconds']:.0f} s, {w['requests']:,} requests, "
                 f"p50 {fmt_ms(w['p50'])} ms, p99 {fmt_ms(w['p99'])} ms; wrk non-2xx {w['non2xx']:,}; "
                 "socket errors " + (", ".join(f"{k} {v}" for k, v in w["sockerr"].items()) or "none"))
    if final:
        L.append(f"- sluice answered {final[0]:,} requests: 2xx {final[1]:,}, 429 {final[2]:,}, other {final[3]:,}"
                 + (" (" + ", ".join(f"{k}: {v:,}" for k, v in sorted(others.items())) + ")" if others else "")
                 + (f"; error rate {err_pct:.3f}%" if err_pct is not None else ""))
    if decisions:
        L.append("- decisions: " + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(decisions.items())))
    L += ["", "## Rule", "",
          f"Samples every {interval} s from the start of the paced load: sluice's RSS (`VmRSS` of "
          "`/proc/PID/status`) and open fds (entries of `/proc/PID/fd`). The baseline is the sample "
          f"at t = {baseline_t} s{' (the end of the first minute)' if baseline_t == 60 else ''}. FAIL if any later sample's RSS or fd "
          f"count exceeds the baseline by more than {growth:g}% (value > baseline × {1 + growth / 100:g}); "
          f"FAIL if sluice dies, if a sample is missing, or if more than {max_err:g}% of the requests "
          "got a response other than 2xx/429 (sluice_http_requests_total) or a wrk socket error.", ""]
    L += ["## Samples", "",
          "| t (s) | RSS (MiB) | RSS vs baseline | open fds | fds vs baseline | req/s | 429/s | other/s "
          "| client connections |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    prev = None
    for r in rows:
        rel = lambda c: (f"{100.0 * (r[c] / base[c] - 1):+.1f}%" if base and r["t"] >= base["t"] else "")  # noqa: E731
        rate = lambda c: (f"{(r[c] - prev[c]) / max(r['elapsed'] - prev['elapsed'], 1e-6):,.0f}"  # noqa: E731
                          if prev and r[c] is not None and prev[c] is not None else "")
        mark = " (baseline)" if base and r is base else ""
        L.append(f"| {r['t']}{mark} | {r['rss_kb'] / 1024:.1f} | {rel('rss_kb')} | {r['fds']} | {rel('fds')} "
                 f"| {rate('requests')} | {rate('s429')} | {rate('sother')} "
                 f"| {r['connections'] if r['connections'] is not None else 'n/a'} |")
        prev = r
    L += ["", "## Verdict", "", f"**{verdict}**" + ("" if fails else f": RSS and fds stayed within "
          f"{growth:g}% of the t = {baseline_t} s baseline, sluice stayed up, "
          f"error rate {err_pct:.3f}%." if err_pct is not None else "")]
    L += [f"- {x}" for x in fails]
    extra = os.path.join(rundir, "notes.txt")
    if os.path.exists(extra):
        with open(extra) as f:
            notes += [x.rstrip("\n") for x in f if x.strip()]
    if notes:
        L += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    print("\n".join(L))
    return 0 if not fails else 1


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    cmd, args = argv[1], argv[2:]
    if cmd == "ports":
        print(" ".join(map(str, free_ports(int(args[0]) if args else 1))))
        return 0
    if cmd == "seconds":
        print(seconds(args[0]))
        return 0
    if cmd == "wait":
        return wait_http(int(args[0]), float(args[1]),
                         int(args[2]) if len(args) > 2 and args[2] != "-" else None,
                         args[3] if len(args) > 3 else "http")
    if cmd == "get":
        return http_get(int(args[0]), args[1])
    if cmd == "wrk":
        with open(args[0]) as f:
            w = parse_wrk(f.read())
        if w is None:
            print("    wrk: no result")
            return 1
        err = sum(w["sockerr"].values())
        print(f"    {w['rps']:,.0f} req/s, p50 {fmt_ms(w['p50'])} ms, p99 {fmt_ms(w['p99'])} ms, "
              f"non-2xx {w['non2xx']:,} of {w['requests']:,}" + (f", socket errors {err}" if err else ""))
        return 0
    if cmd == "cpusnap":
        cpu_snapshot(int(args[0]), args[1], int(args[2]) if len(args) > 2 and args[2] != "-" else None)
        return 0
    if cmd == "report":
        return report(args[0])
    if cmd == "authdata":
        return auth_data(args[0], int(args[1]), int(args[2]), args[3])
    if cmd == "probe":
        return probe(int(args[0]), int(args[1]), int(args[2]), args[3:])
    if cmd == "soak-sample":
        return soak_sample(int(args[0]), int(args[1]), int(args[2]), int(args[3]), args[4])
    if cmd == "soak-report":
        return soak_report(args[0])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
