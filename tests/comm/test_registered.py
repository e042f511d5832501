"""``all_to_all_transport="registered"``: NCCL needs every rank to hand it registered send
and receive buffers in a call, or none. Over gloo the transport is the collective, so what
is tested here is where its buffers come from: every row move's two tensors must have been
allocated inside the exchange's ``_comm_memory`` context (the registered pool on CUDA),
in every move the layer makes (dispatch, cached dispatch, both combines, both backwards)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import moe_fn
from moe_fn import MoEConfig, MoELayer
from tests.dist_utils import run_distributed

CASES = [
    dict(combine_impl="fused"),
    dict(combine_impl="eager"),
    dict(combine_impl="fused", overlap_weight_grad=True),
    dict(combine_impl="fused", row_weighting_impl="fused", skip_recompute_combine=True),
    dict(combine_impl="eager", score_apply="pre"),
]


def _tagging(tagged: dict):
    """A stand-in for the registered pool: what is allocated inside is remembered (and
    kept alive, so that no later tensor can reuse its address)."""
    @contextlib.contextmanager
    def memory(device):
        real_empty, real_new_empty = torch.empty, torch.Tensor.new_empty

        def keep(t):
            if t.numel():  # (empty tensors share address 0: nothing to register)
                tagged[t.untyped_storage().data_ptr()] = t
            return t
        torch.empty = lambda *a, **k: keep(real_empty(*a, **k))
        torch.Tensor.new_empty = lambda self, *a, **k: keep(real_new_empty(self, *a, **k))
        try:
            yield
        finally:
            torch.empty, torch.Tensor.new_empty = real_empty, real_new_empty
    return memory


def _case(rank, world, kw):
    tagged, calls = {}, []
    real_a2a = dist.all_to_all_single

    def spy(out, inp, *a, **k):
        calls.append(tuple(t.numel() == 0 or t.untyped_storage().data_ptr() in tagged
                           for t in (out, inp)))
        return real_a2a(out, inp, *a, **k)
    cfg = MoEConfig(hidden_size=16, intermediate_size=8, num_experts=8, top_k=2,
                    comm_backend="all_to_all", ep_size=world,
                    all_to_all_transport="registered", **kw)
    torch.manual_seed(3)
    layer = MoELayer(cfg)
    assert layer.exchange.register_buffers
    layer.exchange._comm_memory = _tagging(tagged)
    x = torch.randn(7 + rank, 16, generator=torch.Generator().manual_seed(rank),
                    requires_grad=True)
    dist.all_to_all_single = spy
    try:
        for _ in range(2):  # a second step: tensors from the pool's reuse too
            out = moe_fn.checkpoint(lambda h: h + layer(h), x)
            out.square().sum().backward()
    finally:
        dist.all_to_all_single = real_a2a
    # Every move is one collective: each step's dispatch, cached dispatch (recompute), its
    # combines (one skipped in the recompute with the skip) and the two backward moves.
    c = layer.exchange.counters
    moves = sum(c[k] for k in ("dispatch", "cached_dispatch", "combine", "combine_backward",
                               "dispatch_backward"))
    assert len(calls) == moves == (10 if kw.get("skip_recompute_combine") else 12), (kw, c)
    assert all(out_tagged and in_tagged for out_tagged, in_tagged in calls), (kw, calls)


def _body(rank, world):
    for kw in CASES:
        _case(rank, world, kw)


@pytest.mark.multiproc
def test_every_row_move_hands_nccl_buffers_from_the_registered_pool():
    run_distributed(_body, 2)


def test_the_transport_is_the_row_exchange_over_all_to_all_only():
    with pytest.raises(ValueError, match="leave it 'collective'"):
        MoEConfig(hidden_size=16, intermediate_size=8, num_experts=8, top_k=2,
                  all_to_all_transport="registered")
    with pytest.raises(ValueError, match="set one of them back"):
        MoEConfig(hidden_size=16, intermediate_size=8, num_experts=8, top_k=2,
                  comm_backend="all_to_all", ep_size=2, all_to_all_dedup=True,
                  all_to_all_transport="registered")
    # No peer-memory rank limit: NCCL registers what it can and sends the rest as before.
    MoEConfig(hidden_size=16, intermediate_size=8, num_experts=128, top_k=2,
              comm_backend="all_to_all", ep_size=64, all_to_all_transport="registered")
