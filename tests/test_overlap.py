"""overlap_weight_grad: dW GEMMs beside the backward combine."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import moe_fn
import moe_fn.autograd.routing as routing
from moe_fn import MoEConfig, MoELayer
from moe_fn.autograd.slot import WeightGradSlot
from moe_fn.comm.carveout import sm_carveout
from tests import fake_deep_ep
from tests.dist_utils import run_distributed

H, I, E = 8, 6, 8


def _layer(world, rank, seed, **kw):
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2,
                    **{"comm_backend": "all_to_all", "ep_size": world,
                       "score_correction_bias": True, **kw})
    layer = MoELayer(cfg)
    g = torch.Generator().manual_seed(seed)
    el = cfg.num_local_experts
    with torch.no_grad():
        layer.router.weight.copy_(torch.randn(E, H, generator=g))
        layer.experts.gate_up_proj.copy_((0.5 * torch.randn(E, 2 * I, H, generator=g))
                                         [rank * el:(rank + 1) * el])
        layer.experts.down_proj.copy_((0.5 * torch.randn(E, H, I, generator=g))
                                      [rank * el:(rank + 1) * el])
        # Skewed routing: expert 1 never chosen, expert 2 strongly preferred.
        bias = torch.zeros(E)
        bias[1], bias[2] = -100.0, 1.0
        layer.router.e_score_correction_bias.copy_(bias)
        for p in (layer.router.bias, layer.experts.gate_up_proj_bias,
                  layer.experts.down_proj_bias):
            if p is not None:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return layer


def _grads(world, rank, mode, **kw):
    layer = _layer(world, rank, 5, **kw)
    x = torch.randn(7 + rank, H, generator=torch.Generator().manual_seed(rank)).requires_grad_()

    def block(h):
        return h + layer(h)
    if mode == "none":
        out = block(x)
    else:
        out = moe_fn.checkpoint(block, x, use_reentrant=(mode == "reentrant"))
    (out * torch.linspace(-1, 1, H)).sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


def _check_gradients(rank, world):
    for act, impl, (mode, skip) in itertools.product(
            ["swiglu", "swiglu_clamped", "swiglu_oai", "geglu_tanh"], ["fused", "separate"],
            [("none", False), ("reentrant", False), ("reentrant", True),
             ("non_reentrant", False), ("non_reentrant", True)]):
        kw = dict(activation=act, gate_up_impl=impl, skip_recompute_combine=skip)
        serial = _grads(world, rank, mode, **kw)
        overlapped = _grads(world, rank, mode, overlap_weight_grad=True, **kw)
        for a, b in zip(serial, overlapped):
            assert torch.equal(a, b), (act, impl, mode, skip)
    # GPT-OSS's biases: their gradients are deferred with the weights' and still arrive.
    for impl, (mode, skip) in itertools.product(
            ["fused", "separate"], [("none", False), ("reentrant", True),
                                    ("non_reentrant", False)]):
        kw = dict(activation="swiglu_oai", gate_up_layout="interleaved", gate_up_impl=impl,
                  router_bias=True, expert_bias=True, skip_recompute_combine=skip)
        serial = _grads(world, rank, mode, **kw)
        overlapped = _grads(world, rank, mode, overlap_weight_grad=True, **kw)
        assert len(serial) == 2 + 6
        for a, b in zip(serial, overlapped):
            assert b is not None and torch.equal(a, b), (impl, mode, skip)
    # Not recomputed under either checkpoint: the kept graph's backward runs the overlap.
    for mode in ("reentrant", "non_reentrant"):
        kw = dict(recompute_in_checkpoint=False)
        want = _grads(world, rank, "none")
        for got in (_grads(world, rank, mode, **kw),
                    _grads(world, rank, mode, overlap_weight_grad=True, **kw)):
            for a, b in zip(want, got):
                assert torch.equal(a, b), mode
    # The steered expert really received no rows anywhere.
    layer = _layer(world, rank, 5, overlap_weight_grad=True)
    layer(torch.randn(9, H)).sum().backward()
    el = layer.config.num_local_experts
    if rank == 1 // el:
        assert float(layer.experts.down_proj.grad[1 % el].abs().sum()) == 0.0


def _check_gradients_other_exchange(rank, world, **exchange_kw):
    """The symm_mem exchange and DeepEP: the same guarantees."""
    for impl, (mode, skip) in itertools.product(
            ["fused", "separate"], [("none", False), ("reentrant", False), ("reentrant", True),
                                    ("non_reentrant", True)]):
        kw = dict(gate_up_impl=impl, skip_recompute_combine=skip, **exchange_kw)
        serial = _grads(world, rank, mode, **kw)
        overlapped = _grads(world, rank, mode, overlap_weight_grad=True, **kw)
        for a, b in zip(serial, overlapped):
            assert torch.equal(a, b), (impl, mode, skip)


def _check_order_and_failure(rank, world, **kw):
    log = []
    layer = _layer(world, rank, 6, overlap_weight_grad=True, **kw)
    ex = layer.exchange
    real_bwd, real_dw = ex.dispatch_backward, routing.experts_bwd_weight

    def dispatch_backward(*a, **kw):
        pending = real_bwd(*a, **kw)
        log.append("combine started" if kw.get("async_op") else "serial combine")
        real_wait = pending.wait

        def wait():
            log.append("wait")
            return real_wait()
        pending.wait = wait
        return pending

    def dw(*a, **kw):
        log.append("dW")
        return real_dw(*a, **kw)

    ex.dispatch_backward = dispatch_backward
    routing.experts_bwd_weight = dw
    try:
        layer(torch.randn(5, H)).sum().backward()
        assert log == ["combine started", "dW", "wait"], log

        # An exception in the dW GEMMs: the carveout is restored, the combine awaited, and
        # the exception reaches the caller.
        def failing(*a, **kw):
            assert torch._C._get_sm_carveout_experimental() == layer.config.comm_num_sm
            log.append("dW failed")
            raise RuntimeError("injected dW failure")
        routing.experts_bwd_weight = failing
        log.clear()
        before = torch._C._get_sm_carveout_experimental()
        with pytest.raises(RuntimeError, match="injected dW failure"):
            layer(torch.randn(5, H)).sum().backward()
        assert log == ["combine started", "dW failed", "wait"], log
        assert torch._C._get_sm_carveout_experimental() == before
        # The other rank's combine completed: a collective still matches afterwards.
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == world
    finally:
        routing.experts_bwd_weight = real_dw


def _body(rank, world):
    _check_gradients(rank, world)
    _check_order_and_failure(rank, world)
    for impl in ("reference", "fused"):
        _check_gradients_other_exchange(rank, world, comm_backend="symm_mem", impl=impl)
    _check_order_and_failure(rank, world, comm_backend="symm_mem")
    if world in fake_deep_ep.INTRANODE_RANKS:  # DeepEP's own exchange, over its stand-in
        fake_deep_ep.install()
        _check_gradients_other_exchange(rank, world, comm_backend="deepep")
        _check_order_and_failure(rank, world, comm_backend="deepep")


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4, 8])
def test_overlap_matches_serial_and_keeps_order(world):
    run_distributed(_body, world)


def _second_backward_body(rank, world):
    """Through a retained graph a second backward (retain_graph=True twice; autograd.grad
    of the input, as a gradient penalty takes it, then backward) gives with the overlap
    what it gives without."""
    def run(overlap, second):
        layer = _layer(world, rank, 5, overlap_weight_grad=overlap)
        x = torch.randn(7 + rank, H, generator=torch.Generator().manual_seed(rank))
        x.requires_grad_()
        loss = (layer(x) * torch.linspace(-1, 1, H)).sum()
        if second == "twice":
            loss.backward(retain_graph=True)
            loss.backward()
            dx = x.grad
        else:
            (dx,) = torch.autograd.grad(loss, [x], retain_graph=True)
            loss.backward()
            assert torch.equal(x.grad, dx)
        return [dx] + [p.grad for p in layer.parameters()]

    for second in ("twice", "grad then backward"):
        serial, overlapped = run(False, second), run(True, second)
        for a, b in zip(serial, overlapped):
            assert torch.equal(a, b), second


@pytest.mark.multiproc
def test_overlap_under_a_second_backward():
    run_distributed(_second_backward_body, 2)


def test_config_rejects_overlap_without_expert_parallelism():
    with pytest.raises(ValueError, match="ep_size=1"):
        MoEConfig(hidden_size=8, intermediate_size=4, num_experts=4, top_k=2,
                  overlap_weight_grad=True)


def test_slot_misuse_raises():
    slot = WeightGradSlot()
    with pytest.raises(RuntimeError, match="is empty"):
        slot.drain()
    slot.fill(1)
    with pytest.raises(RuntimeError, match="filled twice"):
        slot.fill(2)
    assert slot.drain() == 1
    with pytest.raises(RuntimeError, match="is drained"):
        slot.drain()
    slot.fill(3)  # a second backward through the retained graph fills it again
    assert slot.drain() == 3


def test_sm_carveout_restores_on_exception():
    before = torch._C._get_sm_carveout_experimental()
    with pytest.raises(ValueError), sm_carveout(12):
        assert torch._C._get_sm_carveout_experimental() == 12
        raise ValueError("boom")
    assert torch._C._get_sm_carveout_experimental() == before
