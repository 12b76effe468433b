"""An upstream that takes 2 s to answer `GET` (a request in flight while sluice drains or
reloads): scripts/container-test.sh and scripts/deb-test.sh. Usage: slow-upstream.py PORT"""
import http.server
import sys
import time


class Slow(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        time.sleep(2)
        body = b"slow answer\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Slow).serve_forever()
