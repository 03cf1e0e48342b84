"""Server configuration and the state the routes share (the engine once it has loaded)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from tinyserve.server.errors import APIError
from tinyserve.server.logprobs import TokenText
from tinyserve.server.metrics import ServerMetrics
from tinyserve.server.prompt_ids import encoder_for


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP layer behaves. The CLI takes its defaults from these fields."""

    served_model_name: str = "tinyserve"
    api_key: str | None = None  # one key, or several separated by commas (None: no key)
    cors_origins: tuple[str, ...] = ()
    keepalive_s: float = 5.0  # SSE `: keep-alive` comment after this long without output
    disconnect_poll_s: float = 0.25  # how often a non-streamed request checks its client
    max_body_bytes: int = 16 * 1024 * 1024
    always_include_usage: bool = False  # send the usage chunk even without include_usage
    drain_s: float = 30.0  # on SIGTERM: how long running requests may take to finish

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_keys:
            # NOTE: "" or "," must not mean "no authentication": the caller asked for a key
            raise ValueError(f"the API key list {self.api_key!r} holds no key")
        if not self.drain_s >= 0:
            raise ValueError(f"drain_s must be >= 0, got {self.drain_s}")

    @property
    def api_keys(self) -> tuple[str, ...]:
        if self.api_key is None:
            return ()
        return tuple(k.strip() for k in self.api_key.split(",") if k.strip())


def _special_id(tokenizer: Any, token: str) -> int | None:
    try:
        tid = tokenizer.convert_tokens_to_ids(token)
    except (KeyError, ValueError, TypeError):
        return None
    unk = getattr(tokenizer, "unk_token_id", None)
    return tid if isinstance(tid, int) and tid >= 0 and tid != unk else None


class ServerState:
    """Mutable server state: the engine (None while loading), load progress, metrics."""

    def __init__(self, config: ServerConfig, engine: Any | None = None) -> None:
        self.config = config
        self.metrics = ServerMetrics()
        self.engine: Any | None = None
        self.token_text: TokenText | None = None  # token texts of logprobs, per tokenizer
        self.stop_token_ids: tuple[int, ...] = ()
        self.load_progress = 0.0
        self.load_stage = "starting"
        self.load_error: str | None = None
        self.shutting_down = False
        self._lock = threading.Lock()
        if engine is not None:
            self.set_engine(engine)

    def set_progress(self, fraction: float, stage: str) -> None:
        self.load_progress = max(0.0, min(1.0, float(fraction)))
        self.load_stage = stage

    def set_engine(self, engine: Any) -> None:
        """Make `engine` serve requests (called once loading has finished)."""
        tokenizer = engine.tokenizer
        ids = [int(t) for t in getattr(engine.model_config, "eos_token_ids", ()) or ()]
        for token in ("<|im_end|>", "<|endoftext|>"):
            tid = _special_id(tokenizer, token)
            if tid is not None:
                ids.append(tid)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            ids.append(int(tokenizer.eos_token_id))
        encoder_for(tokenizer)  # its vocabulary scan now, not in the first request
        with self._lock:
            self.token_text = TokenText(tokenizer)
            self.stop_token_ids = tuple(dict.fromkeys(ids))
            self.load_progress = 1.0
            self.load_stage = "ready"
            self.engine = engine

    def require_engine(self) -> Any:
        if self.shutting_down:
            raise APIError(503, "the server is shutting down")
        if self.engine is None:
            if self.load_error:
                raise APIError(503, f"the model failed to load: {self.load_error}")
            raise APIError(503, f"the model is still loading ({self.load_progress:.0%})")
        return self.engine

    def check_model(self, model: str | None) -> Any:
        """The engine, once the request's `model` is known to be the one served."""
        engine = self.require_engine()
        if model is not None and model != self.config.served_model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                           f"{self.config.served_model_name!r}", param="model",
                           code="model_not_found")
        return engine
