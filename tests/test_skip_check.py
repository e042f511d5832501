"""The recompute-combine skip's checked contract (moe_fn.skip_check): every use of a
skipped output whose backward would read its value is refused naming the op and the
fixes; legal blocks train with the gradients of the unchecked model, the forward combine
still skipped in the recompute."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moe_fn
from moe_fn import MoEConfig, MoELayer, SkipContractError

H, I, E, T = 8, 6, 4, 6
DT = torch.float64


class Model(nn.Module):
    """An MoE layer, an input projection and the parameters a block around it uses."""

    def __init__(self, seed=0, **options):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        cfg = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2, **options)
        self.moe = MoELayer(cfg, dtype=DT)
        with torch.no_grad():
            for p in self.moe.parameters():
                p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=DT))
        self.proj = nn.Parameter(torch.eye(H, dtype=DT) + 0.1 * torch.randn(H, H, generator=g,
                                                                          dtype=DT))
        self.gamma = nn.Parameter(torch.randn(H, generator=g, dtype=DT))
        self.w = nn.Parameter(0.3 * torch.randn(H, H, generator=g, dtype=DT))
        self.frozen = nn.Parameter(0.3 * torch.randn(H, H, generator=g, dtype=DT),
                                   requires_grad=False)

    def y(self, h):
        return self.moe(h @ self.proj)


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=DT).requires_grad_()
    mask = (torch.rand(T, 1, generator=g) > 0.3).to(DT)
    return x, mask


# Uses of the MoE output y whose backward reads a value computed from it (or one the check
# cannot trace), each with the op the refusal names.
MISUSES = {
    "relu": (lambda m, h, y, mask: torch.relu(h + y), "ReluBackward0"),
    "leaky_relu": (lambda m, h, y, mask: F.leaky_relu(h + y), "LeakyReluBackward0"),
    "hardtanh": (lambda m, h, y, mask: F.hardtanh(h + y), "HardtanhBackward0"),
    "abs": (lambda m, h, y, mask: (h + y).abs(), "AbsBackward0"),
    "topk_values": (lambda m, h, y, mask: torch.topk(h + y, 3, dim=-1).values, "TopkBackward0"),
    "masked_fill_by_the_sum": (lambda m, h, y, mask: (h + y).masked_fill(h + y > 0, 0.0),
                               "MaskedFillBackward0"),
    "max_pool1d": (lambda m, h, y, mask: F.max_pool1d((h + y)[None], 2)[0],
                   r"MaxPool\w*Backward\d"),
    "amax": (lambda m, h, y, mask: h.sum(-1) + torch.amax(h + y, dim=-1), "AmaxBackward0"),
    "tanh": (lambda m, h, y, mask: torch.tanh(h + y), "TanhBackward0"),
    "layer_norm": (lambda m, h, y, mask: F.layer_norm(h + y, (H,)), "NativeLayerNormBackward0"),
    "h_plus_y_squared": (lambda m, h, y, mask: h + y * y, "MulBackward0"),
    "learned_scale": (lambda m, h, y, mask: h + m.gamma * y, "MulBackward0"),
    "where_by_the_sum": (lambda m, h, y, mask: torch.where(h + y > 0, h + y, 0.0),
                         "WhereBackward0"),
    # Off the gradient's path from y: a mask or a copy of y read by another op's backward.
    "mask_from_y_scales_h": (lambda m, h, y, mask: h + y + h * (h + y > 0), "MulBackward0"),
    "detached_y_scales_h": (lambda m, h, y, mask: h + y + h * y.detach(), "MulBackward0"),
    # A nested reentrant checkpoint saves its input, computed from y.
    "nested_checkpoint": (lambda m, h, y, mask: h + torch.utils.checkpoint.checkpoint(
        torch.tanh, h + y, use_reentrant=True), "CheckpointFunctionBackward"),
}


class _Scale(torch.autograd.Function):
    """A custom Function whose ctx holds a tensor the check cannot see."""

    @staticmethod
    def forward(ctx, x):
        ctx.kept = x.detach()
        return 2 * x

    @staticmethod
    def backward(ctx, g):
        return 2 * g


# Legal blocks the check cannot prove safe: refused with the same error, never computed.
CONSERVATIVE = {
    # CPU dropout multiplies by a mask made inside the checkpoint (GPU's native_dropout,
    # whose mask the check knows to come from the RNG, is allowed).
    "cpu_dropout": (lambda m, h, y, mask: h + F.dropout(y, 0.3, training=True), "MulBackward0"),
    # A mask made inside the checkpoint, even from the input alone.
    "mask_made_inside": (lambda m, h, y, mask: h + y * (h > 0), "MulBackward0"),
    "custom_function": (lambda m, h, y, mask: h + _Scale.apply(y), "_ScaleBackward"),
    # A weight that requires grad but is no parameter (nor an input) read after the layer.
    "loose_leaf": (lambda m, h, y, mask: h + y + torch.tanh(h @ _LOOSE), "TanhBackward0"),
    # A non-reentrant checkpoint nested after the layer packs what its ops save in hooks.
    "nested_non_reentrant": (lambda m, h, y, mask: h + y + torch.utils.checkpoint.checkpoint(
        lambda t: torch.tanh(t @ m.w), h, use_reentrant=False), "saved-tensor hook"),
}
_LOOSE = torch.randn(H, H, dtype=DT, requires_grad=True)


def _refused(fn, op, **options):
    model = Model(skip_recompute_combine=True, **options)
    x, mask = _inputs()
    out = moe_fn.checkpoint(lambda h, k: fn(model, h, model.y(h), k), x, mask)
    with pytest.raises(SkipContractError) as caught:
        out.sum().backward()
    text = str(caught.value)
    for needed in ("skip_recompute_combine=True", op, "one MoE layer per checkpoint region",
                   "skip_recompute_combine=False", "recompute_in_checkpoint=False"):
        assert re.search(needed, text), (needed, text)
    # Refused before anything was backpropagated.
    assert x.grad is None and all(p.grad is None for p in model.parameters())
    return model


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("name", MISUSES)
def test_a_use_whose_backward_reads_the_skipped_output_is_refused(name):
    fn, op = MISUSES[name]
    _refused(fn, op)


@pytest.mark.parametrize("name", CONSERVATIVE)
def test_a_use_the_check_cannot_trace_is_refused(name):
    fn, op = CONSERVATIVE[name]
    _refused(fn, op)


def test_misuse_is_refused_with_post_weighting_folded_and_fused():
    fn, op = MISUSES["tanh"]
    _refused(fn, op, score_apply="post", impl="fused")
    _refused(fn, op, score_apply="post", impl="reference")
    _refused(fn, op, score_apply="activation")


def test_the_in_place_residual_add_is_refused_naming_the_skip():
    model = Model(skip_recompute_combine=True)
    x, _ = _inputs()

    def block(h):
        y = model.y(h)
        y += h
        return y

    out = moe_fn.checkpoint(block, x)
    with pytest.raises(SkipContractError, match=r"(?s)skip_recompute_combine=True.*modified "
                       r"inplace.*`h \+ y`.*skip_recompute_combine=False"):
        out.sum().backward()
    # Without the skip the same block trains (the refusal is the skip's alone).
    plain = Model()
    moe_fn.checkpoint(lambda h: plain.y(h).add_(h), x).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_a_wrapped_framework_checkpoint_is_checked_too():
    ckpt = moe_fn.replay.wrap_checkpoint(torch.utils.checkpoint.checkpoint, use_reentrant=True)
    model = Model(skip_recompute_combine=True)
    x, _ = _inputs()
    out = ckpt(lambda h: torch.relu(h + model.y(h)), x, use_reentrant=True)
    with pytest.raises(SkipContractError, match="ReluBackward0"):
        out.sum().backward()


def _shared(m, h):
    return torch.tanh(h @ m.w) * torch.sigmoid(h @ m.gamma[:, None])


# Blocks whose backward reads nothing computed from y (or only traced values).
LEGAL = {
    "residual_add": lambda m, h, y, mask: h + y,
    "residual_sub": lambda m, h, y, mask: h - y,
    "scaled_by_numbers": lambda m, h, y, mask: h + 0.5 * y + y / 3 - 2 * y,
    "casts": lambda m, h, y, mask: (h.float() + y.float()).to(DT),
    "views": lambda m, h, y, mask: h + y.view(2, T // 2, H).transpose(0, 1).reshape(T, H),
    "cat_and_sum": lambda m, h, y, mask: torch.cat([h + y, y]).sum(0, keepdim=True) + h,
    "masked_by_an_input": lambda m, h, y, mask: h + y * mask,
    "shared_expert_after": lambda m, h, y, mask: h + y + _shared(m, h),
    "frozen_weight_after": lambda m, h, y, mask: h + y + torch.tanh(h @ m.frozen),
    "output_is_the_moe_output": lambda m, h, y, mask: y,
    "native_dropout": lambda m, h, y, mask: h + torch.native_dropout(y, 0.3, True)[0],
    "copied_into_a_buffer": lambda m, h, y, mask: h + h.new_zeros(h.shape).copy_(y),
}


def _grads(model, x):
    return [x.grad] + [p.grad for p in model.parameters() if p.requires_grad]


def _train(fn, ckpt, skip, x, mask, logits_loss=False):
    model = Model(skip_recompute_combine=skip)
    a = x.detach().clone().requires_grad_()

    def block(h, k):
        y, logits = model.moe(h @ model.proj, return_router_logits=True)
        out = fn(model, h, y, k)
        # The router logits feed a later loss: their ops run after the skip, on traced
        # values.
        return (out, F.softmax(logits, -1).pow(2).sum()) if logits_loss else out

    torch.manual_seed(5)  # native_dropout: the checkpoint replays the RNG it saw
    out = moe_fn.checkpoint(block, a, mask) if ckpt else block(a, mask)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.linspace(-1, 1, H, dtype=DT)
    loss = (outs[0] * g).sum() + sum(o.sum() for o in outs[1:])
    loss.backward()
    return outs, _grads(model, a), model.moe.exchange.counters


@pytest.mark.parametrize("logits_loss", [False, True], ids=["out", "out_and_logits_loss"])
@pytest.mark.parametrize("name", LEGAL)
def test_a_legal_block_trains_as_the_unchecked_model_with_the_combine_skipped(name, logits_loss):
    fn = LEGAL[name]
    x, mask = _inputs()
    want_out, want, _ = _train(fn, False, False, x, mask, logits_loss)
    got_out, got, counters = _train(fn, True, True, x, mask, logits_loss)
    for g, w in zip(got_out, want_out):
        torch.testing.assert_close(g, w)
    assert len(got) == len(want) and got[0] is not None
    for g, w in zip(got, want):
        if w is None:  # a parameter the block does not use
            assert g is None
            continue
        assert g is not None and torch.isfinite(g).all()
        torch.testing.assert_close(g, w)
    # One forward combine; the recompute's combine skipped, its backward run.
    assert (counters["combine"], counters["combine_skipped"], counters["combine_backward"],
            counters["cached_dispatch"]) == (1, 1, 1, 1), dict(counters)


@pytest.mark.parametrize("kept_first", [False, True], ids=["skip_then_kept", "kept_then_skip"])
def test_a_kept_layer_beside_a_skipping_one_in_one_region(kept_first):
    """recompute_in_checkpoint=False returns the forward's outputs whatever the recompute
    computed before it, so it may follow a skipped combine in one region."""
    skipping = Model(skip_recompute_combine=True)
    kept = Model(seed=3, recompute_in_checkpoint=False)
    layers = [kept, skipping] if kept_first else [skipping, kept]
    x, _ = _inputs()

    def block(h):
        return h + layers[0].y(h) + layers[1].y(h)

    grads = []
    for ckpt in (False, True):
        for m in layers:
            m.zero_grad()
        a = x.detach().clone().requires_grad_()
        (moe_fn.checkpoint(block, a) if ckpt else block(a)).sum().backward()
        grads.append([a.grad] + [p.grad for m in layers for p in m.parameters()
                                 if p.requires_grad])
    for g, w in zip(*grads):
        torch.testing.assert_close(g, w)
    assert skipping.moe.exchange.counters["combine_skipped"] == 1


@pytest.mark.parametrize("second_skips", [True, False])
@pytest.mark.parametrize("how", ["chained", "detached"])
def test_a_layer_reading_an_earlier_skipped_output_is_refused(how, second_skips):
    """Several layers per region: a second layer whose input comes from the first's
    skipped output (through autograd's graph or a detached copy) is refused at its call,
    whether or not it skips too."""
    first = Model(skip_recompute_combine=True)
    second = Model(seed=3, skip_recompute_combine=second_skips)
    x, _ = _inputs()

    def block(h):
        h = h + first.y(h)
        return h + second.y(h if how == "chained" else h.detach())

    out = moe_fn.checkpoint(block, x)
    with pytest.raises(SkipContractError, match="Checkpoint one MoE layer per region"):
        out.sum().backward()


@pytest.mark.parametrize("misuse", [False, True])
def test_a_frozen_layer_on_an_input_without_grad_skips_a_sentinel_without_history(misuse):
    """A frozen layer whose input requires no grad returns a sentinel without autograd
    history: its uses are still judged (a product with it reads the NaN rows)."""
    model = Model(skip_recompute_combine=True)
    for p in model.moe.parameters():
        p.requires_grad_(False)
    x, c = _inputs()
    c = c.expand(T, H).contiguous()  # the layer's input: requires no grad

    def block(h, k):
        y = model.moe(k)
        return h * y if misuse else h + y

    out = moe_fn.checkpoint(block, x, c)
    if misuse:
        with pytest.raises(SkipContractError, match="MulBackward0"):
            out.sum().backward()
        return
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x))
    assert model.moe.exchange.counters["combine_skipped"] == 1


def test_a_value_read_to_the_host_meets_the_nan_sentinel():
    """A Python number read off the MoE output is outside autograd's graph, so outside the
    check; the sentinel's NaN reaches the gradients instead (the last line of defence)."""
    model = Model(skip_recompute_combine=True)
    x, _ = _inputs()

    def block(h):
        y = model.y(h)
        return h + y * float(y.detach().abs().max())

    moe_fn.checkpoint(block, x).sum().backward()
    assert not torch.isfinite(x.grad).all()


def test_a_compiled_block_inside_the_checkpoint_skips_and_trains():
    """Compiled code after the layer (the residual add, resumed after the layer's graph
    break) saves nothing, so it passes the check and trains as the eager block."""
    torch._dynamo.reset()
    try:
        x, _ = _inputs()
        want_model = Model(skip_recompute_combine=True)
        model = copy.deepcopy(want_model)
        a = x.detach().clone().requires_grad_()
        (a + want_model.y(a)).sum().backward()
        want = _grads(want_model, a)

        compiled = torch.compile(lambda h: h + model.y(h), backend="aot_eager")
        b = x.detach().clone().requires_grad_()
        moe_fn.checkpoint(compiled, b).sum().backward()
        for g, w in zip(_grads(model, b), want):
            torch.testing.assert_close(g, w)
        assert model.moe.exchange.counters["combine_skipped"] == 1
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_dropout_trains_and_a_misuse_is_refused():
    """On CUDA the recompute runs on autograd's device thread and F.dropout is
    native_dropout: a dropout on the MoE branch trains as the unchecked model (float64, the
    checkpoint replaying the RNG), a tanh after the residual add is refused."""
    device = torch.device("cuda")
    x, _ = _inputs()
    x = x.detach().to(device)
    grads, counters = [], None
    for ckpt in (False, True):
        model = Model(skip_recompute_combine=True).to(device)
        a = x.clone().requires_grad_()

        def block(h, model=model):
            return h + F.dropout(model.y(h), 0.3, training=True)

        torch.manual_seed(7)
        out = moe_fn.checkpoint(block, a) if ckpt else block(a)
        (out * torch.linspace(-1, 1, H, dtype=DT, device=device)).sum().backward()
        grads.append(_grads(model, a))
        counters = model.moe.exchange.counters
    for g, w in zip(*grads):
        if w is None:
            assert g is None
            continue
        torch.testing.assert_close(g, w)
    assert counters["combine_skipped"] == 1
    model = Model(skip_recompute_combine=True).to(device)
    a = x.clone().requires_grad_()
    out = moe_fn.checkpoint(lambda h: torch.tanh(h + model.y(h)), a)
    with pytest.raises(SkipContractError, match="TanhBackward0"):
        out.sum().backward()
