"""A TLS upstream for tests/gateway.rs and tests/upstream_tls.rs: answers every GET with the
SNI the client sent (and the CN of its certificate, when CLIENT_CA is given).

usage: tls_upstream.py CERT KEY PORTFILE [CLIENT_CA]   (writes the port it listens on to
PORTFILE; with CLIENT_CA, a client certificate issued by it is required)
"""
import http.server
import ssl
import sys
import threading

cert, key, portfile = sys.argv[1:4]
seen = threading.local()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        body = "tls sni=%s path=%s" % (getattr(self.connection, "sni", None), self.path)
        peer = self.connection.getpeercert()
        if peer:
            cn = [v for rdn in peer.get("subject", ()) for (k, v) in rdn if k == "commonName"]
            body += " client=%s" % ",".join(cn)
        body = (body + "\n").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
if len(sys.argv) > 4:
    ctx.load_verify_locations(sys.argv[4])
    ctx.verify_mode = ssl.CERT_REQUIRED


def remember_sni(sock, name, _ctx):
    sock.sni = name


ctx.sni_callback = remember_sni
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
server.socket = ctx.wrap_socket(server.socket, server_side=True)
with open(portfile + ".tmp", "w") as f:
    f.write(str(server.server_address[1]))
import os

os.rename(portfile + ".tmp", portfile)
server.serve_forever()
