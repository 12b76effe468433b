"""A real gRPC server and client for tests/grpc.rs (python3's grpcio, no protoc: raw bytes).

usage: grpc_peer.py server PORTFILE
         serves /sluice.Echo/Say on 127.0.0.1 (cleartext HTTP/2): answers b"hello " + request
         with the trailing metadata x-echo-trailer: from-upstream; writes its port to PORTFILE
       grpc_peer.py client TARGET METHOD N WHO [CA]
         makes N unary calls of METHOD (e.g. /sluice.Echo/Say) with metadata x-client: WHO
         through TARGET (h2c; over TLS with CA, the server name being sluice.test) and prints
         one JSON line per call:
         {"code": "OK" | status name, "details", "reply", "trailers": {...}}
"""
import json
import sys
from concurrent import futures

try:
    import grpc
except ImportError:
    sys.stderr.write(
        "python3's grpc module is missing: apt-get install python3-grpcio (or: pip install grpcio)\n"
    )
    sys.exit(3)


def say(request, context):
    context.set_trailing_metadata((("x-echo-trailer", "from-upstream"),))
    return b"hello " + request


def serve(portfile):
    handler = grpc.method_handlers_generic_handler(
        "sluice.Echo", {"Say": grpc.unary_unary_rpc_method_handler(say)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with open(portfile + ".tmp", "w") as f:
        f.write(str(port))
    import os

    os.rename(portfile + ".tmp", portfile)
    server.wait_for_termination()


def client(target, method, n, who, ca=None):
    if ca:
        with open(ca, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        options = (("grpc.ssl_target_name_override", "sluice.test"),)
        channel = grpc.secure_channel(target, creds, options)
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        call = channel.unary_unary(method)  # no serializers: bytes in, bytes out
        for _ in range(n):
            try:
                reply, c = call.with_call(b"sluice", timeout=10, metadata=(("x-client", who),))
                out = {
                    "code": c.code().name,
                    "details": c.details() or "",
                    "reply": reply.decode(),
                    "trailers": dict(c.trailing_metadata() or ()),
                }
            except grpc.RpcError as e:
                out = {
                    "code": e.code().name,
                    "details": e.details() or "",
                    "reply": None,
                    "trailers": dict(e.trailing_metadata() or ()),
                }
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        serve(sys.argv[2])
    else:
        client(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], *sys.argv[6:7])
