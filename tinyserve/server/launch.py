"""`tinyserve run MODEL` and `tinyserve demo`: start answering at once, load in the background.

The HTTP server comes up first (`/health` answers 503 with the load progress), the engine is
built in a thread with a progress bar, then the URL and the memory plan are printed. A load
failure is printed as one line and ends the process with status 1.

SIGTERM drains: new requests get 503 (and `/health` 503 "shutting_down") at once, running
requests have `drain_s` seconds to finish, then what is left is aborted (a stream ends with an
error event and `data: [DONE]`, a non-streamed request with a 503) and the process exits with
status 0. SIGINT does the same without the grace period; a second signal exits at once.
"""

from __future__ import annotations

import os
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
_SWITCH_INTERVAL_S = 0.001


def server_config(args: Any, default_name: str) -> ServerConfig:
    """ServerConfig from CLI arguments (missing ones keep the dataclass defaults). Raises
    ValueError when `--api-key` (or a set TINYSERVE_API_KEY) holds no key: a blank list
    must not turn authentication off."""
    key = getattr(args, "api_key", None)
    where = "--api-key"
    if key is None and envs.API_KEY.raw():
        key, where = envs.API_KEY.get(), envs.API_KEY.name
    drain = getattr(args, "drain_timeout", None)
    try:
        return ServerConfig(
            served_model_name=getattr(args, "served_model_name", None) or default_name,
            api_key=key, cors_origins=tuple(getattr(args, "cors_origin", None) or ()),
            always_include_usage=bool(getattr(args, "always_include_usage", False)),
            **({} if drain is None else {"drain_s": drain}))
    except ValueError as exc:
        if key is not None and "API key" in str(exc):
            raise ValueError(f"{where} {key!r} holds no API key (refusing to serve without "
                             "authentication); give a key, or leave it unset") from None
        raise


def _weight_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _memory_in_use() -> int:
    """Bytes this process holds in RAM plus on the current CUDA device."""
    used = 0
    try:
        with open("/proc/self/statm") as f:
            used += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            used += torch.cuda.memory_allocated()
    return used


class _ProgressWatcher:
    """Estimates weight-loading progress from memory growth (the loader streams weights into
    host or device memory) and shows it as a tqdm bar and in `/health`."""

    def __init__(self, state: ServerState, total_bytes: int, show: bool) -> None:
        self.state, self.total = state, max(1, total_bytes)
        self._stop = threading.Event()
        self._bar = None
        if show:
            from tqdm import tqdm

            self._bar = tqdm(total=100, desc="loading weights", unit="%", file=sys.stderr,
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}")
        self._base = _memory_in_use()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            frac = min(0.99, max(0.0, (_memory_in_use() - self._base) / self.total))
            frac = max(frac, self.state.load_progress)
            self.state.set_progress(frac, "weights")
            if self._bar is not None:
                self._bar.n = int(frac * 100)
                self._bar.refresh()

    def close(self, ok: bool) -> None:
        self._stop.set()
        self._thread.join()
        if self._bar is not None:
            if ok:
                self._bar.n = 100
                self._bar.refresh()
            self._bar.close()


def memory_summary(engine: Any, args: Any) -> str:
    """A short description of where the engine's memory went."""
    stats = engine.stats()
    cfg = getattr(engine, "config", None)
    kv = getattr(cfg, "kv", getattr(args, "kv", "?"))
    lines = [f"  device {getattr(cfg, 'resolved_device', '?')}, "
             f"dtype {str(getattr(cfg, 'torch_dtype', '?')).replace('torch.', '')}",
             f"  KV cache ({kv}): {stats.kv_pages_total} pages x {stats.page_size} tokens = "
             f"{stats.kv_pages_total * stats.page_size} tokens",
             f"  GDN state slots: {stats.state_slots_total} (most sequences at once)",
             f"  context per request: {stats.max_context} tokens"]
    if getattr(cfg, "resolved_device", "cpu").startswith("cuda"):
        import torch

        lines.append(f"  GPU memory in use: {torch.cuda.memory_allocated() / 2**30:.2f} GiB")
    plan = getattr(engine, "memory_plan", None)
    if plan is not None:
        lines += ["memory plan:", *("  " + row for row in plan.format().splitlines())]
    return "\n".join(lines)


def _load(state: ServerState, args: Any, model: str, server: Any, show_progress: bool,
          on_ready: Any = None) -> None:
    from tinyserve.engine.build import build_engine
    from tinyserve.engine.config import EngineConfig
    from tinyserve.model.loader import resolve_model_path

    watcher = None
    try:
        state.set_progress(0.0, "resolving")
        path = resolve_model_path(model)
        config = EngineConfig.from_args(args, model=str(path))
        import transformers  # noqa: F401  (so its import does not count as weights loading)

        watcher = _ProgressWatcher(state, _weight_bytes(path), show_progress)
        engine = build_engine(config)
        watcher.close(ok=True)
        watcher = None
        engine.start()
        if config.resolved_device.startswith("cuda"):  # kernel builds, library set-up: GPU only
            state.set_progress(1.0, "warming up")
            log.info("warm-up request done in %.1f s", engine.warm_up())
        state.set_engine(engine)
        if on_ready is not None:
            on_ready(engine)
    except Exception as exc:  # any failure: one line, then stop the server
        if watcher is not None:
            watcher.close(ok=False)
        state.load_error = f"{type(exc).__name__}: {exc}" if not isinstance(
            exc, (ValueError, OSError)) else str(exc)
        print(f"tinyserve: error: {state.load_error}", file=sys.stderr, flush=True)
        server.should_exit = True


class Drainer:
    """Handles a uvicorn server's exit signals: the first SIGTERM (or SIGINT) drains the
    engine before the server exits (module docstring); a second one is uvicorn's own exit."""

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
        """Refuse new requests, give the running ones `grace_s` seconds, abort the rest (their
        streams get an error event and [DONE]), then let uvicorn close the connections."""
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
    # interval every streamed chunk could wait that long for the event loop to run. 1 ms cut
    # inter-token latency at 16 streams from 106 to 73 ms (engine alone: 69 ms) on CPU.
    sys.setswitchinterval(_SWITCH_INTERVAL_S)
    state = ServerState(server_config(args, default_name))
    app = create_app(state)
    host, port = args.host, args.port
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           lifespan="off", timeout_graceful_shutdown=5))
    Drainer(server, state)
    shown = "localhost" if host in ("0.0.0.0", "::") else host

    def ready(engine: Any) -> None:
        print(f"\ntinyserve: serving {state.config.served_model_name!r} at "
              f"http://{shown}:{port}/v1\n{memory_summary(engine, args)}", flush=True)
        if banner:
            print(banner, flush=True)

    print(f"tinyserve: listening on http://{shown}:{port} (loading {model})", flush=True)
    loader = threading.Thread(target=_load, args=(state, args, model, server,
                                                  True, ready),
                              name="tinyserve-load", daemon=True)
    loader.start()
    try:
        server.run()
    finally:
        state.shutting_down = True
        loader.join(timeout=0.1)
        if state.engine is not None:
            state.engine.shutdown()
    if state.load_error:
        return 1
    return 0 if server.started else 1


def run_command(args: Any) -> int:
    """`tinyserve run MODEL [--kv] [--host] [--port] [--api-key] [--served-model-name] ...`."""
    name = args.model.rstrip("/").split("/")[-1] if Path(args.model).is_dir() else args.model
    return serve(args, args.model, name)


DEMO_WARNING = ("tinyserve demo: this is a tiny model with RANDOM weights. Its output is random "
                "text; it only shows that the server works. Serve a real checkpoint with "
                "`tinyserve run MODEL`.")


def demo_checkpoint() -> Path:
    """The demo's tiny random checkpoint in TINYSERVE_CACHE_DIR, made on first use."""
    from tinyserve.testing import make_tiny_checkpoint

    path = envs.CACHE_DIR.get() / "demo-checkpoint"
    if not (path / "config.json").is_file():
        tmp = path.with_name(f"demo-checkpoint.tmp{os.getpid()}-{int(time.time())}")
        make_tiny_checkpoint(tmp, fmt="bf16")
        try:
            tmp.rename(path)
        except OSError:  # made by another process meanwhile
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return path


def demo_command(args: Any) -> int:
    """`tinyserve demo`: serve a tiny random checkpoint (its output is random text)."""
    print(DEMO_WARNING, flush=True)
    path = demo_checkpoint()
    if getattr(args, "device", None) is None:
        args.device = "cpu"
    return serve(args, str(path), "tinyserve-demo", banner=DEMO_WARNING)
