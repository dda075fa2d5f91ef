"""A websocket client of a running ComfyUI (its ``/ws?clientId=...``), as the frontend connects:
collects every JSON message the server sends that client, on a thread of its own.

aiohttp only (a ComfyUI requirement, so every test venv has it).
"""
from __future__ import annotations

import asyncio
import json
import threading
import time


class WsListener:
    """``with WsListener(server.url, server.client_id) as ws: ...``: connected (the server's first
    ``status`` message received) when the block starts; ``ws.messages`` holds ``{"type", "data"}``
    dicts in the order they came."""

    def __init__(self, url: str, client_id: str, timeout: float = 30):
        self.url = url.replace("http://", "ws://", 1).rstrip("/") + "/ws?clientId=" + client_id
        self.timeout = timeout
        self.messages: list[dict] = []
        self._cv = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._ws = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="comfy-ws", daemon=True)

    def __enter__(self) -> "WsListener":
        self._thread.start()
        self.wait_for(lambda m: m.get("type") == "status", self.timeout, "the server's first status message")
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as e:  # noqa: BLE001 - reported by wait_for
            self._error = e
        finally:
            with self._cv:
                self._cv.notify_all()

    async def _main(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(self.url, max_msg_size=0) as ws:
                self._ws = ws
                async for msg in ws:
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        with self._cv:
                            self.messages.append(json.loads(msg.data))
                            self._cv.notify_all()
                    elif msg.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                        break

    def wait_for(self, pred, timeout: float | None = None, what: str = "a message") -> dict:
        """The first message (from the start) for which ``pred`` holds; waits up to ``timeout`` s."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._cv:
            while True:
                for m in self.messages:
                    if pred(m):
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    raise AssertionError("websocket %s: no %s in %.0f s (error: %r); types seen: %s" % (
                        self.url, what, self.timeout if timeout is None else timeout, self._error,
                        [m.get("type") for m in self.messages][-40:]))
                self._cv.wait(min(left, 0.5))

    def of_type(self, kind: str) -> list[dict]:
        with self._cv:
            return [m for m in self.messages if m.get("type") == kind]

    def close(self) -> None:
        if self._ws is not None and self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._ws.close(), self._loop).result(10)
        self._thread.join(10)
