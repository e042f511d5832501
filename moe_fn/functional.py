"""The public functional API of the expert computation.

Every argument is validated before any kernel runs; errors name the argument and what
was expected. Rows are grouped by expert: ``offs (E,)`` int32 holds cumulative row ends
(``torch._grouped_mm``'s convention) and must end at the row count.
"""

from __future__ import annotations

from ._checks import FLOAT_DTYPES, check_offs, check_same, check_tensor
from .autograd.experts import Experts, GroupedLinear, RowWeight, Swiglu, SwigluPacked
from .autograd.slot import WeightGradSlot
from .config import GATE_UP_IMPLS
from .pure.activations import (
    _check_weights,
    check_swiglu_args,
    check_swiglu_packed_args,
    resolve_activation,
    resolve_layout,
)
from .pure.row_weight import check_row_weight_args

__all__ = ["experts", "grouped_linear", "row_weight", "swiglu", "swiglu_packed"]


def grouped_linear(x, weight, offs):
    """Per-expert linear: ``y[rows of e] = x[rows of e] @ weight[e]^T``.

    x ``(N, in)``, weight ``(E, out, in)``, offs ``(E,)`` int32 ending at N -> y ``(N, out)``.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=3, dtypes=FLOAT_DTYPES)
    if weight.shape[2] != x.shape[1]:
        raise ValueError(
            f"weight must be (E, out, in) with in == x.shape[1] ({x.shape[1]}), "
            f"got shape {tuple(weight.shape)}"
        )
    check_same("x and weight", x, weight)
    check_offs(offs, x.shape[0], weight.shape[0], x.device)
    return GroupedLinear.apply(x, weight, offs)


def swiglu(gate, up, *, activation="swiglu", alpha=None, limit=None, weights=None):
    """``h = act(gate, up) [* weights[:, None]]``; gate, up ``(N, I)``, weights ``(N,)``.

    activation: "swiglu", "swiglu_clamped", "swiglu_oai" or "geglu_tanh".
    """
    act_id, alpha, limit = resolve_activation(activation, alpha, limit)
    check_swiglu_args(gate, up, weights)
    return Swiglu.apply(gate, up, weights, act_id, alpha, limit)


def swiglu_packed(gate_up, *, activation="swiglu", layout="halves", alpha=None, limit=None,
                  weights=None):
    """``h (N, I) = act(gate, up) [* weights]`` read in place from ``gate_up (N, 2I)``.

    layout: "halves" (gate = columns [:I], HF) or "interleaved" (gate = even columns).
    """
    act_id, alpha, limit = resolve_activation(activation, alpha, limit)
    layout_id = resolve_layout(layout)
    check_swiglu_packed_args(gate_up, weights)
    return SwigluPacked.apply(gate_up, weights, act_id, alpha, limit, layout_id)


def row_weight(rows, weights):
    """``rows (N, D) * weights (N,)[:, None]``."""
    check_row_weight_args(rows, weights)
    return RowWeight.apply(rows, weights)


def _check_experts_args(x, gate_up_proj, down_proj, weights, gate_up_bias=None,
                        down_bias=None):
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("gate_up_proj", gate_up_proj, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("down_proj", down_proj, ndim=3, dtypes=FLOAT_DTYPES)
    n, h = x.shape
    e, two_i, h_w = gate_up_proj.shape
    if h_w != h:
        raise ValueError(
            f"gate_up_proj must be (E, 2I, H) with H == x.shape[1] ({h}), "
            f"got shape {tuple(gate_up_proj.shape)}"
        )
    if two_i % 2:
        raise ValueError(
            f"gate_up_proj must have an even packed width 2I (gate and up), got {two_i}"
        )
    if tuple(down_proj.shape) != (e, h, two_i // 2):
        raise ValueError(
            f"down_proj must be (E, H, I) = {(e, h, two_i // 2)} to match x and gate_up_proj, "
            f"got {tuple(down_proj.shape)}"
        )
    check_same("x, gate_up_proj and down_proj", x, gate_up_proj, down_proj)
    _check_weights(weights, n, x)
    for name, bias, shape in (("gate_up_bias", gate_up_bias, (e, two_i)),
                              ("down_bias", down_bias, (e, h))):
        if bias is None:
            continue
        check_tensor(name, bias, ndim=2, dtypes=FLOAT_DTYPES)
        if tuple(bias.shape) != shape:
            raise ValueError(f"{name} must be {shape} to match gate_up_proj "
                             f"{tuple(gate_up_proj.shape)}, got {tuple(bias.shape)}")
        check_same(f"x and {name}", x, bias)


def experts(x, gate_up_proj, down_proj, offs, *, activation="swiglu", gate_up_impl="fused",
            layout="halves", alpha=None, limit=None, weights=None, gate_up_bias=None,
            down_bias=None, weight_grad_slot=None):
    """The expert MLP ``y = down(act(gate_up(x) [+ gate_up_bias]) [* weights]) [+ down_bias]``,
    rows grouped by expert.

    x ``(N, H)``, gate_up_proj ``(E, 2I, H)`` packed per ``layout``, down_proj
    ``(E, H, I)``, offs ``(E,)`` int32 ending at N, weights ``(N,)`` or None -> ``(N, H)``.
    The weights may be views of other storage: GPT-OSS's ``(E, H, 2I)`` / ``(E, I, H)``
    parameters passed as ``.transpose(1, 2)`` are used as they are (no copy) and their
    gradients flow back through the view.
    gate_up_bias ``(E, 2I)`` (packed as the weight) and down_bias ``(E, H)``: per-expert
    biases (GPT-OSS) or None; the down bias is added after the down projection, so
    ``weights`` (folded into the activation) do not scale it — to weight the whole expert
    output, weight the result (MoELayer's score_apply="post").
    gate_up_impl: "fused" (one GEMM over the packed weight, packed activation) or
    "separate" (two GEMMs over its halves). weight_grad_slot: a
    ``moe_fn.autograd.slot.WeightGradSlot`` to defer the weight-gradient GEMMs (and the
    biases' gradients) into (MoELayer's overlap_weight_grad; whoever passes one must drain it
    in its backward).
    """
    if gate_up_impl not in GATE_UP_IMPLS:
        raise ValueError(f"gate_up_impl must be one of {GATE_UP_IMPLS}, got {gate_up_impl!r}")
    act_id, alpha, limit = resolve_activation(activation, alpha, limit)
    layout_id = resolve_layout(layout)
    _check_experts_args(x, gate_up_proj, down_proj, weights, gate_up_bias, down_bias)
    check_offs(offs, x.shape[0], gate_up_proj.shape[0], x.device)
    if weight_grad_slot is not None and not isinstance(weight_grad_slot, WeightGradSlot):
        raise TypeError(f"weight_grad_slot must be a moe_fn.autograd.slot.WeightGradSlot or "
                        f"None, got {type(weight_grad_slot).__name__}")
    return Experts.apply(x, gate_up_proj, down_proj, offs, weights, gate_up_bias, down_bias,
                         act_id, alpha, limit, layout_id, gate_up_impl == "fused",
                         weight_grad_slot)
