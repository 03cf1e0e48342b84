"""The engine's idle-state check: what is still held once every request has ended (KV pages,
GDN state slots, prefix-cache references). Needs only the engine (no HTTP stack)."""

from __future__ import annotations

import time
from typing import Any


def wait_idle(engine: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.running == 0 and s.waiting == 0 and not engine._live:
            return
        time.sleep(0.05)
    raise AssertionError(f"the engine is not idle after {timeout} s: {engine.stats()}")


def leaks(engine: Any) -> dict[str, int]:
    """Wait for the engine to go idle and count what is still held beyond the idle prefix
    cache: KV pages, GDN state slots, prefix-cache references a request never dropped. Then
    clear the prefix cache and count again (everything must be back in the pools)."""
    wait_idle(engine)

    def look() -> dict[str, int]:
        s, pc = engine.scheduler, engine.prefix_cache
        out = {"requests": len(s.requests) + len(s.running) + len(s.waiting),
               "state_slots": s.slots.num_used, "kv_pages": s.pages.num_used,
               "cache_refs": 0}
        if pc is not None:
            pc.check()
            out["kv_pages"] -= pc.num_idle_pages
            out["cache_refs"] = pc.num_pages - pc.num_idle_pages
        return out

    before = engine.call(look)
    engine.clear_prefix_cache()
    after = engine.call(look)
    return {"requests": before["requests"],
            "kv_pages": max(before["kv_pages"], after["kv_pages"]),
            "state_slots": max(before["state_slots"], after["state_slots"]),
            "cache_refs": before["cache_refs"]}
