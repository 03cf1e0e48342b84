"""A scripted stand-in for the engine (same public surface as tinyserve.engine.loop.Engine),
a uvicorn server running in a thread on an ephemeral port, and the app over a scripted engine
served that way (`scripted_server`)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


@dataclass
class FakeOutput:
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[Any] = field(default_factory=list)
    stop_str: str | None = None


class FakeHandle:
    def __init__(self) -> None:
        self._items: list[FakeOutput] = []
        self._lock = threading.Lock()
        self._wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._cond = threading.Condition(self._lock)

    def push(self, out: FakeOutput) -> None:
        with self._lock:
            self._items.append(out)
            self._cond.notify_all()
            for loop, ev in self._wakers:
                loop.call_soon_threadsafe(ev.set)

    def __iter__(self) -> Iterator[FakeOutput]:
        i = 0
        while True:
            with self._cond:
                while i >= len(self._items):
                    self._cond.wait()
                out = self._items[i]
            i += 1
            yield out
            if out.finished:
                return

    async def __aiter__(self):
        ev = asyncio.Event()
        with self._lock:
            self._wakers.append((asyncio.get_running_loop(), ev))
        i = 0
        while True:
            with self._lock:
                ready = self._items[i:]
                if not ready:
                    ev.clear()
            if not ready:
                await ev.wait()
                continue
            for out in ready:
                i += 1
                yield out
                if out.finished:
                    return


@dataclass
class _Req:
    rid: str
    pieces: list[str | Exception]
    max_tokens: int
    prompt_len: int
    handle: FakeHandle
    ready_at: float
    sent: int = 0


@dataclass
class FakeEngine:
    """Emits `script(prompt_ids, params)` one piece (= one token) per tick after
    `prefill_s`. A piece that is an Exception ends the request with finish_reason "error"."""

    tokenizer: Any
    script: Callable[[list[int], Any], list[str | Exception]]
    max_context: int = 4096
    prefill_s: float = 0.0
    tick_s: float = 0.002
    max_seqs: int = 64
    model_config: Any = field(default_factory=lambda: SimpleNamespace(
        eos_token_ids=(248044,), max_position_embeddings=262144))
    submitted: list[tuple[list[int], Any]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[str, _Req] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def submit(self, prompt_ids, params, *, request_id=None, group=None) -> FakeHandle:
        if len(prompt_ids) + 1 > self.max_context:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens exceeds {self.max_context}")
        handle = FakeHandle()
        rid = request_id or f"r{len(self.submitted)}"
        self.submitted.append((list(prompt_ids), params))
        req = _Req(rid, list(self.script(prompt_ids, params)), params.max_tokens,
                   len(prompt_ids), handle, time.monotonic() + self.prefill_s)
        with self._lock:
            self._active[rid] = req
        return handle

    def abort(self, request_id: str) -> None:
        with self._lock:
            req = self._active.pop(request_id, None)
        self.aborted.append(request_id)
        if req is not None:
            req.handle.push(FakeOutput([], "", True, "abort", None, req.prompt_len, req.sent))

    def stats(self) -> Any:
        with self._lock:
            n = len(self._active)
        return SimpleNamespace(num_running=n, num_waiting=0, kv_pages_used=n,
                               kv_pages_total=self.max_seqs, state_slots_used=n,
                               state_slots_total=self.max_seqs, preemptions=0, running=n,
                               waiting=0)

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _loop(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                reqs = [r for r in self._active.values() if r.ready_at <= now]
            for r in reqs:
                self._step(r)
            time.sleep(self.tick_s)

    def _step(self, r: _Req) -> None:
        def end(out: FakeOutput) -> None:
            with self._lock:
                if self._active.pop(r.rid, None) is None:
                    return
            r.handle.push(out)

        if r.sent >= len(r.pieces):
            return end(FakeOutput([], "", True, "stop", None, r.prompt_len, r.sent))
        piece = r.pieces[r.sent]
        if isinstance(piece, Exception):
            return end(FakeOutput([], "", True, "error", str(piece), r.prompt_len, r.sent))
        r.sent += 1
        done = r.sent >= r.max_tokens
        out = FakeOutput([1000 + r.sent], piece, done, "length" if done else None, None,
                         r.prompt_len, r.sent)
        if done:
            return end(out)
        r.handle.push(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(app: Any) -> Iterator[str]:
    """Run `app` with uvicorn in a thread; yields the base URL."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def scripted_server(tokenizer: Any, script: Callable, model: str, *,
                    engine_kw: dict | None = None, loaded: bool = True,
                    **cfg: Any) -> Iterator[tuple[str, FakeEngine, Any]]:
    """The app over a FakeEngine running `script`, served as `model` with ServerConfig
    `cfg` (`loaded=False`: still loading); yields (base URL, engine, server state)."""
    from tinyserve.server.app import create_app
    from tinyserve.server.state import ServerConfig, ServerState

    engine = FakeEngine(tokenizer, script, **(engine_kw or {}))
    state = ServerState(ServerConfig(served_model_name=model, **cfg), engine if loaded else None)
    try:
        with serve(create_app(state)) as url:
            yield url, engine, state
    finally:
        engine.shutdown()


REASONING = ["Let", " me", " think", ".\n", "</think>", "\n\n", "Hello", " world", "!"]
TOOL_REPLY = ["Check", "ing.\n", "</think>", "\n\n", "<tool_call>", "\n<function=get_weather>",
              "\n<parameter=city>\nPar", "is\n</parameter>\n<parameter=days>\n3\n</parameter>",
              "\n</function>\n", "</tool_call>"]


def agent_script(tokenizer):
    """The scripted model of the agent-API tests: a forced tool call, a device error, a long
    reply, a tool call, or reasoning then text, chosen by the prompt."""
    def script(prompt_ids, params):
        text = tokenizer.decode(prompt_ids)
        if text.endswith("<function=get_weather>\n"):  # a forced call
            return ["<parameter=city>\nOslo\n</parameter>\n", "</function>\n</tool_call>"]
        if "ERROR" in text:
            return ["partial", RuntimeError("device lost")]
        if "LONG" in text:
            return [f" w{i}" for i in range(400)]
        if "TOOL" in text and "<tool_response>" not in text:
            return TOOL_REPLY
        return REASONING
    return script
