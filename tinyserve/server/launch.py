"""`tinyserve run MODEL` and `tinyserve demo`: answer at once, load in the background.

The HTTP server comes up first (`/health`: 503 with the load progress); a thread plans and
prints the memory plan, builds the engine under a progress bar, warms it up on a GPU and
prints the URL. A load failure is one line and exit status 1. SIGTERM drains: new requests get
503, running ones have `drain_s` seconds, the rest are aborted (each ends as its API ends a
failed request), exit status 0. SIGINT skips the grace period; a second signal exits at once.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tinyserve import envs
from tinyserve.log import get_logger
from tinyserve.server.state import ServerConfig, ServerState

log = get_logger(__name__)


def server_config(args: Any, default_name: str) -> ServerConfig:
    """ServerConfig from CLI arguments. A ValueError when `--api-key` (or TINYSERVE_API_KEY)
    holds no key: a blank list must not turn authentication off."""
    key, where = args.api_key, "--api-key"
    if key is None and envs.API_KEY.raw():
        key, where = envs.API_KEY.get(), envs.API_KEY.name
    drain = args.drain_timeout
    try:
        return ServerConfig(
            served_model_name=args.served_model_name or default_name, api_key=key,
            cors_origins=tuple(args.cors_origin or ()),
            always_include_usage=args.always_include_usage,
            **({} if drain is None else {"drain_s": drain}))
    except ValueError as exc:
        if key is not None and "API key" in str(exc):
            raise ValueError(f"{where} {key!r} holds no API key (refusing to serve without "
                             "authentication); give a key, or leave it unset") from None
        raise


class _ProgressBar:
    """The load's progress as a tqdm bar on stderr and in `/health`."""

    def __init__(self, state: ServerState) -> None:
        from tqdm import tqdm

        self.state = state
        self._shown = (-1, "")
        self._bar = tqdm(total=100, desc="loading", unit="%", file=sys.stderr,
                         bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}")

    def update(self, fraction: float, stage: str) -> None:
        self.state.set_progress(fraction, stage)
        shown = (int(fraction * 100), stage)
        if shown != self._shown:
            self._shown = shown
            self._bar.set_description_str(stage, refresh=False)
            self._bar.n = shown[0]
            self._bar.refresh()

    def close(self, ok: bool) -> None:
        if ok:
            self._bar.n = 100
            self._bar.refresh()
        self._bar.close()


def memory_summary(engine: Any, device_line: str = "") -> str:
    """What the engine holds, in short (its memory plan was printed before)."""
    stats, plan = engine.stats(), engine.memory_plan
    n = stats.state_slots_total
    text = (f"  {plan.device}, {str(engine.config.torch_dtype).replace('torch.', '')}, "
            f"KV {plan.kv_format}: {stats.kv_pages_total} pages x {stats.page_size} tokens, "
            f"{n} sequence{'s' * (n != 1)} at once, {stats.max_context} tokens each")
    return text + (f"\n  {device_line}" if device_line else "")


def _load(state: ServerState, args: Any, model: str, server: Any, on_ready: Any) -> None:
    from tinyserve.engine.build import build_engine
    from tinyserve.engine.config import EngineConfig
    from tinyserve.engine.device_memory import device_memory_report
    from tinyserve.engine.planner import plan_engine
    from tinyserve.engine.progress import WARM_UP, LoadProgress
    from tinyserve.model.loader import resolve_model_path

    bar = None
    try:
        state.set_progress(0.0, "resolving")
        path = resolve_model_path(model)
        config = EngineConfig.from_args(args, model=str(path))
        state.set_progress(0.0, "planning")
        plan = plan_engine(config, path)
        print(plan.format(), flush=True)  # the same text as `tinyserve plan` with these flags
        bar = _ProgressBar(state)
        progress = LoadProgress(on_change=bar.update)
        if plan.is_cuda:  # kernel builds, library set-up, graph capture: GPU only
            progress.expect(WARM_UP, 1)
        engine = build_engine(config, plan=plan, progress=progress)
        engine.start()
        device_line = ""
        if plan.is_cuda:
            progress.begin(WARM_UP)
            log.info("warm-up request done in %.1f s", engine.warm_up())
            progress.complete(WARM_UP)
            device_line, _ = device_memory_report(plan, plan.device)
        log.info("load stages (s): %s", progress.timings())
        bar.close(ok=True)
        bar = None
        state.set_engine(engine)
        on_ready(engine, device_line)
    except Exception as exc:  # any failure: one line, then stop the server
        if bar is not None:
            bar.close(ok=False)
        state.load_error = f"{type(exc).__name__}: {exc}" if not isinstance(
            exc, (ValueError, OSError)) else str(exc)
        print(f"tinyserve: error: {state.load_error}", file=sys.stderr, flush=True)
        server.should_exit = True


class Drainer:
    """A uvicorn server's exit signals: the first drains the engine (module docstring), a
    second one is uvicorn's own exit."""

    def __init__(self, server: Any, state: ServerState) -> None:
        self.server = server
        self.state = state
        self.thread: threading.Thread | None = None
        self._uvicorn_exit = server.handle_exit
        server.handle_exit = self.handle_exit  # NOTE: uvicorn installs it as the handler

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.thread is not None or self.server.should_exit:
            self._uvicorn_exit(sig, frame)
            return
        grace = self.state.config.drain_s if sig == signal.SIGTERM else 0.0
        self.thread = threading.Thread(target=self.drain, args=(grace,), name="tinyserve-drain",
                                       daemon=True)
        self.thread.start()

    def drain(self, grace_s: float) -> None:
        """Refuse new requests, give the running ones `grace_s` seconds, abort the rest, then
        let uvicorn close the connections."""
        state = self.state
        state.shutting_down = True
        engine = state.engine
        deadline = time.monotonic() + grace_s
        try:
            while engine is not None and time.monotonic() < deadline:
                stats = engine.stats()
                if stats.running + stats.waiting == 0:
                    break
                time.sleep(0.05)
            if engine is not None:
                engine.shutdown()
        finally:
            self.server.should_exit = True


def serve(args: Any, model: str, default_name: str, banner: str = "") -> int:
    """Serve `model` until interrupted. Returns the process exit status."""
    import uvicorn

    from tinyserve.server.app import create_app

    # NOTE: the engine thread holds the GIL between tensor ops; with the default 5 ms switch
    # interval every streamed chunk could wait that long for the event loop
    sys.setswitchinterval(0.001)
    state = ServerState(server_config(args, default_name))
    app = create_app(state)
    host, port = args.host, args.port
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           lifespan="off", timeout_graceful_shutdown=5))
    Drainer(server, state)
    shown = "localhost" if host in ("0.0.0.0", "::") else host

    def ready(engine: Any, device_line: str) -> None:
        print(f"\ntinyserve: serving {state.config.served_model_name!r} at "
              f"http://{shown}:{port}/v1\n{memory_summary(engine, device_line)}", flush=True)
        if banner:
            print(banner, flush=True)

    print(f"tinyserve: listening on http://{shown}:{port} (loading {model})", flush=True)
    loader = threading.Thread(target=_load, args=(state, args, model, server, ready),
                              name="tinyserve-load", daemon=True)
    loader.start()
    try:
        server.run()
    finally:
        state.shutting_down = True
        loader.join(timeout=0.1)
        if state.engine is not None:
            state.engine.shutdown()
    return 0 if server.started and not state.load_error else 1


def run_command(args: Any) -> int:
    """`tinyserve run MODEL [--kv] [--host] [--port] [--api-key] [--served-model-name] ...`."""
    name = args.model.rstrip("/").split("/")[-1] if Path(args.model).is_dir() else args.model
    return serve(args, args.model, name)


DEMO_WARNING = ("tinyserve demo: this is a tiny model with RANDOM weights. Its output is random "
                "text; it only shows that the server works. Serve a real checkpoint with "
                "`tinyserve run MODEL`.")


def demo_command(args: Any) -> int:
    """`tinyserve demo`: serve a tiny random checkpoint (its output is random text)."""
    from tinyserve.testing.demo import DEMO_NAME, demo_checkpoint

    print(DEMO_WARNING, flush=True)
    path = demo_checkpoint()
    if args.device is None:
        args.device = "cpu"
    return serve(args, str(path), DEMO_NAME, banner=DEMO_WARNING)
