#!/usr/bin/env python3
"""The dashboard and the alert rules, proven against a real Prometheus scraping live sluices.

Usage: scripts/prometheus-scenario.py path/to/sluice   (run by scripts/check-prometheus.sh)

Starts redis-server, a small upstream, two sluice instances sharing that Redis, and
Prometheus (1 s scrapes, 1 s rule evaluation, conf/prometheus/alerts.yml loaded) on free
loopback ports, drives a scripted scenario (allowed, rejected, shadow, 404, 502, reloads good
and bad, a ~20 s Redis stall with on_error = "allow", an abandoned request) and asserts on
what Prometheus's HTTP API answers:

- every zero-initialised series is there before the first event, and rate() sees the first;
- every target and variable query of conf/grafana/sluice.json returns data;
- the "429 share" panel equals the 429 share the client saw, within 2 points;
- the reload panel counts every reload; the abandoned request is counted as 499;
- SluiceConfigReloadFailed fires on the first failed reload and resolves on the next good one;
- SluiceLimiterFailingOpen fires during the stall, once per instance, never for a shadow-only
  fallback, and resolves after it;
- SluiceShedding fires when an adaptive upstream of one slot sheds a burst, for that instance
  and upstream only, and resolves after it; the adaptive gauges and shed counter are there
  from start-up.

The FailingOpen/Closed and Shedding rules look back 2 minutes; the copy loaded here looks back 10 s so
the scenario can see them resolve (the expressions are otherwise the file's own). Everything
started is stopped on exit. Exit status 0 when every check passes.
"""

import atexit
import http.server
import json
import os
import re
import shutil
import signal
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALERT_WINDOW = "10s"  # replaces [2m] in the FailingOpen/Closed and Shedding rules of the loaded copy

results = {"pass": 0, "fail": 0}


def check(ok, what, detail=""):
    results["pass" if ok else "fail"] += 1
    print(f"{'PASS' if ok else 'FAIL'}: {what}" + (f" ({detail})" if detail else ""), flush=True)
    return ok


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def wait_for(pred, timeout, every=0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            value = pred()
            if value:
                return value
        except Exception:
            pass
        time.sleep(every)
    return None


def port_open(port):
    try:
        socket.create_connection(("127.0.0.1", port), 0.5).close()
        return True
    except OSError:
        return False


def get(url, headers=None, timeout=5):
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except Exception:
        return 0, b""


# ------------------------------------------------------------------ processes

TMP = tempfile.mkdtemp(prefix="sluice-prometheus.")
procs = []
stopped = []  # processes under SIGSTOP, continued before they are stopped for good


def start(name, args):
    log = open(os.path.join(TMP, f"{name}.log"), "w")
    p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=TMP)
    procs.append((name, p))
    return p


def cleanup():
    for p in stopped:
        try:
            p.send_signal(signal.SIGCONT)
        except OSError:
            pass
    for _, p in procs:
        if p.poll() is None:
            p.terminate()
    for _, p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    shutil.rmtree(TMP, ignore_errors=True)


def show_log(name):
    path = os.path.join(TMP, f"{name}.log")
    if os.path.exists(path):
        for line in open(path, errors="replace").read().splitlines()[-30:]:
            print(f"    {name}: {line}")


class Upstream(http.server.BaseHTTPRequestHandler):
    """200 "ok" at once; /slow answers after 2 s (the abandoned request waits on it)."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        if self.path.startswith("/slow"):
            time.sleep(2)
        body = b"ok\n"
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass

    def log_message(self, *args):
        pass


class ThreadingServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


def sluice_config(proxy, tls, admin, redis, upstream, dead, extra=False):
    text = f"""
[server]
listen = ["127.0.0.1:{proxy}"]
tls_listen = ["127.0.0.1:{tls}"]
access_log = "off"
grace_period = "1s"
threads = 1

[[certificates]]
hosts = ["api.example.com"]
cert = "tls/api.pem"
key = "tls/api.key"

[admin]
listen = "127.0.0.1:{admin}"

[limiter]
backend = "redis"
url = "redis://127.0.0.1:{redis}/0"
timeout = "50ms"
on_error = "allow"

[upstreams.app]
servers = ["127.0.0.1:{upstream}"]

[upstreams.broken]
servers = ["127.0.0.1:{dead}"]
connect_timeout = "200ms"

# One slot, no wait: a second request while /slowtight holds it is shed.
[upstreams.tight]
servers = ["127.0.0.1:{upstream}"]
adaptive = {{ min_limit = 1, max_limit = 1, queue = "0s" }}

# One request per client key and minute: a fresh key passes, a repeated one gets 429.
[policies.per_client]
algorithm = "gcra"
limit = 1
period = "1m"
key = ["header:x-client"]

# Never applied: the scenario sends no x-user (decision "skipped").
[policies.per_user]
algorithm = "fixed_window"
limit = 100
period = "1s"
key = ["header:x-user"]

[policies.watch]
algorithm = "fixed_window"
limit = 5
period = "1s"
key = []
mode = "shadow"

[[routes]]
name = "api"
path_prefix = "/api/"
upstream = "app"
policies = ["per_client", "per_user", "watch"]

[[routes]]
name = "watched"
path = "/watched"
respond = {{ status = 200, body = "watched\\n", content_type = "text/plain" }}
policies = ["watch"]

[[routes]]
name = "slow"
path = "/slow"
upstream = "app"
policies = []

[[routes]]
name = "broken"
path = "/broken"
upstream = "broken"
policies = []

[[routes]]
name = "tight"
path = "/slowtight"
upstream = "tight"
policies = []
"""
    if extra:
        text += """
[policies.fresh]
algorithm = "fixed_window"
limit = 100
period = "1s"
key = []

[[routes]]
name = "extra"
path = "/extra"
respond = { status = 200, body = "extra\\n", content_type = "text/plain" }
policies = ["fresh"]
"""
    return text


class Instance:
    def __init__(self, name, bin_path, ports, redis, upstream, dead):
        self.name = name
        self.proxy, self.tls, self.admin = ports
        self.args = (self.proxy, self.tls, self.admin, redis, upstream, dead)
        self.config = os.path.join(TMP, f"{name}.toml")
        self.bin = bin_path
        self.write()
        self.proc = None

    @property
    def target(self):
        return f"127.0.0.1:{self.admin}"

    def write(self, extra=False, broken=False):
        text = sluice_config(*self.args, extra=extra)
        if broken:
            text = "no_such_key = 1\n" + text
        with open(self.config, "w") as f:
            f.write(text)

    def run(self):
        self.proc = start(f"sluice-{self.name}", [self.bin, "run", "--config", self.config])

    def reload(self):
        self.proc.send_signal(signal.SIGHUP)

    def url(self, path):
        return f"http://127.0.0.1:{self.proxy}{path}"


# ------------------------------------------------------------------ Prometheus API


class Prom:
    def __init__(self, port):
        self.base = f"http://127.0.0.1:{port}/api/v1"

    def _call(self, path, params):
        url = f"{self.base}/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        status, body = get(url, timeout=10)
        doc = json.loads(body or b"{}")
        if doc.get("status") != "success":
            raise RuntimeError(f"{path} {params}: HTTP {status} {doc.get('error', body[:200])}")
        return doc["data"]

    def query(self, expr, at=None):
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self._call("query", params)["result"]

    def value(self, expr, at=None):
        """The single sample of an instant query, or None when it has no result."""
        r = self.query(expr, at)
        return float(r[0]["value"][1]) if r else None

    def query_range(self, expr, start, end, step=1):
        return self._call(
            "query_range", {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": step}
        )["result"]

    def series(self, match, start, end):
        return self._call("series", {"match[]": match, "start": f"{start:.0f}", "end": f"{end:.0f}"})

    def alerts(self, name, state="firing"):
        return [
            a for a in self._call("alerts", {})["alerts"] if a["labels"]["alertname"] == name and a["state"] == state
        ]


# ------------------------------------------------------------------ traffic


class Traffic:
    """Client-side counts of what sluice answered, per (route, status)."""

    def __init__(self):
        self.counts = {}
        self.lock = threading.Lock()
        self.serial = 0

    def send(self, inst, path, route, headers=None):
        status, _ = get(inst.url(path), headers)
        with self.lock:
            key = (route, status)
            self.counts[key] = self.counts.get(key, 0) + 1
        return status

    def good(self, inst):
        with self.lock:
            self.serial += 1
            n = self.serial
        return self.send(inst, "/api/items", "api", {"x-client": f"good-{n}"})

    def abuser(self, inst):
        return self.send(inst, "/api/items", "api", {"x-client": "abuser"})

    def snapshot(self):
        with self.lock:
            return dict(self.counts)


def api_share(before, after):
    n429 = after.get(("api", 429), 0) - before.get(("api", 429), 0)
    total = sum(v for (r, _), v in after.items() if r == "api") - sum(v for (r, _), v in before.items() if r == "api")
    return n429, total


def pace(period, deadline, step):
    """Runs step() every `period` seconds until `deadline`."""
    while time.time() < deadline:
        t = time.time()
        step()
        time.sleep(max(0.0, period - (time.time() - t)))


def abandon(inst, path="/slow"):
    """Sends a request and hangs up before the (2 s) response."""
    s = socket.create_connection(("127.0.0.1", inst.proxy), 2)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: api.example.com\r\n\r\n".encode())
    time.sleep(0.5)
    s.close()


# ------------------------------------------------------------------ dashboard


def dashboard_queries(path):
    """(title, expr, instant) of every panel target, and (name, definition) of every variable."""
    d = json.load(open(path))
    targets = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                targets.append((f"{p['title']} [{t['refId']}]", t["expr"], bool(t.get("instant"))))
            walk(p.get("panels", []))

    walk(d["panels"])
    variables = [(v["name"], v["definition"]) for v in d["templating"]["list"] if v["type"] == "query"]
    return targets, variables


def substitute(expr, rate_interval, range_s):
    expr = expr.replace("$__rate_interval", rate_interval).replace("$__range", f"{range_s}s")
    return re.sub(r"\$\{?(instance|route|policy)\}?", ".*", expr)


# ------------------------------------------------------------------ the scenario


def main():
    if len(sys.argv) != 2:
        print("usage: prometheus-scenario.py path/to/sluice", file=sys.stderr)
        return 64
    bin_path = os.path.abspath(sys.argv[1])
    atexit.register(cleanup)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(130))
    started = time.time()

    (p_redis, p_up, p_dead, p_prom, *p_sluice) = free_ports(4 + 6)
    redis = start("redis", ["redis-server", "--port", str(p_redis), "--bind", "127.0.0.1", "--save", "",
                            "--appendonly", "no", "--dir", TMP])
    upstream = ThreadingServer(("127.0.0.1", p_up), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()

    os.mkdir(os.path.join(TMP, "tls"))
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days",
         "30", "-subj", "/CN=api.example.com", "-addext", "subjectAltName=DNS:api.example.com", "-keyout",
         os.path.join(TMP, "tls/api.key"), "-out", os.path.join(TMP, "tls/api.pem")],
        check=True, capture_output=True)

    a = Instance("a", bin_path, p_sluice[0:3], p_redis, p_up, p_dead)
    b = Instance("b", bin_path, p_sluice[3:6], p_redis, p_up, p_dead)
    instances = (a, b)

    rules = open(os.path.join(ROOT, "conf/prometheus/alerts.yml")).read()
    windows = rules.count("[2m]")
    if not check(windows == 3, "alerts.yml: the FailingOpen/Closed and Shedding rules look back [2m]",
                 f"{windows} found; the scenario shortens them to [{ALERT_WINDOW}]"):
        return 1
    with open(os.path.join(TMP, "alerts.yml"), "w") as f:
        f.write(rules.replace("[2m]", f"[{ALERT_WINDOW}]"))
    with open(os.path.join(TMP, "prometheus.yml"), "w") as f:
        f.write(f"""global:
  scrape_interval: 1s
  scrape_timeout: 900ms
  evaluation_interval: 1s
rule_files:
  - {TMP}/alerts.yml
scrape_configs:
  - job_name: sluice
    static_configs:
      - targets: ["{a.target}", "{b.target}"]
""")

    if not wait_for(lambda: port_open(p_redis), 10):
        show_log("redis")
        return check(False, "redis-server starts") and 1
    for inst in instances:
        inst.run()
    start("prometheus", ["prometheus", f"--config.file={TMP}/prometheus.yml", f"--storage.tsdb.path={TMP}/data",
                         f"--web.listen-address=127.0.0.1:{p_prom}", "--log.level=warn"])
    prom = Prom(p_prom)
    ok = all(wait_for(lambda i=i: get(f"http://{i.target}/healthz")[0] == 200, 15) for i in instances)
    if not check(ok, "both sluice instances serve"):
        for inst in instances:
            show_log(f"sluice-{inst.name}")
        return 1
    up = wait_for(lambda: prom.value('sum(up{job="sluice"})') == 2, 30)
    if not check(bool(up), "Prometheus scrapes both instances every second"):
        show_log("prometheus")
        return 1
    t0 = time.time()
    traffic = Traffic()

    # Zero-initialised before the first event.
    want = [
        'sluice_decisions_total{route="api", policy="per_client", decision="error_allowed"}',
        'sluice_decisions_total{route="api", policy="watch", decision="shadow_rejected"}',
        'sluice_near_limit_total{route="api", policy="per_client"}',
        'sluice_config_reloads_total{result="failure"}',
        'sluice_config_reloads_total{result="success"}',
        'sluice_backend_errors_total{backend="redis", kind="timeout"}',
        'sluice_deny_cache_hits_total{policy="per_client"}',
        'sluice_upstream_in_flight{upstream="tight"}',
    ]
    for expr in want:
        r = prom.query(expr)
        check(len(r) == 2 and all(float(s["value"][1]) == 0 for s in r),
              f"{expr} is 0 on both instances before any event", f"{[(s['metric'].get('instance'), s['value'][1]) for s in r]}")

    # ---- allowed, rejected, shadow, 404, 502, TLS
    for inst in instances:
        traffic.good(inst)
        traffic.abuser(inst)  # the first abuser request passes (on a), the rest get 429
        traffic.send(inst, "/nope", "unmatched")
        traffic.send(inst, "/broken", "broken")
        for _ in range(8):
            traffic.send(inst, "/watched", "watched")  # 5/s: the rest are shadow_rejected

    # ---- reloads: a good, b bad, b good, a bad, a good (3 successes, 2 failures)
    def reloads(inst, result):
        return prom.value(f'sluice_config_reloads_total{{instance="{inst.target}", result="{result}"}}')

    a.write(extra=True)
    a.reload()
    ok = wait_for(lambda: reloads(a, "success") == 1, 10)
    check(bool(ok), "a: good reload counted")
    fresh = f'sluice_decisions_total{{instance="{a.target}", route="extra", policy="fresh", decision="allowed"}}'
    check(wait_for(lambda: prom.value(fresh) == 0, 5) is not None,
          "a reload that adds a route and policy creates their series at 0", f"{prom.value(fresh)}")
    traffic.send(a, "/extra", "extra")

    b.write(broken=True)
    b.reload()
    firing = wait_for(lambda: [x["labels"]["instance"] for x in prom.alerts("SluiceConfigReloadFailed")], 10)
    check(firing == [b.target], "SluiceConfigReloadFailed fires on b's first failed reload", f"{firing}")
    b.write()
    b.reload()
    gone = wait_for(lambda: not prom.alerts("SluiceConfigReloadFailed") and reloads(b, "success") == 1, 10)
    check(bool(gone), "b: a good reload after the failure resolves SluiceConfigReloadFailed")
    a.write(extra=True, broken=True)
    a.reload()
    wait_for(lambda: reloads(a, "failure") == 1, 10)
    a.write(extra=True)
    a.reload()
    wait_for(lambda: reloads(a, "success") == 2, 10)
    rate_sees = prom.value(f'increase(sluice_decisions_total{{instance="{a.target}", route="extra", decision="allowed"}}[30s])')
    check(rate_sees is not None and rate_sees >= 0.9, "increase() sees the first request of a route added by a reload",
          f"{rate_sees}")

    # ---- shedding: /slowtight holds tight's one slot for 2 s on a; 20 more are shed
    limit = prom.value(f'sluice_upstream_concurrency_limit{{instance="{a.target}", upstream="tight"}}')
    check(limit == 1, "the adaptive limit of tight is exported", f"{limit}")
    holder = threading.Thread(target=traffic.send, args=(a, "/slowtight", "tight"))
    holder.start()
    wait_for(lambda: get(f"http://{a.target}/metrics")[1].find(b'sluice_upstream_in_flight{upstream="tight"} 1') >= 0, 5)
    shed = [traffic.send(a, "/slowtight", "tight") for _ in range(20)]
    holder.join()
    check(shed.count(503) == 20, "a's tight upstream sheds every request while its one slot is held",
          f"{shed.count(503)} of 20 answered 503")
    firing = wait_for(lambda: [(x["labels"]["instance"], x["labels"]["upstream"])
                               for x in prom.alerts("SluiceShedding")], 15)
    check(firing == [(a.target, "tight")], "SluiceShedding fires for a's tight upstream only", f"{firing}")
    resolved = wait_for(lambda: not prom.alerts("SluiceShedding") and not prom.alerts("SluiceShedding", "pending"),
                        30, every=0.5)
    check(bool(resolved), f"SluiceShedding resolves once shedding stops (window {ALERT_WINDOW})")

    # ---- the abandoned request (the client hangs up while the upstream takes 2 s)
    abandoner = threading.Thread(target=abandon, args=(a,))
    abandoner.start()

    # ---- steady traffic: per instance and round, two fresh clients and the abuser (1/3 get 429)
    before = traffic.snapshot()
    steady_start = time.time()

    def steady_round():
        for inst in instances:
            traffic.good(inst)
            traffic.good(inst)
            traffic.abuser(inst)

    pace(0.15, steady_start + 12, steady_round)
    steady_end = time.time()
    n429, total = api_share(before, traffic.snapshot())
    true_share = n429 / total
    abandoner.join()

    # ---- the Redis stall: first only shadow-policy traffic, then the api route too
    redis.send_signal(signal.SIGSTOP)
    stopped.append(redis)
    stall_start = time.time()
    pace(0.2, stall_start + 8, lambda: [traffic.send(i, "/watched", "watched") for i in instances])
    shadow_fallbacks = prom.value('sum(increase(sluice_decisions_total{policy="watch", decision="error_allowed"}[8s]))')
    check((shadow_fallbacks or 0) > 0 and not prom.alerts("SluiceLimiterFailingOpen", "firing")
          and not prom.alerts("SluiceLimiterFailingOpen", "pending"),
          "a stall that only shadow policies see raises no SluiceLimiterFailingOpen",
          f"shadow error_allowed in 8s: {shadow_fallbacks}")
    fired = {}

    def stall_round():
        for inst in instances:
            traffic.good(inst)
            traffic.send(inst, "/watched", "watched")
        # Each instance's alert starts at its own rule evaluation: watch until all have one.
        if len(fired.get("instances", ())) < len(instances):
            alerts = prom.alerts("SluiceLimiterFailingOpen")
            if alerts:
                fired.setdefault("at", time.time())
                fired["alerts"] = alerts
                fired["instances"] = {x["labels"].get("instance") for x in alerts}

    pace(0.2, stall_start + 20, stall_round)
    redis.send_signal(signal.SIGCONT)
    stopped.remove(redis)
    stall_end = time.time()
    if fired:
        labels = sorted(json.dumps(x["labels"], sort_keys=True) for x in fired["alerts"])
        per_instance = sorted(x["labels"].get("instance") for x in fired["alerts"])
        extra_labels = [x["labels"] for x in fired["alerts"] if "policy" in x["labels"] or "route" in x["labels"]]
        check(per_instance == sorted(i.target for i in instances) and not extra_labels,
              "SluiceLimiterFailingOpen fires during the stall, one alert per instance",
              f"{fired['at'] - stall_start:.1f}s into the {stall_end - stall_start:.0f}s stall: {labels}")
    else:
        check(False, "SluiceLimiterFailingOpen fires during the stall",
              f"nothing firing in {stall_end - stall_start:.0f}s")

    # ---- after the stall: the alert resolves while traffic goes on
    resolved = wait_for(lambda: (traffic.good(a), traffic.good(b))
                        and not prom.alerts("SluiceLimiterFailingOpen")
                        and not prom.alerts("SluiceLimiterFailingOpen", "pending"), 30, every=0.5)
    check(bool(resolved), "SluiceLimiterFailingOpen resolves after the stall",
          f"{time.time() - stall_end:.1f}s after Redis answers again (window {ALERT_WINDOW})")
    time.sleep(2)  # two more scrapes of everything above
    end = time.time()

    # ---- the reject-ratio panel against the client's truth
    targets, variables = dashboard_queries(os.path.join(ROOT, "conf/grafana/sluice.json"))
    panel = [e for (t, e, _) in targets if t.startswith("429 share of requests by route")]
    window = int(steady_end - steady_start) - 2
    at = steady_end - 1
    got = None
    if panel:
        r = [s for s in prom.query(substitute(panel[0], f"{window}s", 0), at) if s["metric"].get("route") == "api"]
        got = float(r[0]["value"][1]) if r else None
    old = prom.value(
        f'sum(rate(sluice_decisions_total{{route="api", decision="rejected"}}[{window}s])) / sum(rate(sluice_decisions_total{{route="api"}}[{window}s]))',
        at)
    check(got is not None and abs(got - true_share) <= 0.02,
          "the 429-share panel equals the true 429 share of route api within 2 points",
          f"panel {got if got is None else round(got, 4)}, client saw {n429}/{total} = {true_share:.4f}; "
          f"the old per-decision ratio said {old if old is None else round(old, 4)}")

    # ---- the reload panel
    range_s = int(end - t0) + 5
    panel = [e for (t, e, _) in targets if t.startswith("Config reloads in the time range")]
    counted = {}
    if panel:
        for s in prom.query(substitute(panel[0], "5s", range_s), end):
            counted[s["metric"].get("result")] = round(float(s["value"][1]), 2)
    check(counted and round(counted.get("success", -1)) == 3 and round(counted.get("failure", -1)) == 2,
          "the reload panel counts every reload: 3 successes, 2 failures", f"{counted}")

    # ---- 499
    n499 = prom.value('sum(sluice_http_requests_total{status="499"})')
    slow = prom.query('sluice_http_requests_total{route="slow"}')
    check(n499 == 1 and all(s["metric"]["status"] == "499" for s in slow),
          "the abandoned request is counted as 499, not 502",
          f"{[(s['metric']['status'], s['value'][1]) for s in slow]}")

    # ---- every dashboard query returns data
    empty = []
    for title, expr, instant in targets:
        q = substitute(expr, "5s", range_s)
        try:
            data = prom.query(q, end) if instant else prom.query_range(q, t0, end)
        except RuntimeError as e:
            empty.append(f"{title}: {e}")
            continue
        if not data:
            empty.append(f"{title}: {q}")
    for name, definition in variables:
        m = re.match(r"label_values\((.*),\s*(\w+)\)$", definition)
        match = substitute(m.group(1), "5s", range_s) if m else ""
        values = {s.get(m.group(2)) for s in prom.series(match, t0, end)} - {None} if m else set()
        if not values:
            empty.append(f"variable {name}: {definition}")
    check(not empty, f"every dashboard target ({len(targets)}) and variable ({len(variables)}) query returns data",
          "; ".join(empty))

    # ---- the scrape after all of it is clean
    _, body = get(f"http://{a.target}/metrics")
    exported = set(re.findall(r"^# TYPE (\S+)", body.decode(), re.M))
    lint = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True)
    check(lint.returncode == 0 and not lint.stdout.strip() and not lint.stderr.strip(),
          f"promtool check metrics: the scrape is clean ({len(exported)} families)",
          (lint.stdout + lint.stderr).decode().strip())

    print(f"prometheus scenario: {results['pass']} passed, {results['fail']} failed, "
          f"{time.time() - started:.0f}s wall", flush=True)
    if results["fail"]:
        for name, _ in procs:
            show_log(name)
    return 1 if results["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
