"""A headless Chromium for tests/console.rs, driven over the DevTools protocol with Debian's
python3-websockets and nothing else.

usage: browser.py CHROMIUM USER_DATA_DIR URL WIDTH HEIGHT

Opens URL, then answers one JSON command per stdin line with one JSON line on stdout:
  {"op": "eval", "expr": JS}            -> {"value": V} (promises awaited) or {"error": E}
  {"op": "navigate", "url": U}          -> {"value": null} once the page has loaded
  {"op": "screenshot", "path": P, "width": W, "height": H}  (the viewport, PNG)
  {"op": "events"}                      -> {"value": {"dialogs": [...], "problems": [...]}}
Every JavaScript dialog (confirm) is recorded and accepted. "problems" are uncaught
exceptions, console errors and Content-Security-Policy reports.
"""
import asyncio
import base64
import ctypes
import json
import os
import signal
import subprocess
import sys
import urllib.request

import websockets

TIMEOUT = 20


class Page:
    def __init__(self, ws):
        self.ws = ws
        self.next_id = 0
        self.waiting = {}
        self.dialogs = []
        self.problems = []
        self.loaded = asyncio.Event()

    async def call(self, method, **params):
        self.next_id += 1
        reply = asyncio.get_running_loop().create_future()
        self.waiting[self.next_id] = reply
        await self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        answer = await asyncio.wait_for(reply, TIMEOUT)
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error'].get('message')}")
        return answer.get("result", {})

    async def read(self):
        async for raw in self.ws:
            msg = json.loads(raw)
            if "id" in msg:
                reply = self.waiting.pop(msg["id"], None)
                if reply and not reply.done():
                    reply.set_result(msg)
                continue
            method, params = msg.get("method"), msg.get("params", {})
            if method == "Page.javascriptDialogOpening":
                self.dialogs.append(params.get("message", ""))
                # Answered without waiting here: this loop must keep reading replies.
                asyncio.ensure_future(self.call("Page.handleJavaScriptDialog", accept=True))
            elif method == "Page.loadEventFired":
                self.loaded.set()
            elif method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                text = details.get("exception", {}).get("description") or details.get("text")
                self.problems.append(f"exception: {text}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                args = [a.get("value", a.get("description")) for a in params.get("args", [])]
                self.problems.append(f"console.error: {args}")
            elif method == "Log.entryAdded":
                entry = params.get("entry", {})
                if entry.get("level") == "error" or "Content Security Policy" in entry.get("text", ""):
                    where = f" ({entry['url']})" if entry.get("url") else ""
                    self.problems.append(f"log: {entry.get('text')}{where}")

    async def navigate(self, url):
        self.loaded.clear()
        await self.call("Page.navigate", url=url)
        await asyncio.wait_for(self.loaded.wait(), TIMEOUT)

    async def evaluate(self, expr):
        result = await self.call(
            "Runtime.evaluate", expression=expr, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise RuntimeError(f"evaluating: {text}")
        return result.get("result", {}).get("value")

    async def size(self, width, height):
        await self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=width < 600,
        )

    async def screenshot(self, path, width, height):
        await self.size(width, height)
        await asyncio.sleep(0.3)
        shot = await self.call("Page.captureScreenshot", format="png")
        with open(path, "wb") as f:
            f.write(base64.b64decode(shot["data"]))


async def devtools_port(user_data_dir, chromium):
    path = os.path.join(user_data_dir, "DevToolsActivePort")
    for _ in range(TIMEOUT * 20):
        if chromium.poll() is not None:
            raise RuntimeError(f"chromium exited with {chromium.returncode}")
        try:
            with open(path) as f:
                first = f.readline().strip()
            if first:
                return int(first)
        except FileNotFoundError:
            pass
        await asyncio.sleep(0.05)
    raise RuntimeError("chromium did not open its DevTools port")


def page_socket(port):
    """The first page target's WebSocket address, from the DevTools HTTP endpoint."""
    url = f"http://127.0.0.1:{port}/json/list"
    with urllib.request.urlopen(url, timeout=TIMEOUT) as answer:
        targets = json.load(answer)
    return next(t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page")


def die_with_parent():
    """Chromium gets SIGKILL when this driver dies, however it dies (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)


async def main(chromium_path, user_data_dir, url, width, height):
    chromium = subprocess.Popen(
        [
            chromium_path,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-extensions",
            "--disable-crash-reporter",
            "--disable-breakpad",
            "--hide-scrollbars",
            "--font-render-hinting=none",
            f"--user-data-dir={user_data_dir}",
            "--remote-debugging-port=0",
            f"--window-size={width},{height}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        preexec_fn=die_with_parent,
        stderr=open(os.path.join(user_data_dir, "chromium.log"), "w"),
    )
    try:
        port = await devtools_port(user_data_dir, chromium)
        async with websockets.connect(page_socket(port), max_size=None, ping_interval=None) as ws:
            page = Page(ws)
            reader = asyncio.ensure_future(page.read())
            for domain in ("Page", "Runtime", "Log"):
                await page.call(f"{domain}.enable")
            await page.size(width, height)
            await page.navigate(url)
            print(json.dumps({"value": "ready"}), flush=True)
            loop = asyncio.get_running_loop()
            while True:
                line = await loop.run_in_executor(None, sys.stdin.readline)
                if not line:
                    break
                command = json.loads(line)
                try:
                    op = command["op"]
                    if op == "eval":
                        value = await page.evaluate(command["expr"])
                    elif op == "navigate":
                        value = await page.navigate(command["url"])
                    elif op == "screenshot":
                        value = await page.screenshot(command["path"], command["width"], command["height"])
                    elif op == "events":
                        value = {"dialogs": page.dialogs, "problems": page.problems}
                        page.dialogs, page.problems = [], []
                    else:
                        raise RuntimeError(f"unknown op {op!r}")
                    answer = {"value": value}
                except Exception as e:  # reported to the test, which fails with it
                    answer = {"error": f"{type(e).__name__}: {e}"}
                print(json.dumps(answer), flush=True)
            reader.cancel()
    finally:
        chromium.kill()
        chromium.wait()


if __name__ == "__main__":
    chromium_path, user_data_dir, url, width, height = sys.argv[1:6]
    asyncio.run(main(chromium_path, user_data_dir, url, int(width), int(height)))
