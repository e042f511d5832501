"""MoELayer inside torch.compile: the layer runs eagerly (a graph break at its call), the
code around it compiles, and results match the module with its layer the reference MoE
by the tolerance rule; fullgraph is refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import moe_fn
from moe_fn.testing import assert_all_close_to_ref
from tests.naive import naive_layers

H = 32


class Block(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.moe = moe_fn.MoELayer(moe_fn.MoEConfig(hidden_size=H, intermediate_size=48,
                                                    num_experts=8, top_k=2, **options))

    def forward(self, x):
        return x + self.moe(self.norm(x))


def _step(fn, module, x):
    for p in [x, *module.parameters()]:
        p.grad = None
    y = fn(x)
    y.pow(2).sum().backward()
    return [y.detach(), *[p.grad.clone() for p in [x, *module.parameters()]]]


def _naive(module, x):
    """``_step`` of the eager module with its layer the reference MoE: plain float32
    PyTorch."""
    with naive_layers():
        return _step(module, module, x)


def _step64(module, x):
    """``_naive`` in float64: the oracle. The compiled module's float32 results within twice
    plain float32's error."""
    m64 = copy.deepcopy(module).double()
    with naive_layers():
        return _step(m64, m64, x.detach().double().requires_grad_())


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("options", [{}, {"impl": "reference", "gate_up_impl": "separate"}],
                         ids=["default", "reference"])
def test_compiled_module_matches_eager(backend, options):
    torch.manual_seed(0)
    block = Block(**options)
    x = torch.randn(2, 10, H, requires_grad=True)
    want = _naive(block, x)
    compiled = torch.compile(block, backend=backend)
    got = _step(compiled, block, x)
    assert_all_close_to_ref(got, want, _step64(block, x))
    # Another token count: the layer is not specialised on it.
    x2 = torch.randn(3, 7, H, requires_grad=True)
    assert_all_close_to_ref(_step(compiled, block, x2), _naive(block, x2), _step64(block, x2))


def test_fullgraph_is_refused_naming_the_fix():
    block = Block()
    with pytest.raises(Exception, match="compile without fullgraph=True"):
        torch.compile(block, backend="eager", fullgraph=True)(torch.randn(4, H))


def test_checkpoint_inside_compile_replays_and_skips():
    torch.manual_seed(0)
    block = Block(skip_recompute_combine=True)
    x = torch.randn(2, 10, H, requires_grad=True)
    want = _naive(block, x)
    counters = block.moe.exchange.counters
    counters.clear()
    got = _step(torch.compile(lambda t: moe_fn.checkpoint(block, t), backend="aot_eager"),
                block, x)
    assert_all_close_to_ref(got, want, _step64(block, x))
    assert (counters["layout"], counters["cached_dispatch"], counters["combine"],
            counters["combine_skipped"]) == (1, 1, 1, 1)
