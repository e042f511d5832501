"""GPU-only checks (skipped without CUDA): Triton and grouped-GEMM paths on the device
against float64 oracles, with the tolerance rule "at most twice plain PyTorch's own
low-precision error, plus one bf16 step"."""

from __future__ import annotations

import itertools

import pytest
import torch

from moe_fn import functional
from moe_fn.testing import assert_all_close_to_ref, reference_experts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16_STEP = 2.0 ** -8


def naive_experts(x, gate_up, down, counts, activation, layout):
    return reference_experts(x, gate_up, down, counts, activation=activation, layout=layout)


def _err(a, ref):
    return ((a.double().cpu() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("activation,layout,impl", list(itertools.product(
    ["swiglu", "swiglu_clamped", "swiglu_oai", "geglu_tanh"], ["halves", "interleaved"],
    ["fused", "separate"])))
def test_experts_bf16_on_gpu_against_float64(activation, layout, impl):
    torch.manual_seed(0)
    counts = [64, 0, 200, 8, 120]
    n, h, i, e = sum(counts), 256, 192, len(counts)
    x = torch.randn(n, h)
    gu = torch.randn(e, 2 * i, h) * h ** -0.5 * 2
    dn = torch.randn(e, h, i) * i ** -0.5
    dy = torch.randn(n, h)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    # float64 oracle and its gradients
    leaves64 = [t.double().requires_grad_() for t in (x, gu, dn)]
    ref = naive_experts(*leaves64, counts, activation, layout)
    ref.backward(dy.double())
    # plain PyTorch in bf16 on the GPU: the error budget
    leaves_pt = [t.cuda().bfloat16().requires_grad_() for t in (x, gu, dn)]
    plain = naive_experts(*leaves_pt, counts, activation, layout)
    plain.backward(dy.cuda().bfloat16())
    # moe_fn
    leaves = [t.cuda().bfloat16().requires_grad_() for t in (x, gu, dn)]
    out = functional.experts(*leaves, offs.cuda(), activation=activation, layout=layout,
                             gate_up_impl=impl)
    out.backward(dy.cuda().bfloat16())
    e_out, e_plain = _err(out.detach(), ref.detach()), _err(plain.detach(), ref.detach())
    assert e_out <= 2 * e_plain + BF16_STEP, (e_out, e_plain)
    for name, ours, pt, r in zip(("x", "gate_up", "down"), leaves, leaves_pt, leaves64):
        e_ours, e_pt = _err(ours.grad, r.grad), _err(pt.grad, r.grad)
        assert e_ours <= 2 * e_pt + BF16_STEP, (name, e_ours, e_pt)


@pytest.mark.parametrize("impl", ["fused", "separate"])
def test_expert_bias_gradients_on_gpu_are_segment_sums(impl):
    """GPT-OSS's expert biases on CUDA: every gradient against float64 autograd of the
    naive loop (whose down bias gradient is each expert's rows of dy summed) by the
    tolerance rule, with the loop in float32 on the GPU as plain; an empty expert gets
    zeros, and a second backward gives the same bits (no atomics)."""
    torch.manual_seed(1)
    counts = [40, 0, 96, 8]
    n, h, i, e = sum(counts), 64, 48, len(counts)
    cpu = [torch.randn(n, h), torch.randn(e, 2 * i, h) * h ** -0.5,
           torch.randn(e, h, i) * i ** -0.5, torch.randn(e, 2 * i) * 0.1,
           torch.randn(e, h) * 0.1]
    dy = torch.randn(n, h)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)

    def run(device, dtype, naive=False):
        leaves = [t.to(device, dtype, copy=True).requires_grad_() for t in cpu]
        x, gu, dn, gub, db = leaves
        if naive:  # the reference's per-expert loop
            out = reference_experts(x, gu, dn, counts, activation="swiglu_oai", alpha=1.5,
                                    limit=1.0, layout="interleaved", gate_up_bias=gub,
                                    down_bias=db)
        else:
            out = functional.experts(x, gu, dn, offs.to(device), activation="swiglu_oai",
                                     alpha=1.5, limit=1.0, layout="interleaved",
                                     gate_up_impl=impl, gate_up_bias=gub, down_bias=db)
        out.backward(dy.to(device, dtype))
        return [t.grad.cpu() for t in leaves]

    ref = run("cpu", torch.float64, naive=True)
    plain = run("cuda", torch.float32, naive=True)
    got = run("cuda", torch.float32)
    again = run("cuda", torch.float32)
    want_db = torch.stack([seg.sum(0) for seg in dy.double().split(counts)])
    torch.testing.assert_close(ref[4], want_db)  # the oracle's down bias: the segment sums
    assert_all_close_to_ref(got, plain, ref, ("x", "gate_up", "down", "gate_up_bias",
                                              "down_bias"))
    assert (got[3][1] == 0).all() and (got[4][1] == 0).all()
    assert torch.equal(got[3], again[3]) and torch.equal(got[4], again[4])


def test_empty_expert_weight_gradient_is_zero_on_gpu():
    counts = [16, 0, 32]
    x = torch.randn(48, 64, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(3, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dn = torch.randn(3, 64, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    for _ in range(3):  # reuse of freed memory would expose unwritten outputs
        gu.grad = dn.grad = None
        functional.experts(x, gu, dn, offs).sum().backward()
        assert gu.grad[1].abs().max().item() == 0.0
        assert dn.grad[1].abs().max().item() == 0.0


def test_local_layer_captured_as_cuda_graph_matches_eager():
    import copy

    from moe_fn import MoEConfig, MoELayer
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=256, intermediate_size=128, num_experts=16, top_k=4)
    eager = MoELayer(cfg, device="cuda", dtype=torch.bfloat16)
    graphed = torch.cuda.make_graphed_callables(
        copy.deepcopy(eager),
        (torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True),))
    # Replays see new inputs (and so new routes) in the static buffers each time.
    for _ in range(3):
        x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        outs, grads = [], []
        for fn, params in ((eager, list(eager.parameters())),
                           (graphed, list(graphed.parameters()))):
            for p in params:
                p.grad = None
            x.grad = None
            y = fn(x)
            y.backward(dy)
            outs.append(y.float())
            grads.append([x.grad] + [p.grad for p in params])
        assert torch.equal(outs[0], outs[1])
        # Same kernels; only the order of floating-point atomics may differ (bf16 defaults).
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b)


def _layer_pass(layer, x, dy, wrap=None):
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    out, logits = (wrap or (lambda f, v: f(v)))(lambda v: layer(v, return_router_logits=True), x)
    ((out.float() * dy.float()).sum() + 1e-3 * logits.float().square().sum()).backward()
    return [out, logits, x.grad] + [p.grad for p in layer.parameters()]


def test_fused_router_linear_in_the_layer(monkeypatch):
    """The layer's router linear runs inside the router kernel on CUDA (16-bit, eager): same
    results as F.linear and the separate router kernel, to rounding, and exactly the same
    under checkpointing, whose recompute replays the route through the same kernel."""
    from moe_fn import MoEConfig, MoELayer, checkpoint, kernels
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=256, intermediate_size=128, num_experts=32, top_k=4,
                    norm_topk_prob=True)
    layer = MoELayer(cfg, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    calls = []  # fused launches: whether each replays a route
    real_launch = kernels.launch_router_linear_fwd
    monkeypatch.setattr(kernels, "launch_router_linear_fwd",
                        lambda *a, **kw: calls.append(kw["topk_idx"] is not None)
                        or real_launch(*a, **kw))
    fused = _layer_pass(layer, x, dy)
    assert calls == [False]
    ckpt = _layer_pass(layer, x, dy, wrap=lambda f, v: checkpoint(f, v))
    assert calls == [False, False, True]  # the forward, then its recompute replaying the route
    for a, b in zip(fused, ckpt):
        assert torch.equal(a, b)
    monkeypatch.setattr(kernels, "router_linear_supported", lambda *a, **k: False)
    separate = _layer_pass(layer, x, dy)
    assert len(calls) == 3
    torch.testing.assert_close(fused[1], separate[1], rtol=BF16_STEP, atol=0)  # logits
    for a, b in zip(fused, separate):
        # A routing weight one float32 rounding apart moves bf16 results by a step or two.
        torch.testing.assert_close(a.float(), b.float(), rtol=0,
                                   atol=4 * BF16_STEP * b.abs().max().item())


def test_compiled_block_around_the_layer_matches_eager():
    """torch.compile (inductor) of a block holding a MoELayer on CUDA: the layer runs eagerly
    with its Triton kernels, the norm and residual around it compile; same results."""
    from moe_fn import MoEConfig, MoELayer
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=256, intermediate_size=128, num_experts=32, top_k=4)
    layer = MoELayer(cfg, device="cuda", dtype=torch.bfloat16)
    norm = torch.nn.RMSNorm(256, device="cuda", dtype=torch.bfloat16)

    def block(v):
        return v + layer(norm(v))

    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    torch._dynamo.reset()
    compiled = torch.compile(block)
    runs = []
    for fn in (block, compiled):
        for p in [x, *layer.parameters(), *norm.parameters()]:
            p.grad = None
        y = fn(x)
        y.backward(dy)
        runs.append([y, x.grad, *[p.grad for p in [*layer.parameters(), *norm.parameters()]]])
    for a, b in zip(*runs):
        # The compiled norm rounds in another order: a bf16 step or two, through the layer.
        torch.testing.assert_close(a.float(), b.float(), rtol=0,
                                   atol=4 * BF16_STEP * b.abs().max().item())
