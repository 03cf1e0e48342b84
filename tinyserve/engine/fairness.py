"""Fair sharing of sequence seats between request groups (the `n` choices of one API request).

Admit the earliest request of the group holding the fewest seats; preempt for it the newest
request of a group holding two seats more; run the largest group with as many sequences per
step as the next largest holds; when decode runs out of pages, preempt the newest request of
the group holding the most seats. Pure Python.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Protocol


class _Grouped(Protocol):
    group: str
    arrival: int


def seats(running: Sequence[_Grouped]) -> Counter[str]:
    """Running requests per group."""
    return Counter(r.group for r in running)


def next_waiting(waiting: Sequence[_Grouped], held: Counter[str]) -> _Grouped | None:
    """The earliest waiting request (`waiting` sorted by arrival) of the group holding the
    fewest seats."""
    return min(waiting, key=lambda r: held[r.group], default=None)


def victim(running: Sequence[_Grouped]) -> _Grouped | None:
    """The newest running request of the group holding the most seats (`running` sorted by
    arrival)."""
    held = seats(running)
    if not held:
        return None
    most = max(held.values())
    return next((r for r in reversed(running) if held[r.group] == most), None)


def should_yield(running: Sequence[_Grouped], newcomer: _Grouped) -> _Grouped | None:
    """The running request to preempt so that `newcomer` gets a seat, or None when its group
    already holds its share (the victim's group must hold at least two seats more)."""
    out = victim(running)
    if out is None:
        return None
    held = seats(running)
    return out if held[out.group] >= held[newcomer.group] + 2 else None


class _Rotating(_Grouped, Protocol):
    last_step: int


def step_share(running: Sequence[_Rotating]) -> list[_Rotating]:
    """The running requests in the next step, in order: the largest group trimmed to as many
    as the second largest holds (those that ran least recently); all when none is larger."""
    held = seats(running)
    if len(held) < 2:
        return list(running)
    (top, most), (_, second) = held.most_common(2)
    if most == second:
        return list(running)
    members = sorted((r for r in running if r.group == top),
                     key=lambda r: (r.last_step, r.arrival))
    keep = {id(r) for r in members[:second]}
    return [r for r in running if r.group != top or id(r) in keep]
