"""Fair sharing of the engine's sequence seats between request groups.

A group is what one client asked for at once: the `n` choices of one API request are one
group, and a request submitted alone is its own. Strict FIFO admission over requests let one
group (an `n=16, max_tokens=2000` request) hold every seat (GDN state slot, `max_seqs`) while
a later 4-token request waited for all of it to finish. The scheduler instead:

- admits, among the waiting requests, the first (by arrival) of the group that holds the
  fewest running requests: round-robin between groups, FIFO within a group and between
  groups that hold as many seats (so a head that waits for pages is not overtaken);
- when that request finds no seat (`max_seqs`, a state slot or KV pages), preempts for it the
  newest running request of the group that holds the most seats, as long as that group holds
  at least two more than the newcomer's: seats end up shared evenly between the groups that
  want them and never move back and forth;
- runs the largest group with only as many sequences per step as the next largest group
  holds (those that ran least recently: they take turns), so a newcomer's steps are as wide
  as the other groups' shares, not as the largest group (a step's cost grows with its
  sequences on the CPU, and with the experts they route to when experts are offloaded);
  a group running alone, or beside one as large, runs all its sequences;
- when pages run out during decode, preempts the newest request of the group holding the most
  seats (the newest request overall when every group holds one).

A preempted request returns its pages and slot and is recomputed when it is admitted again.
Pure Python: the functions here only read the scheduler's request lists.
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
    """The waiting request to admit next: the earliest of the group holding the fewest seats.
    `waiting` is sorted by arrival."""
    best = None
    best_key = None
    for req in waiting:
        key = held[req.group]
        if best_key is None or key < best_key:
            best, best_key = req, key
            if key == 0:
                break  # nobody holds fewer; earlier arrivals come first
    return best


def victim(running: Sequence[_Grouped]) -> _Grouped | None:
    """The running request to preempt: the newest of the group holding the most seats (ties:
    the group whose newest request is newest). `running` is sorted by arrival."""
    held = seats(running)
    if not held:
        return None
    most = max(held.values())
    for req in reversed(running):
        if held[req.group] == most:
            return req
    return None


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
    """The running requests that take part in the next step: each group as many as the group
    with the second most running requests holds (the largest group alone is trimmed, to its
    requests that ran least recently); all of them when one group runs alone or the largest
    two hold as many. Keeps the order of `running`."""
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
