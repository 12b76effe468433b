#!/usr/bin/env python3
"""Memory per idle keep-alive client connection (DESIGN §10: at most 16 KiB).

Usage: bench/idle_memory.py SLUICE_BINARY [CONNECTIONS]

For each kind of request (answered by sluice itself, and proxied to an upstream), a fresh
sluice is started; after a short warm-up, CONNECTIONS (default 2000) clients each send one
request in batches of 50, read the answer and stay connected. The figure is
(RSS with the idle connections - RSS before) / CONNECTIONS, read from /proc/PID/status.
Loopback only; everything started here is stopped on exit.
"""

import http.server
import os
import resource
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time

BATCH = 50


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Upstream(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        body = b"upstream\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def wait_port(port, proc):
    for _ in range(200):
        if proc.poll() is not None:
            raise RuntimeError("sluice exited early")
        try:
            socket.create_connection(("127.0.0.1", port)).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("sluice did not start")


def request(sock, path):
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())


def read_answer(sock):
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            raise RuntimeError("connection closed")
        data += chunk
    if not data.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(data[:80])


def measure(binary, upstream_port, path, n, workdir):
    port, admin = free_port(), free_port()
    config = os.path.join(workdir, "sluice.toml")
    with open(config, "w") as f:
        f.write(f"""[server]
listen = ["127.0.0.1:{port}"]
access_log = "off"
threads = 2
[admin]
listen = "127.0.0.1:{admin}"
[upstreams.up]
servers = ["127.0.0.1:{upstream_port}"]
[[routes]]
name = "respond"
path = "/respond"
respond = {{ status = 200, body = "hello\\n" }}
[[routes]]
name = "proxied"
upstream = "up"
""")
    proc = subprocess.Popen([binary, "run", "--config", config],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, proc)
        for _ in range(BATCH):
            with socket.create_connection(("127.0.0.1", port)) as s:
                request(s, path)
                read_answer(s)
        time.sleep(1)
        before = rss_kib(proc.pid)
        conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
        for i in range(0, n, BATCH):
            for s in conns[i:i + BATCH]:
                request(s, path)
            for s in conns[i:i + BATCH]:
                read_answer(s)
        time.sleep(2)
        after = rss_kib(proc.pid)
        for s in conns:
            s.close()
        return before, after
    finally:
        proc.terminate()
        proc.wait()


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    binary = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    resource.setrlimit(resource.RLIMIT_NOFILE, (n * 2 + 1024, n * 2 + 1024))
    upstream_port = free_port()
    socketserver.ThreadingTCPServer.allow_reuse_address = True
    # A burst of 50 connects must not overflow the default backlog of 5.
    socketserver.ThreadingTCPServer.request_queue_size = 1024
    server = socketserver.ThreadingTCPServer(("127.0.0.1", upstream_port), Upstream)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"| request | idle connections | RSS before (KiB) | RSS after (KiB) | KiB per connection |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as workdir:
        for name, path in (("answered by sluice", "/respond"), ("proxied", "/proxied")):
            before, after = measure(binary, upstream_port, path, n, workdir)
            print(f"| {name} | {n} | {before} | {after} | {(after - before) / n:.1f} |")
    server.shutdown()


if __name__ == "__main__":
    main()
