"""Drive headless Chromium over its DevTools protocol (a websocket, through aiohttp) for the dashboard tests:
click as a user does (MLflow's menus open on real pointer events, not on `element.click()`), read the DOM,
take screenshots. No driver download: Debian's chromium and the aiohttp that Ray brings."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from test_report import CHROMIUM, CHROMIUM_FLAGS


class Page:
    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.ids = itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command and its result (events arriving meanwhile are not needed here)."""
        my_id = next(self.ids)
        await self.ws.send_json({"id": my_id, "method": method, "params": params})
        async for msg in self.ws:
            reply = json.loads(msg.data)
            if reply.get("id") == my_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
        raise RuntimeError("the browser closed its DevTools connection")

    async def eval(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)

    async def wait_for(self, expression: str, timeout: float = 60.0) -> Any:
        """The first truthy value of `expression`, polled every 0.25 s (the UI renders asynchronously)."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(RuntimeError):  # the page may be between documents
                value = await self.eval(expression)
                if value:
                    return value
            if time.monotonic() > deadline:
                text = await self.eval("document.body ? document.body.innerText.slice(0, 1500) : ''")
                raise AssertionError(f"timed out waiting for {expression!r}; the page shows:\n{text}")
            await asyncio.sleep(0.25)

    async def click(self, element: str, timeout: float = 30.0) -> None:
        """Press and release the mouse on the centre of the element `element` (a JS expression) evaluates to."""
        centre = (f"(() => {{ const e = ({element}); if (!e) return null; e.scrollIntoView({{block: 'center'}}); "
                  "const r = e.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        x, y = await self.wait_for(centre, timeout)
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            await self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    async def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode((await self.call("Page.captureScreenshot", format="png"))["data"]))


@contextlib.asynccontextmanager
async def open_page(profile: Path, width: int = 1400, height: int = 900) -> AsyncIterator[Page]:
    """A fresh headless Chromium (its own profile: no view state remembered from another page) and its page."""
    import aiohttp

    assert CHROMIUM is not None
    profile.mkdir(parents=True)
    proc = subprocess.Popen([CHROMIUM, *CHROMIUM_FLAGS, "--remote-debugging-port=0", f"--user-data-dir={profile}",
                             f"--window-size={width},{height}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"  # Chromium writes the port it chose here
        deadline = time.monotonic() + 60
        while not port_file.is_file() or not port_file.read_text().strip():
            assert proc.poll() is None and time.monotonic() < deadline, "Chromium did not open its DevTools port"
            await asyncio.sleep(0.1)
        port = port_file.read_text().split()[0]
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json") as resp:
                target = next(t for t in await resp.json() if t["type"] == "page")
            async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                page = Page(ws)
                await page.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                                deviceScaleFactor=1, mobile=False)
                yield page
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
