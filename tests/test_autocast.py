"""MoELayer under torch.autocast: it runs as the same layer in autocast's dtype, with
float32 gradients reaching its float32 parameters (CPU autocast; CUDA's takes the same
path)."""

from __future__ import annotations

import copy

import pytest
import torch

import moe_fn
from moe_fn import MoEConfig, MoELayer
from tests.dist_utils import run_distributed

CONFIGS = [
    dict(),
    dict(gate_up_impl="separate", impl="reference"),
    dict(score_apply="activation", activation="swiglu_oai", gate_up_layout="interleaved"),
    dict(router_bias=True, expert_bias=True, score_func="softmax_topk", norm_topk_prob=False),
    dict(score_func="sigmoid", score_correction_bias=True, n_group=2, topk_group=1),
]


def _layer(kw, seed=0, **extra):
    torch.manual_seed(seed)
    layer = MoELayer(MoEConfig(hidden_size=16, intermediate_size=8, num_experts=4, top_k=2,
                               **kw, **extra))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    return layer


def _lowered(layer, dtype):
    """The same layer held in ``dtype`` (the buffers, choice-only, stay as they are)."""
    low = copy.deepcopy(layer)
    for p in low.parameters():
        p.data = p.data.to(dtype)
    return low


def _grads(layer, x):
    return [x.grad] + [p.grad for p in layer.parameters()]


def _run(layer, x, g, autocast_dtype=None, fn=None):
    x = x.detach().clone().requires_grad_()
    call = fn or (lambda m, a: m(a, return_router_logits=True))
    if autocast_dtype is None:
        out, logits = call(layer, x)
    else:
        with torch.autocast("cpu", dtype=autocast_dtype):
            out, logits = call(layer, x)
    (out.float() * g).sum().backward()
    return out, logits, _grads(layer, x)


def _assert_same_as_lowered(layer, x, g, dtype, fn=None):
    low = _lowered(layer, dtype)
    out, logits, grads = _run(layer, x, g, dtype, fn)
    want_out, want_logits, want_grads = _run(low, x.to(dtype), g, None, fn)
    assert out.dtype == dtype and logits.dtype == dtype
    assert torch.equal(out, want_out) and torch.equal(logits, want_logits)
    for got, want, p in zip(grads, want_grads, [x, *layer.parameters()]):
        assert got.dtype == p.dtype == torch.float32  # float32 gradients, float32 params
        assert torch.equal(got, want.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kw", CONFIGS)
def test_autocast_runs_the_layer_in_its_dtype(kw, dtype):
    layer = _layer(kw)
    x = torch.randn(2, 5, 16)
    g = torch.randn(2, 5, 16)
    _assert_same_as_lowered(layer, x, g, dtype)
    assert layer._autocast_to is None  # only for the call


def test_autocast_inside_a_checkpoint_with_replay_and_skip():
    """The recompute re-enters the autocast of the forward: the same replayed route, the
    combine skipped, and the gradients of the layer in bfloat16."""
    layer = _layer({}, skip_recompute_combine=True)
    x, g = torch.randn(6, 16), torch.randn(6, 16)

    def fn(m, a):
        # The block's output is the combine's (whose recomputed value nothing reads): one
        # path from x, so x's gradient is one bfloat16 gradient cast, as in the lowered run.
        return moe_fn.checkpoint(lambda t: m(t, return_router_logits=True), a)

    _assert_same_as_lowered(layer, x, g, torch.bfloat16, fn)
    assert layer.exchange.counters["combine_skipped"] == 1


def test_autocast_leaves_other_dtypes_and_devices_alone():
    layer = _layer({})
    x = torch.randn(5, 16)
    want = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert torch.equal(layer(x), want)
    with torch.autocast("cuda", dtype=torch.bfloat16):  # another device type's autocast
        assert torch.equal(layer(x), want)
    layer64 = _lowered(layer, torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast lowers float32 only
        out = layer64(x.double())
    assert out.dtype == torch.float64 and torch.equal(out, layer64(x.double()))
    # A layer already in autocast's dtype: autocast changes nothing.
    low = _lowered(layer, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(low(x.bfloat16()), _lowered(layer, torch.bfloat16)(x.bfloat16()))


def test_autocast_takes_an_input_already_lowered_and_parameters_some_lowered():
    """Under autocast the layer's input may come straight from a lowered op (bf16) and
    some parameters may already be bf16 (FSDP2's param_dtype casts the router it shards,
    not the experts it ignores): the layer still runs as its bf16 copy."""
    layer = _layer({})
    x, g = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    lowered_input = lambda m, a: m(a.bfloat16(), return_router_logits=True)  # noqa: E731
    _assert_same_as_lowered(layer, x, g, torch.bfloat16, lowered_input)
    with torch.no_grad():
        layer.router.weight.data = layer.router.weight.data.bfloat16()
    want = _lowered(layer, torch.bfloat16)(x.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(layer(x.bfloat16()), want)
        assert torch.equal(layer(x), want)
    # Without autocast the mixture is refused, and the error names the way out.
    with pytest.raises(TypeError, match="run the forward under torch.autocast"):
        layer(x.bfloat16())
    # Under bf16 autocast a float16 input is one autocast leaves alone: the fix is x's dtype.
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            TypeError, match=r"under torch.autocast\(torch.bfloat16\) x is torch.float16 but "
                             r".*pass x in float32 or torch.bfloat16"):
        layer(x.half())
    # Under bf16 autocast a float16 parameter is neither float32 nor bf16.
    layer.experts.down_proj.data = layer.experts.down_proj.data.half()
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            TypeError, match=r"experts.down_proj is torch.float16: the layer's parameters "
                             r"must be float32 or torch.bfloat16"):
        layer(x)


def _ep_body(rank, world):
    for kw in (dict(), dict(comm_backend="symm_mem"), dict(overlap_weight_grad=True)):
        torch.manual_seed(0)
        full = _layer({})
        layer = _layer({}, **{"comm_backend": "all_to_all", "ep_size": world, **kw})
        e = full.config.num_experts // world
        with torch.no_grad():
            layer.router.weight.copy_(full.router.weight)
            layer.experts.gate_up_proj.copy_(full.experts.gate_up_proj[rank * e:(rank + 1) * e])
            layer.experts.down_proj.copy_(full.experts.down_proj[rank * e:(rank + 1) * e])
        gen = torch.Generator().manual_seed(10 + rank)
        x, g = torch.randn(3 + 2 * rank, 16, generator=gen), torch.randn(3 + 2 * rank, 16,
                                                                        generator=gen)
        _assert_same_as_lowered(layer, x, g, torch.bfloat16)


@pytest.mark.multiproc
def test_autocast_over_expert_parallelism():
    run_distributed(_ep_body, 2)
