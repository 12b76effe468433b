#!/usr/bin/env python3
"""Redis server CPU per decision of sluice's scripts on many Zipf-distributed keys,
beside the seeds' one-script fixed window, in one run.

Usage: bench/lua_zipf.py [[LABEL=]LUA_DIR ...]      (default: current=<repo>/lua)

For each LUA_DIR and algorithm it loads what sluice calls for a one-policy request into a
private redis-server: since issue #42 the function library (`bench/lua_cost.sh --library`,
the text src/limiter/scripts.rs builds), called by FCALL; before, the script
(`bench/lua_cost.sh --script`), called by EVALSHA. With EVALSHA=1 a library's script form
(what sluice falls back to on Redis < 7) is measured too, as "<label>-evalsha". It drives
each with CALLS decisions, one call each, on keys drawn
Zipf(s = 1) over KEYS keys (a fixed seed: every script sees the same key sequence),
pipelined PIPELINE calls per write so the client is not what limits. The figure is the
redis-server process's whole CPU per decision: utime + stime from /proc/PID/stat over the
variant's run (reading the protocol, the script, its GET/SET/TIME, writing the reply),
divided by the decisions. `usec_per_call` of the call's command in INFO commandstats (the
command alone, without parsing and reply) is shown beside it.

Beside them, on the same keys:
  seeds      the seeds' fixed window, exactly: `INCR` KEYS[1]; `EXPIRE` it by ARGV[2]
             seconds when the count is 1; 0 when the count is over ARGV[1], else 1; by
             EVALSHA with one key and two arguments
  incr       a bare pipelined INCR (the floor of one key's read and write)
and, with BATCH > 1, sluice's "batch" form (the one its Redis backend sends under load):
BATCH consecutive decisions of the sequence per call, figure = usec_per_call / BATCH.

Every round measures every variant, in reverse order on even rounds; the table shows the
median and the minimum over the rounds, and each variant's ratio to the seeds (the ratio
of medians, and the median of each round's ratio). The machine is noisy: compare medians.

Environment (defaults in brackets):
  ROUNDS [5]  CALLS [100000]  KEYS [100000]  SEED [1]  PIPELINE [1000]  BATCH [0]
  ALGORITHMS  [fixed_window sliding_window sliding_log token_bucket gcra leaky_bucket concurrency]
  PORT [16610]  REDIS_SERVER [redis-server]  EVALSHA [0]
  MARKDOWN    a file to also write the table to
  ORDER       "bench" (default) or "reverse": the order of the first round
"""

import bisect
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL_ALGORITHMS = "fixed_window sliding_window sliding_log token_bucket gcra leaky_bucket concurrency"

# The seeds' script, word for word in what it does: limit ARGV[1], window ARGV[2] seconds.
SEEDS_SCRIPT = """local count = redis.call('INCR', KEYS[1])
if count == 1 then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
end
if count > tonumber(ARGV[1]) then
  return 0
end
return 1
"""


def die(msg):
    print(f"lua_zipf: error: {msg}", file=sys.stderr)
    sys.exit(1)


def log(msg):
    print(f"lua_zipf: {msg}", file=sys.stderr, flush=True)


def env_int(name, default):
    value = os.environ.get(name, str(default))
    if not value.isdigit():
        die(f"{name} must be a non-negative integer (got '{value}')")
    return int(value)


def resp(*args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if not isinstance(a, bytes):
            a = str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


class Conn:
    """A minimal RESP client: one command at a time, or a pipeline whose replies are
    read and discarded (errors show in commandstats' failed_calls)."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def _line(self):
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                die("redis closed the connection")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _reply(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind in (b"+", b":"):
            return rest.decode()
        if kind == b"-":
            raise RuntimeError(rest.decode())
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            while len(self.buf) < n + 2:
                self.buf += self.sock.recv(65536)
            data, self.buf = self.buf[:n], self.buf[n + 2:]
            return data
        if kind == b"*":
            return [self._reply() for _ in range(int(rest))]
        die(f"unexpected reply {line!r}")

    def call(self, *args):
        self.sock.sendall(resp(*args))
        return self._reply()

    def pipeline(self, commands, per_write):
        """Sends `commands` (encoded), per_write a write, then an ECHO marker; reads
        (and drops) every reply until the marker's."""
        marker = b"lua-zipf-end-%d" % time.monotonic_ns()
        done = threading.Event()
        tail = b"$%d\r\n%s\r\n" % (len(marker), marker)

        def drain():
            seen = b""
            while True:
                chunk = self.sock.recv(1 << 20)
                if not chunk:
                    break
                seen = (seen + chunk)[-len(tail):]
                if seen == tail:
                    break
            done.set()

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        for i in range(0, len(commands), per_write):
            self.sock.sendall(b"".join(commands[i:i + per_write]))
        self.sock.sendall(resp("ECHO", marker))
        reader.join()
        if not done.is_set():
            die("connection closed during a pipeline")


def zipf_sequence(keys, calls, seed):
    rng = random.Random(seed)
    cdf, total = [], 0.0
    for k in range(1, keys + 1):
        total += 1.0 / k
        cdf.append(total)
    return [bisect.bisect_left(cdf, rng.random() * total) + 1 for _ in range(calls)]


def assemble(lua_dir, alg):
    out = subprocess.run([os.path.join(ROOT, "bench", "lua_cost.sh"), "--script", alg, lua_dir],
                         check=True, capture_output=True)
    return out.stdout


def is_library(lua_dir):
    """Whether decide.lua is the #42 entry point (a function, rules packed in one argument)."""
    with open(os.path.join(lua_dir, "decide.lua")) as f:
        return "local function decide(keys, argv)" in f.read()


def library(lua_dir):
    out = subprocess.run([os.path.join(ROOT, "bench", "lua_cost.sh"), "--library", lua_dir],
                         check=True, capture_output=True)
    return out.stdout


def fields(lua_dir, alg):
    """ARGV after the key for a one-check decide reading TIME, as bench/lua_cost.sh sends."""
    with open(os.path.join(lua_dir, "decide.lua")) as f:
        old = "local FIELDS = 9" in f.read()
    lease = "1" if alg == "concurrency" else "0"
    if is_library(lua_dir):
        if alg == "concurrency":
            return ["decide1", "", f"{alg} 100000000 1000 60000 {lease}", "1"]
        return ["decide1", "", f"{alg} 100000000 1000 100000000 ", "1"]
    if old:
        return ["decide", "", "", alg, "100000000", "1000", "100000000", "", "60000", "1", "1", lease]
    if alg == "concurrency":
        return ["decide1", "", alg, "100000000", "1000", "60000", lease, "1"]
    return ["decide1", "", alg, "100000000", "1000", "100000000", "", "1"]


def cpu_seconds(pid):
    """The process's user + system CPU so far, in seconds (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # After the ")" ending comm: state is field 3, utime 14 and stime 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def commandstat(conn, name):
    info = conn.call("INFO", "commandstats").decode()
    for line in info.splitlines():
        if line.startswith(f"cmdstat_{name}:"):
            stats = dict(kv.split("=") for kv in line.split(":", 1)[1].split(","))
            return int(stats["calls"]), float(stats["usec"]), int(stats.get("failed_calls", 0))
    die(f"no cmdstat_{name} in INFO commandstats")


def main():
    rounds = env_int("ROUNDS", 5)
    calls = env_int("CALLS", 100000)
    nkeys = env_int("KEYS", 100000)
    seed = env_int("SEED", 1)
    per_write = env_int("PIPELINE", 1000)
    batch = env_int("BATCH", 0)
    port = env_int("PORT", 16610)
    algorithms = os.environ.get("ALGORITHMS", ALL_ALGORITHMS).split()
    server = os.environ.get("REDIS_SERVER", "redis-server")
    if min(rounds, calls, nkeys, per_write) < 1:
        die("ROUNDS, CALLS, KEYS and PIPELINE must be positive")
    for arg in sys.argv[1:]:
        if arg in ("-h", "--help"):
            print(__doc__, file=sys.stderr)
            sys.exit(2)
    specs = sys.argv[1:] or [f"current={ROOT}/lua"]
    dirs = []
    for spec in specs:
        label, _, d = spec.partition("=") if "=" in spec else (os.path.basename(spec.rstrip("/")), "", spec)
        if not (os.path.isfile(os.path.join(d, "decide.lua")) and os.path.isfile(os.path.join(d, "common.lua"))):
            die(f"{d}: not a lua/ directory (no common.lua/decide.lua)")
        dirs.append((label, os.path.abspath(d)))
    for alg in algorithms:
        if alg not in ALL_ALGORITHMS.split():
            die(f"unknown algorithm '{alg}'")
    if shutil.which(server) is None:
        die(f"{server} not found (apt-get install -y redis-server)")

    tmp = tempfile.mkdtemp(prefix="lua-zipf-")
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", tmp, "--daemonize", "no",
                             "--loglevel", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        conn = None
        for _ in range(100):
            try:
                conn = Conn(port)
                conn.call("PING")
                break
            except OSError:
                time.sleep(0.05)
        if conn is None:
            die(f"redis-server did not start on port {port}")
        version = conn.call("INFO", "server").decode()
        version = next(l.split(":")[1] for l in version.splitlines() if l.startswith("redis_version"))
        log(f"redis {version} on port {port}; {rounds} rounds of {calls} decisions on {nkeys} Zipf keys"
            f" (seed {seed}), {per_write} per write" + (f", batches of {batch}" if batch > 1 else ""))

        sequence = zipf_sequence(nkeys, calls, seed)
        log(f"{len(set(sequence))} distinct keys drawn; the most drawn {sequence.count(1)} times")

        # Variants: (label, command name in commandstats, decisions per call, commands)
        variants = []
        sha = conn.call("SCRIPT", "LOAD", SEEDS_SCRIPT).decode()
        variants.append(("seeds fixed_window", "evalsha", 1,
                         [resp("EVALSHA", sha, 1, f"seed{{u{k}}}", 100000000, 1) for k in sequence]))
        variants.append(("bare INCR", "incr", 1, [resp("INCR", f"incr{{u{k}}}") for k in sequence]))
        with_evalsha = os.environ.get("EVALSHA", "0") == "1"
        for alg in algorithms:
            for label, d in dirs:
                argv = fields(d, alg)
                key = f"check-{label}{{u1}}:p:{alg}"  # each layout its own key
                forms = []
                if is_library(d):
                    text = library(d)
                    name = text.split(b"\n", 1)[0].split(b"name=")[1].decode()
                    conn.call("FUNCTION", "LOAD", "REPLACE", text)
                    forms.append((label, "fcall", ["FCALL", name]))
                    if with_evalsha:
                        sha = conn.call("SCRIPT", "LOAD", assemble(d, alg)).decode()
                        forms.append((f"{label}-evalsha", "evalsha", ["EVALSHA", sha]))
                else:
                    sha = conn.call("SCRIPT", "LOAD", assemble(d, alg)).decode()
                    forms.append((label, "evalsha", ["EVALSHA", sha]))
                for form, command, call in forms:
                    reply = conn.call(*call, 1, key, *argv)
                    if not ((isinstance(reply, list) and len(reply) >= 5)
                            or (isinstance(reply, bytes) and len(reply) == 40)):
                        die(f"{form} {alg}: unexpected reply {reply!r}")
                    variants.append((f"{form} {alg}", command, 1,
                                     [resp(*call, 1, f"sl{{u{k}}}:p:{alg}", *argv) for k in sequence]))
                    if batch > 1 and "local FIELDS = 9" not in open(os.path.join(d, "decide.lua")).read():
                        cmds = []
                        for i in range(0, calls - calls % batch, batch):
                            keys = [f"sl{{u{k}}}:p:{alg}" for k in sequence[i:i + batch]]
                            if is_library(d):
                                args = ["batch", ""] + argv[:1] + argv[2:] + ["=", batch - 1]
                            else:
                                args = ["batch", ""] + argv[:1] + argv[2:] + ["="] * (batch - 1)
                            cmds.append(resp(*call, batch, *keys, *args))
                        variants.append((f"{form} {alg} batch{batch}", command, batch, cmds))
        conn.call("FLUSHALL")

        results = {v[0]: [] for v in variants}
        command_usec = {v[0]: [] for v in variants}
        for rnd in range(1, rounds + 1):
            order = variants if rnd % 2 else list(reversed(variants))
            line = []
            for label, command, per_call, cmds in order:
                conn.call("FLUSHALL")
                conn.call("CONFIG", "RESETSTAT")
                before = cpu_seconds(proc.pid)
                conn.pipeline(cmds, per_write)
                spent = cpu_seconds(proc.pid) - before
                n, usec, failed = commandstat(conn, command)
                if n < len(cmds) or failed:
                    die(f"{label}: {n} calls, {failed} failed, of {len(cmds)}")
                per_decision = spent * 1e6 / n / per_call
                results[label].append(per_decision)
                command_usec[label].append(usec / n / per_call)
                line.append(f"{label}={per_decision:.2f}")
            log(f"round {rnd}: " + " ".join(line))
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    seeds = results["seeds fixed_window"]
    seeds_med = statistics.median(seeds)
    seeds_cmd = statistics.median(command_usec["seeds fixed_window"])
    out = [f"redis-server CPU per decision (µs: the process's utime + stime over the run / "
           f"decisions), redis {version}, {calls} decisions on {nkeys} Zipf(s=1) keys, seed {seed}, "
           f"{rounds} rounds; `command` is INFO commandstats' usec_per_call / decisions per call",
           "",
           "| script | median | min | ÷ seeds (medians) | median of round ratios | command | command ÷ seeds |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for label, _, _, _ in variants:
        values = results[label]
        ratios = [v / s for v, s in zip(values, seeds)]
        cmd = statistics.median(command_usec[label])
        out.append(f"| {label} | {statistics.median(values):.2f} | {min(values):.2f} | "
                   f"{statistics.median(values) / seeds_med:.2f}× | {statistics.median(ratios):.2f}× | "
                   f"{cmd:.2f} | {cmd / seeds_cmd:.2f}× |")
    text = "\n".join(out)
    print(text)
    if os.environ.get("MARKDOWN"):
        with open(os.environ["MARKDOWN"], "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
