"""RequestHandle: ordering, the end of the stream, sync and async consumers racing a producer."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from tinyserve.engine.stream import RequestHandle, RequestOutput


def outputs(n: int) -> list[RequestOutput]:
    return [RequestOutput("r", [i], str(i), i == n - 1, "length" if i == n - 1 else None)
            for i in range(n)]


def produce(handle: RequestHandle, items: list[RequestOutput], seed: int) -> threading.Thread:
    rng = random.Random(seed)

    def run() -> None:
        for out in items:
            if rng.random() < 0.3:
                time.sleep(rng.random() * 1e-4)
            handle.put(out)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_items_in_order_and_nothing_after_the_end() -> None:
    handle = RequestHandle("r", 3, lambda rid: None)
    with pytest.raises(TimeoutError):
        handle.get(timeout=0.01)
    items = outputs(4)
    for out in items:
        handle.put(out)
    handle.put(RequestOutput("r", [9], "late", True, "abort"))  # after the end: dropped
    assert list(handle) == items and handle.finished
    with pytest.raises(TimeoutError):
        handle.get(timeout=0.01)


@pytest.mark.parametrize("seed", range(3))
def test_sync_and_result_against_a_producer_thread(seed: int) -> None:
    items = outputs(300)
    handle = RequestHandle("r", 3, lambda rid: None)
    t = produce(handle, items, seed)
    merged = handle.result(timeout=10)
    t.join()
    assert merged.token_ids == list(range(300)) and merged.finish_reason == "length"
    assert merged.text == "".join(str(i) for i in range(300))


@pytest.mark.parametrize("seed", range(3))
def test_async_consumer_misses_no_wakeup(seed: int) -> None:
    items = outputs(300)

    async def main() -> list[RequestOutput]:
        handle = RequestHandle("r", 3, lambda rid: None)
        got = []
        consumer = asyncio.ensure_future(_collect(handle, got))
        await asyncio.sleep(0)  # the consumer waits before the producer starts
        t = produce(handle, items, seed)
        await asyncio.wait_for(consumer, timeout=10)
        t.join()
        return got

    assert asyncio.run(main()) == items


async def _collect(handle: RequestHandle, got: list) -> None:
    async for out in handle:
        got.append(out)


def test_abort_calls_back_with_the_id() -> None:
    seen = []
    RequestHandle("req-7", 1, seen.append).abort()
    assert seen == ["req-7"]
