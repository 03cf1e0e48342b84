"""Device-side expert lookup and miss copy: the torch reference against a dictionary model, and
the Triton kernels against the reference (GPU; or CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from tinyserve.offload import lookup as lk
from tinyserve.offload.store import HostExpertStore


def _dict_lookup(ids: list[int], layer: int, table: dict, owner: dict, victims: list[int],
                 E: int):
    """The lookup written with dictionaries: hits keep their slots, the k-th missing expert
    (by expert id) takes the k-th victim that no hit uses."""
    needed = sorted(set(ids))
    hit_slots = {table[(layer, e)] for e in needed if (layer, e) in table}
    free = [v for v in victims if v not in hit_slots]
    loads = []
    for e in needed:
        if (layer, e) in table:
            continue
        s = free.pop(0)
        old = owner.pop(s, None)
        if old is not None:
            del table[old]
        table[(layer, e)], owner[s] = s, (layer, e)
        loads.append((layer * E + e, s))
    return [table[(layer, e)] for e in ids], loads


def _state(table: torch.Tensor, owner: torch.Tensor, E: int) -> tuple[dict, dict]:
    t = {(r // E, r % E): int(s) for r, s in enumerate(table[:-1].tolist()) if s >= 0}
    o = {s: (int(r) // E, int(r) % E) for s, r in enumerate(owner[:-1].tolist()) if r >= 0}
    return t, o


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Rows of `t` as raw bytes [R, n] (random bytes viewed as floats may be NaN)."""
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def _random_victims(rng: random.Random, S: int, V: int) -> torch.Tensor:
    return torch.tensor(rng.sample(range(S), V), dtype=torch.int32)


@pytest.mark.parametrize("S,E,L,k,N", [(8, 8, 2, 2, 1), (12, 8, 3, 2, 5), (40, 16, 4, 4, 3)],
                         ids=lambda v: str(v))
def test_lookup_ref_matches_dictionary_model(S: int, E: int, L: int, k: int, N: int) -> None:
    rng = random.Random(S * 100 + N)
    table = torch.full((L * E + 1,), -1, dtype=torch.int32)
    owner = torch.full((S + 1,), -1, dtype=torch.int32)
    d_table: dict = {}
    d_owner: dict = {}
    V = min(E, N * k, S)
    for _ in range(30):
        layer = rng.randrange(L)
        ids = torch.tensor([rng.sample(range(E), k) for _ in range(N)])
        victims = _random_victims(rng, S, V)
        slot_ids, rows, slots = lk.expert_lookup_ref(ids, layer, table, owner, victims, E)
        want_slots, want_loads = _dict_lookup(ids.view(-1).tolist(), layer, d_table, d_owner,
                                              victims.tolist(), E)
        assert slot_ids.view(-1).tolist() == want_slots
        got_loads = [(r, s) for r, s in zip(rows.tolist(), slots.tolist(), strict=True)
                     if r >= 0]
        assert got_loads == want_loads
        assert rows.tolist()[len(want_loads):] == [-1] * (V - len(want_loads))
        assert _state(table, owner, E) == (d_table, {s: k for s, k in d_owner.items()})
        assert table[-1] == -1 and owner[-1] == -1


def test_copy_rows_ref_copies_exactly_the_listed_rows() -> None:
    store = HostExpertStore(2, 4, 64, 32, fp4=True)
    store.buffer.copy_(torch.randint(0, 256, store.buffer.shape, dtype=torch.uint8))
    dst = HostExpertStore(1, 5, 64, 32, fp4=True).slots
    for name in lk.FIELDS:  # poison
        getattr(dst, name).view(torch.uint8).fill_(0xAB)
    rows = torch.tensor([6, -1, 1, -1], dtype=torch.int32)
    slots = torch.tensor([3, -1, 0, -1], dtype=torch.int32)
    lk.copy_rows_ref(store.slots, dst, rows, slots)
    for name in lk.FIELDS:
        a, b = _bytes(getattr(store.slots, name)), _bytes(getattr(dst, name))
        assert torch.equal(b[3], a[6]) and torch.equal(b[0], a[1])
        for s in (1, 2, 4):
            assert (b[s] == 0xAB).all()


def _compare_triton_with_ref(device: str) -> None:
    rng = random.Random(7)
    S, E, L, k, N = 24, 16, 3, 4, 3
    V = min(E, N * k, S)
    store = HostExpertStore(L, E, 64, 32, fp4=True, pin=device == "cuda")
    store.buffer.copy_(torch.randint(0, 256, store.buffer.shape, dtype=torch.uint8))
    state = {}
    for impl in ("ref", "triton"):
        torch.manual_seed(0)
        table = torch.full((L * E + 1,), -1, dtype=torch.int32, device=device)
        owner = torch.full((S + 1,), -1, dtype=torch.int32, device=device)
        dst = HostExpertStore(1, S, 64, 32, fp4=True).slots
        dst = type(dst)(**{n: getattr(dst, n).to(device).fill_(0) for n in lk.FIELDS})
        outs = []
        rng = random.Random(7)
        for _ in range(20):
            layer = rng.randrange(L)
            ids = torch.tensor([rng.sample(range(E), k) for _ in range(N)], device=device)
            victims = _random_victims(rng, S, V).to(device)
            # Every other call writes the load lists into given (poisoned) buffers.
            out = None
            if len(outs) % 2:
                out = tuple(torch.full((V,), 12345, dtype=torch.int32, device=device)
                            for _ in range(2))
            # Every third call leaves some misses to the CPU (offload.hybrid's split).
            split = None
            if len(outs) % 3 == 2:
                split = torch.tensor(((0.5, 0.0), (0.3, 0.4), (1.0, -1e6))[len(outs) % 9 // 3],
                                     device=device)
            if impl == "ref":
                got = lk.expert_lookup_ref(ids, layer, table, owner, victims, E, out=out,
                                           split=split)
                lk.copy_rows_ref(store.slots, dst, got[1], got[2])
            else:
                got = lk.expert_lookup(ids, layer, table, owner, victims, E, out=out,
                                       split=split)
                lk.copy_rows(store.slots, dst, got[1], got[2])
            if out is not None:
                assert got[1] is out[0] and got[2] is out[1]
            outs.append([t.cpu() for t in got])
        # Compare raw bytes: random float fields can hold NaN patterns.
        state[impl] = (outs, table.cpu(), owner.cpu(),
                       [_bytes(getattr(dst, n).cpu()) for n in lk.FIELDS])
    ref, tri = state["ref"], state["triton"]
    for a, b in zip(ref[0], tri[0], strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x.int(), y.int())
    assert torch.equal(ref[1], tri[1]) and torch.equal(ref[2], tri[2])
    for x, y in zip(ref[3], tri[3], strict=True):
        assert torch.equal(x, y)


@pytest.mark.requires_cuda
def test_triton_lookup_and_copy_match_the_reference_cuda() -> None:
    _compare_triton_with_ref("cuda")


def test_triton_lookup_and_copy_match_the_reference_interpreted() -> None:
    """The same comparison on CPU with Triton's interpreter (copy reads host memory)."""
    code = ("from tests.offload.test_lookup import _compare_triton_with_ref; "
            "_compare_triton_with_ref('cpu')")
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
