#!/usr/bin/env python3
"""Docs as tests: every example of README.md and docs/*.md runs as written.

    python3 scripts/check-doc-examples.py [--sluice target/release/sluice]
    python3 scripts/check-doc-examples.py --blocks-only   # TOML and YAML blocks only
    python3 scripts/check-doc-examples.py --self-test     # planted broken blocks are caught

- Every ```toml block passes `sluice check`. The HTML comment on the line before a block
  says what it is (no comment: a complete config; `<!-- check-default: fragment -->` makes
  fragments the default for the rest of a page):
    <!-- check: fragment -->         checked inside a minimal config: a [server], the
                                      upstreams and policies its routes name but it does not
                                      define, and a route when it has none, are added after it;
    <!-- check: invalid FILE -->      must fail, and `sluice check --config FILE` must print
                                      exactly the `FILE:LINE:COL: ...` lines the page shows.
- Every ```yaml block is an envoyproxy/ratelimit file that passes `sluice check` under
  `[rls] config`, unless marked `<!-- check: fragment -->` (descriptors: checked inside a
  domain), `<!-- check: envoy -->` (the Envoy config tests/rls.rs runs through a real Envoy)
  or `<!-- check: skip REASON -->`.
- /etc/sluice is a throw-away directory holding what the examples name: a certificate and
  key for api.example.com (tls/api.pem, tls/api.key), an upstream CA and client certificate
  (internal-ca.pem, to-api.pem, to-api.key), quota.json, ratelimit/, jwks.json.
- Shell recipes marked `<!-- check: run NAME -->` (the indented code block after the
  comment) run in that directory: `admin-token`, `mtls` and `jwt`; then each of their curl
  lines must get 200 from a live sluice configured with what they made, and be refused
  without it. A `<!-- check: session NAME -->` block (`$ command`, then its output) must
  print what the page shows, up to the random ids and keys it makes.
- The README's quick start runs against a live `sluice run --config conf/sluice.toml` (in
  a private network namespace when `unshare -rn` works, so its fixed ports are free): every
  command line must be one `QUICK_START` knows, and gets the answer its comment gives. The
  documented exit statuses and the metric table of docs/responses-and-metrics.md (against
  a live /metrics and src/) are checked too.

Exit 1 with FILE:LINE: what failed. Python 3.11's standard library, openssl and curl.
"""

import argparse
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

try:
    import tomllib
except ModuleNotFoundError:
    sys.exit("check-doc-examples.py needs Python 3.11 or later (tomllib)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"^\s*<!--\s*check:\s*(.*?)\s*-->\s*$")
DEFAULT = re.compile(r"^<!--\s*check-default:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^( *)```(\w*)\s*$")
FAILURES = []
QUIET = False


def fail(where, what):
    FAILURES.append(f"{where}: {what}")
    if not QUIET:
        print(f"FAIL {where}: {what}", flush=True)


def ok(what):
    if not QUIET:
        print(f"ok   {what}", flush=True)


# ---------------------------------------------------------------------------------------
# The pages' blocks


class Block:
    def __init__(self, path, line, lang, text, marker, end):
        self.path, self.line, self.lang, self.text = path, line, lang, text
        self.marker, self.end = marker, end

    @property
    def where(self):
        return f"{self.path}:{self.line}"


def marker_before(lines, i):
    """The `check:` marker on the nearest non-blank line before line i, if any."""
    j = i - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    m = MARKER.match(lines[j]) if j >= 0 else None
    return m.group(1) if m else None


def blocks(path):
    """Fenced blocks, and indented blocks that follow a `run` marker, of one page. A
    `check-default:` comment gives the marker of the page's later unmarked blocks."""
    lines = open(os.path.join(ROOT, path), encoding="utf-8").read().split("\n")
    out, i, default = [], 0, None
    while i < len(lines):
        m = FENCE.match(lines[i])
        d = DEFAULT.match(lines[i])
        if d:
            default = d.group(1)
        if m:
            indent = len(m.group(1))
            j = i + 1
            while j < len(lines) and not re.match(r"^ *```\s*$", lines[j]):
                j += 1
            text = "\n".join(l[indent:] for l in lines[i + 1 : j]) + "\n"
            marker = marker_before(lines, i)
            if marker is None and m.group(2) == "toml":
                marker = default
            out.append(Block(path, i + 1, m.group(2), text, marker, j))
            i = j + 1
            continue
        mk = MARKER.match(lines[i])
        if mk and mk.group(1).split()[0] in ("run", "session"):
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            start = j
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            text = "\n".join(l[4:] for l in lines[start:j]) + "\n"
            out.append(Block(path, start + 1, "sh", text.rstrip() + "\n", mk.group(1), j))
            i = j
            continue
        i += 1
    return out


def pages():
    return ["README.md"] + sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
    )


# ---------------------------------------------------------------------------------------
# Throw-away files the examples name


def make_fixtures(d):
    """What the examples read, under d (which stands for /etc/sluice/)."""
    os.makedirs(os.path.join(d, "tls"), exist_ok=True)
    os.makedirs(os.path.join(d, "ratelimit"), exist_ok=True)
    cmds = [
        "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30"
        " -subj /CN=api.example.com -addext subjectAltName=DNS:api.example.com,DNS:*.example.com"
        " -keyout tls/api.key -out tls/api.pem",
        "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30"
        " -subj /CN=internal-ca -addext basicConstraints=critical,CA:TRUE"
        " -keyout internal-ca.key -out internal-ca.pem",
        "openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=edge"
        " -keyout to-api.key -out to-api.csr",
        "openssl x509 -req -in to-api.csr -CA internal-ca.pem -CAkey internal-ca.key -days 30"
        " -extfile <(printf 'extendedKeyUsage=clientAuth') -out to-api.pem",
    ]
    for c in cmds:
        r = subprocess.run(["bash", "-c", c], cwd=d, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"making the examples' files: {c}\n{r.stderr}")
    with open(os.path.join(d, "quota.json"), "w") as f:
        f.write('{"error": "monthly quota used up"}\n')
    make_jwt = [sys.executable, os.path.join(ROOT, "examples", "make-jwt.py"), "--dir", d]
    subprocess.run(
        make_jwt + ["--iss", "https://idp.example.com/", "--aud", "api", "--sub", "acme"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    with open(os.path.join(d, "ratelimit", "rl.yaml"), "w") as f:
        f.write(
            "domain: fixture\ndescriptors:\n"
            "  - key: fixture\n    rate_limit: {unit: second, requests_per_unit: 1}\n"
        )


def localise(text, etc):
    """/etc/sluice, as a directory or a path under it, read as the throw-away `etc`."""
    return re.sub(r"/etc/sluice(?=/|\s|$|\))", etc, text)


# ---------------------------------------------------------------------------------------
# TOML and YAML blocks


def stubs(fragment):
    """What a fragment's routes name but it does not define, and a route if it has none."""
    doc = tomllib.loads(fragment)
    upstreams = doc.get("upstreams", {})
    policies = doc.get("policies", {})
    routes = doc.get("routes", [])
    out = []
    if "server" not in doc:
        out.append('[server]\nlisten = ["127.0.0.1:8080"]\n')
    for r in routes:
        u = r.get("upstream")
        if u and u not in upstreams:
            upstreams[u] = True
            out.append(f'[upstreams.{u}]\nservers = ["127.0.0.1:9"]\n')
        for p in r.get("policies", []):
            if p not in policies:
                policies[p] = True
                out.append(
                    f'[policies.{p}]\nalgorithm = "fixed_window"\nlimit = 1\nperiod = "1s"\nkey = []\n'
                )
    if not routes:
        names = ", ".join(f'"{p}"' for p in doc.get("policies", {}))
        auth = '\nauth = "optional"' if "auth" in doc else ""
        out.append(
            '[[routes]]\nname = "docs-check"\npath_prefix = "/"\n'
            f'respond = {{ status = 200 }}\npolicies = [{names}]{auth}\n'
        )
    return "\n".join(out)


def check(sluice, config, cwd):
    r = subprocess.run(
        [sluice, "check", "--config", config], cwd=cwd, capture_output=True, text=True
    )
    return r.returncode, r.stdout + r.stderr


def check_toml(b, sluice, etc):
    text = localise(b.text, etc)
    kind = (b.marker or "").split()
    if kind[:1] == ["invalid"]:
        return check_invalid(b, sluice, etc, kind[1] if len(kind) > 1 else "bad.toml")
    if kind[:1] == ["fragment"]:
        try:
            text = text + "\n" + stubs(text)
        except tomllib.TOMLDecodeError as e:
            return fail(b.where, f"not TOML: {e}")
    elif kind:
        return fail(b.where, f"unknown marker `check: {b.marker}`")
    path = os.path.join(etc, "docs-example.toml")
    with open(path, "w") as f:
        f.write(text)
    rc, out = check(sluice, path, etc)
    if rc != 0:
        # Errors at the page's own lines (the block's first line follows the fence).
        out = re.sub(
            re.escape(path) + r":(\d+):",
            lambda m: f"{b.path}:{b.line + int(m.group(1))}:",
            out,
        )
        return fail(b.where, f"`sluice check` exit {rc}:\n{out}")
    ok(f"{b.where} toml{' fragment' if kind else ''} passes check")


def check_invalid(b, sluice, etc, name):
    page = open(os.path.join(ROOT, b.path), encoding="utf-8").read().split("\n")
    shown = []
    for line in page[b.end :]:
        if line.startswith("#"):
            break
        s = line.strip()
        if s.startswith(name + ":"):
            shown.append(s)
    if not shown:
        return fail(b.where, f"an invalid example must be followed by the `{name}:...` lines check prints")
    path = os.path.join(etc, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(localise(b.text, etc))
    rc, out = check(sluice, name, etc)
    got = [l for l in out.splitlines() if l.strip()]
    if rc != 2 or got != shown:
        return fail(b.where, f"check exit {rc} printed\n{out}but the page shows\n" + "\n".join(shown))
    ok(f"{b.where} invalid example fails check with the {len(shown)} errors shown")
    return shown


def check_yaml(b, sluice, etc):
    kind = (b.marker or "").split()
    if kind[:1] == ["envoy"]:
        rls = open(os.path.join(ROOT, "tests", "rls.rs"), encoding="utf-8").read()
        if b.path != "docs/rls.md" or 'docs_block("<!-- check: envoy -->")' not in rls:
            fail(b.where, "tests/rls.rs runs only docs/rls.md's `check: envoy` block")
        else:
            ok(f"{b.where} Envoy config: run through Envoy by tests/rls.rs")
        return
    if kind[:1] == ["skip"]:
        if len(kind) < 2:
            fail(b.where, "`check: skip` needs a reason")
        return
    text = b.text
    if kind[:1] == ["fragment"]:
        text = "domain: docs-fragment\ndescriptors:\n" + "".join(
            "  " + l + "\n" for l in b.text.splitlines()
        )
    elif kind:
        return fail(b.where, f"unknown marker `check: {b.marker}`")
    d = tempfile.mkdtemp(dir=etc)
    with open(os.path.join(d, "rules.yaml"), "w") as f:
        f.write(text)
    config = os.path.join(d, "sluice.toml")
    with open(config, "w") as f:
        f.write(
            '[server]\nlisten = ["127.0.0.1:8080"]\n[rls]\nlisten = "127.0.0.1:8081"\n'
            'config = ["*.yaml"]\n[[routes]]\nname = "r"\npath_prefix = "/"\nrespond = { status = 200 }\n'
        )
    rc, out = check(sluice, config, d)
    if rc != 0:
        return fail(b.where, f"ratelimit YAML fails `sluice check` (exit {rc}):\n{out}")
    ok(f"{b.where} ratelimit yaml{' fragment' if kind else ''} passes check")


# ---------------------------------------------------------------------------------------
# Live sluices


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, proc, log, seconds=15):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sluice exited {proc.returncode}:\n{open(log).read()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}:\n{open(log).read()}")


class Live:
    """A `sluice run` in the background, its log in LOG."""

    def __init__(self, sluice, config, cwd, wait, env=None):
        self.log = os.path.join(cwd, f"sluice-{os.path.basename(config)}-{wait}.log")
        self.proc = subprocess.Popen(
            [sluice, "run", "--config", config],
            cwd=cwd,
            stdout=subprocess.DEVNULL,
            stderr=open(self.log, "w"),
            env=env,
        )
        wait_port(wait, self.proc, self.log)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        return open(self.log).read()


def curl(args, cwd="/"):
    r = subprocess.run(["bash", "-c", "curl " + args], cwd=cwd, capture_output=True, text=True)
    return r


def status_of(out):
    m = re.search(r"^HTTP/[\d.]+ (\d{3})", out, re.M)
    return int(m.group(1)) if m else None


def scrape(port):
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


# ---------------------------------------------------------------------------------------
# The README's quick start, against a live sluice on the quick start's own ports


def section(path, heading, until):
    """(line number, line) of the page between `heading` and the next `until` heading."""
    lines = open(os.path.join(ROOT, path), encoding="utf-8").read().split("\n")
    start = lines.index(heading)
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith(until))
    return [(i + 1, lines[i]) for i in range(start, end)]


def commands(numbered):
    """Indented command lines (continuations joined) with the line they start on."""
    out, pending = [], None
    for n, line in numbered:
        if not line.startswith("    ") or line.startswith("     "):
            if pending and line.startswith("     "):
                pending[1] += " " + line.strip()
                if not line.rstrip().endswith("\\"):
                    out.append(tuple(pending))
                    pending = None
            continue
        text = line[4:]
        if pending:
            out.append(tuple(pending))
            pending = None
        if text.rstrip().endswith("\\"):
            pending = [n, text]
        else:
            out.append((n, text))
    if pending:
        out.append(tuple(pending))
    return [(n, re.sub(r"\s*\\\s+", " ", t)) for n, t in out]


def shell_part(line):
    """The command without its trailing `# comment`."""
    return re.sub(r"\s+#\s.*$", "", line).strip()


def hello_then_429(run):
    answers = [run() for _ in range(6)]
    codes = [status_of(a.stdout) for a in answers]
    bodies_ok = all("hello from sluice" in a.stdout for a in answers[:5])
    if codes != [200] * 5 + [429] or not bodies_ok:
        return f"statuses {codes} (want 200 x5 then 429 with 'hello from sluice')"


def proxied_healthz(run):
    a = run()
    if status_of(a.stdout) != 200 or "ratelimit-policy" not in a.stdout.lower():
        return f"want 200 through route api's policies (RateLimit-Policy), got:\n{a.stdout}"


def metrics_grep(run):
    a = run()
    want = 'sluice_decisions_total{decision="rejected",policy="per_ip",route="hello"} 1'
    if want not in a.stdout:
        return f"want the line `{want}` in:\n{a.stdout}"


def tls_hello(run):
    a = run()
    if a.returncode != 0 or "hello over TLS" not in a.stdout:
        return f"want 'hello over TLS', got rc {a.returncode}: {a.stdout}{a.stderr}"


def redirect_308(run):
    a = run()
    loc = re.search(r"^location: (\S+)", a.stdout, re.I | re.M)
    if status_of(a.stdout) != 308 or not loc or loc.group(1) != "https://api.example.com/hello?x=1":
        return f"want 308 to https://api.example.com/hello?x=1, got:\n{a.stdout}"


def runs_ok(run):
    a = run()
    if a.returncode != 0:
        return f"exit {a.returncode}: {a.stdout}{a.stderr}"


def make_run_serves_the_quick_start(run):
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    if "run: build\n\t$(SLUICE) run --config conf/sluice.toml\n" not in makefile:
        return "the Makefile's `run` no longer serves conf/sluice.toml, which this check runs"


# Every quick-start line with what its comment promises. A line not listed here fails the
# check: a new example comes with its test.
QUICK_START = {
    "make run     # builds, then serves conf/sluice.toml on 127.0.0.1:8080 (admin on :9091)": make_run_serves_the_quick_start,
    "make test    # everything CI runs: fmt, clippy, unit + end-to-end tests, config and ops checks": None,
    "curl -i http://127.0.0.1:8080/hello        # answered by sluice; the 6th call within 10s gets 429": hello_then_429,
    "curl -i http://127.0.0.1:8080/healthz      # proxied upstream (the quick start's upstream is the admin listener)": proxied_healthz,
    "curl -s http://127.0.0.1:9091/metrics | grep sluice_decisions_total": metrics_grep,
    "mkdir -p conf/tls && openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 -subj /CN=api.example.com -addext subjectAltName=DNS:api.example.com,DNS:*.example.com -keyout conf/tls/api.key -out conf/tls/api.pem": runs_ok,
    "target/release/sluice run --config conf/tls.toml": "serve",
    "curl --cacert conf/tls/api.pem --resolve api.example.com:8443:127.0.0.1 https://api.example.com:8443/hello": tls_hello,
    "curl -i -H 'Host: api.example.com' 'http://127.0.0.1:8080/hello?x=1'   # 308 to https://api.example.com/hello?x=1": redirect_308,
}


def quick_start(sluice, work):
    """Runs the quick start's commands in `work`, a copy of conf/ beside target/release/sluice."""
    shutil.copytree(os.path.join(ROOT, "conf"), os.path.join(work, "conf"))
    os.makedirs(os.path.join(work, "target", "release"))
    os.symlink(sluice, os.path.join(work, "target", "release", "sluice"))
    numbered = section("README.md", "## Quick start", "## Examples")
    live = Live(sluice, "conf/sluice.toml", work, 9091)
    # `make run`'s sluice runs, as the README says, while the curls run "in another terminal".
    try:
        for n, line in commands(numbered):
            if line.startswith("sluice ") or line.startswith("conf/"):
                continue  # the command line's synopsis and errors: checked with exit statuses
            where = f"README.md:{n}"
            if line not in QUICK_START:
                fail(where, f"a quick-start command this check does not know: {line!r}")
                continue
            how = QUICK_START[line]
            if how is None:
                continue
            if how == "serve":
                log = live.stop()
                if re.search(r"\b(WARN|ERROR)\b", log):
                    fail("README.md", f"the quick start's sluice logged a warning:\n{log}")
                else:
                    ok("README.md quick start: sluice started and stopped with no warning")
                cmd = shell_part(line).split()
                live = Live(sluice, cmd[-1], work, 8443)
                continue
            cmd = shell_part(line)
            err = how(lambda: subprocess.run(["bash", "-c", cmd], cwd=work, capture_output=True, text=True))
            if err:
                fail(where, f"{cmd}: {err}")
            else:
                ok(f"{where} {cmd[:70]}")
    finally:
        live.stop()


# ---------------------------------------------------------------------------------------


def in_own_network():
    """Re-runs this script in a private network namespace (its own loopback), so the quick
    start's fixed ports are free whatever else runs here; False when that is not possible."""
    if os.environ.get("DOC_EXAMPLES_NETNS") or not shutil.which("unshare") or not shutil.which("ip"):
        return False
    if subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode != 0:
        return False
    env = dict(os.environ, DOC_EXAMPLES_NETNS="1")
    cmd = 'ip link set lo up && exec "$@"'
    r = subprocess.run(["unshare", "-rn", "sh", "-c", cmd, "sh", sys.executable, *sys.argv], env=env)
    sys.exit(r.returncode)


SELF_TEST_PAGE = """# planted

<!-- check: fragment -->
```toml
[policies.good]
algorithm = "gcra"
limit = 10
period = "1s"
key = ["client_ip"]
```

<!-- check: fragment -->
```toml
[policies.broken]
algorithm = "gcra"
limit = 0
period = "1s"
key = ["client_ip"]
```

<!-- check: invalid bad.toml -->
```toml
[server]
listen = ["127.0.0.1:8080"]
```

    bad.toml:1:1: an error this config does not have

```yaml
domain: d
descriptors:
  - key: k
    rate_limit: {unit: fortnight, requests_per_unit: 1}
```
"""


def self_test(sluice):
    """The checker against a planted page: one good block, three broken ones, all caught."""
    global ROOT, QUIET
    with tempfile.TemporaryDirectory() as tmp:
        ROOT, QUIET = tmp, True
        os.makedirs(os.path.join(tmp, "docs"))
        with open(os.path.join(tmp, "README.md"), "w") as f:
            f.write(SELF_TEST_PAGE)
        etc = os.path.join(tmp, "etc")
        os.makedirs(etc)
        for b in blocks("README.md"):
            (check_toml if b.lang == "toml" else check_yaml)(b, sluice, etc)
    caught = sorted(f.split(":")[1] for f in FAILURES)
    if caught != ["13", "22", "29"]:
        sys.exit(f"self-test: want the blocks at lines 13, 22 and 29 caught, got {caught}")
    FAILURES.clear()
    print("self-test: ok (1 good block passed, 3 broken ones caught)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sluice", default=os.path.join(ROOT, "target", "release", "sluice"))
    ap.add_argument("--blocks-only", action="store_true", help="skip the live sluices")
    ap.add_argument("--self-test", action="store_true", help="check the checker on planted blocks")
    args = ap.parse_args()
    sluice = os.path.abspath(args.sluice)
    if not os.access(sluice, os.X_OK):
        sys.exit(f"{sluice}: build it first (cargo build --release)")
    if args.self_test:
        return self_test(sluice)
    if not args.blocks_only:
        in_own_network()
    with tempfile.TemporaryDirectory(prefix="sluice-doc-examples-") as tmp:
        if os.environ.get("DOC_EXAMPLES_KEEP"):
            tmp = tempfile.mkdtemp(prefix="sluice-doc-examples-kept-")
        etc = os.path.join(tmp, "etc")
        os.makedirs(etc)
        make_fixtures(etc)
        recipes = {}
        for page in pages():
            for b in blocks(page):
                if b.lang == "toml":
                    check_toml(b, sluice, etc)
                elif b.lang == "yaml":
                    check_yaml(b, sluice, etc)
                elif b.lang == "sh":
                    recipes.setdefault(b.marker.split()[0], []).append(b)
        if not args.blocks_only:
            live_checks(sluice, tmp, etc, recipes)
    if FAILURES:
        print(f"\n{len(FAILURES)} documented example(s) broken:", file=sys.stderr)
        for f in FAILURES:
            print(f"  {f}", file=sys.stderr)
        sys.exit(1)
    print("every documented example runs as written")


def live_checks(sluice, tmp, etc, recipes):
    work = os.path.join(tmp, "work")
    os.makedirs(work)
    quick_start(sluice, work)
    exit_statuses(sluice, etc)
    bin_dir = os.path.join(tmp, "bin")
    os.makedirs(bin_dir)
    os.symlink(sluice, os.path.join(bin_dir, "sluice"))
    os.symlink(os.path.join(ROOT, "examples"), os.path.join(etc, "examples"))
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"])
    runs = {b.marker.split()[1]: b for b in recipes.get("run", [])}
    for name in ("admin-token", "mtls", "jwt"):
        if name not in runs:
            fail("docs", f"no `<!-- check: run {name} -->` recipe")
            return
    curls = {}
    for name, b in runs.items():
        lines = [shell_part(l) for l in joined(b.text)]
        curls[name] = [l for l in lines if l.startswith("curl ")]
        script = "set -e\n" + "\n".join(localise(l, etc) for l in lines if not l.startswith("curl "))
        if re.search(r"(^|\s)/(etc|usr|var|root|home)/", script):
            fail(b.where, f"recipe `{name}` would write outside its throw-away directory:\n{script}")
            return
        r = subprocess.run(["bash", "-c", script], cwd=etc, env=env, capture_output=True, text=True)
        if r.returncode:
            fail(b.where, f"recipe `{name}` failed:\n{r.stdout}{r.stderr}")
            return
    token = os.path.join(etc, "admin-token")
    mode = os.stat(token).st_mode & 0o777
    text = open(token).read()
    if mode != 0o600 or not re.fullmatch(r"[A-Za-z0-9_-]{43}\n", text):
        fail(runs["admin-token"].where, f"token file mode {mode:o}, content {text!r}")
    else:
        ok(f"{runs['admin-token'].where} admin token file: mode 0600, 43 base64url characters")
    sink = KitchenSink(sluice, etc, env)
    try:
        for name, b in runs.items():
            for c in curls[name]:
                check_recipe_curl(b, name, c, sink, etc)
        for b in recipes.get("session", []):
            session(b, sink, env, etc)
        check_metrics(sink)
    finally:
        sink.stop()


def joined(text):
    """Lines of a shell block with backslash continuations joined."""
    return [l for l in re.sub(r"\\\n\s*", "", text).splitlines() if l.strip()]


KITCHEN_SINK = """
[server]
listen = ["127.0.0.1:{http}"]
tls_listen = ["127.0.0.1:{https}"]
deny = ["192.0.2.0/24"]

[tls]
client_auth = "require"
client_ca = "clients-ca.pem"

[[certificates]]
hosts = ["api.example.com", "*.example.com"]
cert = "tls/api.pem"
key = "tls/api.key"

[admin]
listen = "127.0.0.1:{admin}"
token_file = "admin-token"

[auth]
api_key = ["header:x-api-key"]
hide_credentials = true

[[auth.jwt]]
issuer = "https://idp.example.com/"
audiences = ["api"]
algorithms = ["RS256"]
jwks_file = "jwks.json"
plan_claim = "plan"

[upstreams.self]
servers = ["127.0.0.1:{admin}"]
health_check = {{ interval = "1s", path = "/healthz" }}
retries = {{ attempts = 1, on = ["connect"] }}

[policies.per_ip]
algorithm = "gcra"
limit = 1000
period = "1m"
key = ["client_ip"]

[policies.plans]
algorithm = "gcra"
limit = 100
period = "1m"
key = ["consumer"]

[policies.metered]
algorithm = "token_bucket"
limit = 1000
period = "1h"
key = ["client_ip"]
cost = {{ header = "x-usage-units" }}
reserve = 10

[policies.hot]
algorithm = "gcra"
limit = 1000
period = "1s"
key = []
prefetch = {{ max = 16, hold = "250ms" }}

[[routes]]
name = "hello"
path = "/hello"
respond = {{ status = 200, body = "hello from the docs check" }}
policies = ["per_ip"]

[[routes]]
name = "api"
path_prefix = "/v1/"
respond = {{ status = 200 }}
auth = "required"
policies = ["plans"]

[[routes]]
name = "metered"
path_prefix = "/metrics"
upstream = "self"
policies = ["metered", "hot"]
"""


class KitchenSink:
    """One sluice with TLS and client certificates, JWTs, API keys and an admin token, made
    from the recipes' files: the recipes' curls and the admin sessions run against it."""

    def __init__(self, sluice, etc, env):
        self.http, self.https, self.admin = free_port(), free_port(), free_port()
        self.config = os.path.join(etc, "kitchen-sink.toml")
        with open(self.config, "w") as f:
            f.write(KITCHEN_SINK.format(http=self.http, https=self.https, admin=self.admin))
        self.live = Live(sluice, self.config, etc, self.admin, env=env)
        wait_port(self.http, self.live.proc, self.live.log)

    def ports(self, text):
        return (
            text.replace("127.0.0.1:8080", f"127.0.0.1:{self.http}")
            .replace("127.0.0.1:9091", f"127.0.0.1:{self.admin}")
            .replace(":8443", f":{self.https}")
        )

    def stop(self):
        self.live.stop()


def check_recipe_curl(b, name, line, sink, etc):
    cmd = sink.ports(localise(line, etc))
    code = lambda c: subprocess.run(
        ["bash", "-c", c + " -s -o /dev/null -w '%{http_code}'"], cwd=etc, capture_output=True, text=True
    )
    r = code(cmd)
    if r.stdout != "200":
        full = subprocess.run(["bash", "-c", cmd + " -si"], cwd=etc, capture_output=True, text=True)
        return fail(b.where, f"{cmd}: want 200, got:\n{full.stdout}{full.stderr}")
    # ... and the same call without what the recipe made is refused.
    worse = {
        "mtls": cmd.replace("--cert client.pem --key client.key ", ""),
        "jwt": cmd.replace("$(cat token)", "$(cat token)x"),
        "admin-token": cmd.replace("$(cat " + etc + "/admin-token)", "wrong"),
    }[name]
    r2 = code(worse)
    if r2.stdout == "200" or worse == cmd:
        return fail(b.where, f"without the recipe's credential the call still passes: {worse}")
    ok(f"{b.where} recipe `{name}`: 200 with it, {r2.stdout or 'rc ' + str(r2.returncode)} without")


# Values an admin answer makes up: a key's id and the key itself.
RANDOM = re.compile(r"(?<![\w-])(sk_[\w-]{43}|[0-9a-f]{16})(?![\w-])")


def session(b, sink, env, etc):
    """A shell session (`$ ` commands, then what they print) run against the kitchen sink:
    each command must print what the page shows, up to the random ids and keys, which later
    commands then use."""
    steps, cur = [], None
    for line in b.text.splitlines():
        if line.startswith("$ "):
            cur = [line[2:], []]
            steps.append(cur)
        elif cur is not None:
            cur[1].append(line)
    if not steps:
        return fail(b.where, "a session without `$ ` commands")
    seen = {}
    for cmd, shown in steps:
        run = cmd.replace("/etc/sluice/sluice.toml", sink.config)
        run = run.replace("https://api.example.com/", f"http://127.0.0.1:{sink.http}/")
        for doc_value, real in seen.items():
            run = run.replace(doc_value, real)
        r = subprocess.run(["bash", "-c", run], cwd=etc, env=env, capture_output=True, text=True)
        got = r.stdout.rstrip("\n").split("\n") if r.stdout.strip() else []
        want = [l for l in shown if l.strip()]
        masked = lambda ls: [RANDOM.sub("RANDOM", l) for l in ls]
        if r.returncode or masked(got) != masked(want):
            return fail(b.where, f"$ {cmd}\n  exit {r.returncode}, printed:\n{r.stdout}{r.stderr}  the page shows:\n" + "\n".join(want))
        for w, g in zip(want, got):
            for dv, rv in zip(RANDOM.findall(w), RANDOM.findall(g)):
                seen[dv] = rv
    ok(f"{b.where} session: {len(steps)} commands print what the page shows")
    # The next session starts with no runtime consumers.
    listed = subprocess.run(["sluice", "admin", "consumers", "--config", sink.config], env=env, capture_output=True, text=True)
    for c in json.loads(listed.stdout or "[]"):
        if c.get("source") == "runtime":
            subprocess.run(["sluice", "admin", "consumer", c["name"], "--delete", "--config", sink.config], env=env, capture_output=True)


def exit_statuses(sluice, etc):
    """The exit statuses docs/operations.md lists."""
    where = "docs/operations.md"
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    config = os.path.join(etc, "port-in-use.toml")
    with open(config, "w") as f:
        f.write(
            f'[server]\nlisten = ["127.0.0.1:{port}"]\n[admin]\nlisten = "127.0.0.1:{free_port()}"\n'
            '[[routes]]\nname = "r"\npath_prefix = "/"\nrespond = { status = 200 }\n'
        )
    cases = [
        ("`run` with its port in use", [sluice, "run", "--config", config], 1),
        ("`admin` without a token_file", [sluice, "admin", "policies", "--config", config], 1),
        ("`admin token` over an existing file", [sluice, "admin", "token", config], 1),
        ("`check` of a valid config", [sluice, "check", "--config", config], 0),
        ("`--version`", [sluice, "--version"], 0),
        ("`--help`", [sluice, "--help"], 0),
        ("a wrong command line", [sluice, "chek"], 2),
    ]
    for what, cmd, want in cases:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
            rc = r.returncode
        except subprocess.TimeoutExpired:
            rc = "none (still running after 20 s)"
        if rc != want:
            fail(where, f"{what}: exit {rc}, documented {want}")
        else:
            ok(f"{where} exit {want}: {what}")
    busy.close()


def documented_metrics():
    numbered = section("docs/responses-and-metrics.md", "## Metrics", "### Counting rules")
    names = set()
    for _, line in numbered:
        if line.startswith("| `"):
            names.update(re.findall(r"`((?:sluice|process)_[a-z0-9_]+)`", line.split("|")[1]))
    return names


def check_metrics(sink):
    """Every metric /metrics has, and every one the code registers, is in the doc's table,
    and the table names no other."""
    where = "docs/responses-and-metrics.md"
    for path in ("/hello", "/metrics", "/metrics", "/v1/x"):
        curl(f"-s -o /dev/null http://127.0.0.1:{sink.http}{path}")
    documented = documented_metrics()
    scraped = set(re.findall(r"^# TYPE (\S+) ", scrape(sink.admin), re.M))
    source = set()
    for f in glob.glob(os.path.join(ROOT, "src", "**", "*.rs"), recursive=True):
        source.update(re.findall(r'"((?:sluice|process)_[a-z0-9_]+)"', open(f).read()))
    for name in sorted(scraped - documented):
        fail(where, f"/metrics has `{name}`, the table does not list it")
    for name in sorted(source - documented):
        fail(where, f"src/ registers `{name}`, the table does not list it")
    for name in sorted(documented - scraped - source):
        fail(where, f"the table lists `{name}`, which sluice does not export")
    ok(f"{where}: the table lists the {len(scraped)} families a live /metrics has and the {len(source)} src/ names")


if __name__ == "__main__":
    main()
