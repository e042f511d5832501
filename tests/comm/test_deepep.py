"""expand_received (DeepEP's expansion of received tokens into expert rows) against a naive
per-slot construction."""

from __future__ import annotations

import pytest
import torch

from moe_fn.comm.deepep import DeepEPExchange, expand_received


def naive(local_idx, e_local):
    rows = [(int(e), t, j) for t, r in enumerate(local_idx.tolist()) for j, e in enumerate(r)
            if e >= 0]
    rows.sort(key=lambda r: r[0])  # stable: (token, slot) order within an expert
    row_of_slot = torch.full(local_idx.shape, -1, dtype=torch.int64)
    for i, (_, t, j) in enumerate(rows):
        row_of_slot[t, j] = i
    return (torch.tensor([t for _, t, _ in rows], dtype=torch.int64),
            torch.tensor([j for _, _, j in rows], dtype=torch.int64), row_of_slot)


@pytest.mark.parametrize("r,k,e_local", [(9, 4, 3), (5, 2, 1), (0, 3, 2), (6, 8, 16)])
def test_expand_received_matches_naive(r, k, e_local):
    g = torch.Generator().manual_seed(r + k)
    local = torch.randint(-1, e_local, (r, k), generator=g)
    if r:
        local[0] = -1  # a token with no expert on this rank
    n = int((local >= 0).sum())
    got = expand_received(local, e_local, n)
    want = naive(local, e_local)
    for a, b in zip(got, want):
        assert torch.equal(a, b.reshape(a.shape)), (a, b)


def test_per_slot_values_follow_the_table_and_are_zero_elsewhere():
    """DeepEP's (received token, k) table of row values (its routing-weight gradients): the
    row's value where the slot's expert is
    local, zero where it lives elsewhere, in the values' dtype, also with no rows at all."""
    table = torch.tensor([[2, -1, 0], [-1, -1, 1]])
    values = torch.tensor([0.5, -1.5, 4.0], dtype=torch.bfloat16)
    got = DeepEPExchange._per_slot(values, table)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.tensor([[4.0, 0.0, 0.5], [0.0, 0.0, -1.5]],
                                         dtype=torch.bfloat16))
    empty = DeepEPExchange._per_slot(torch.zeros(0), torch.full((2, 3), -1))
    assert torch.equal(empty, torch.zeros(2, 3))
