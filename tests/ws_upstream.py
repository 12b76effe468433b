"""A WebSocket upstream for tests/websocket.rs (Debian's python3-websockets): on each
session it first sends "hello PATH", then answers every text message M with "echo M".

usage: ws_upstream.py PORTFILE   (writes the port it listens on to PORTFILE)
"""
import asyncio
import logging
import os
import sys

import websockets


async def session(ws, path):
    await ws.send("hello " + path)
    async for message in ws:
        await ws.send("echo " + message)


# A client that vanishes without a close frame (a killed proxy) is part of the tests.
logging.disable(logging.ERROR)


async def main(portfile):
    # No pings of its own: a test's idle session must stay idle.
    async with websockets.serve(session, "127.0.0.1", 0, ping_interval=None) as server:
        port = server.sockets[0].getsockname()[1]
        with open(portfile + ".tmp", "w") as f:
            f.write(str(port))
        os.rename(portfile + ".tmp", portfile)
        await asyncio.Future()


asyncio.run(main(sys.argv[1]))
