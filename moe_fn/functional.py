"""The public functional API of the expert computation.

Each function is differentiable (first-order: a backward under ``create_graph=True`` raises
``RuntimeError``) and validates every argument before any kernel runs; errors name the
argument and what was expected (``TypeError`` for types and dtypes, ``ValueError`` for
shapes, devices and values). Floating inputs may be float16, bfloat16, float32 or float64;
outputs keep their input's dtype. CUDA tensors run Triton kernels where there is one, CPU
tensors the pure PyTorch reference (``moe_fn.pure``).

Rows are grouped by expert: ``offs (E,)`` int32 holds cumulative row ends
(``torch._grouped_mm``'s convention) and must end at the row count; expert ``e`` owns rows
``offs[e-1]:offs[e]`` (``offs[-1]`` = 0). Its values are checked on CPU, and on CUDA only
with ``moe_fn.set_debug_checks(True)`` (a device-to-host sync).

Activations (``activation=``), each a gated function ``act(g, u)`` of the gate ``g`` and up
``u`` halves, with ``L`` = ``limit`` and ``a`` = ``alpha``:

==================  ================================================  ===================
name                act(g, u)                                         constants (default)
==================  ================================================  ===================
``swiglu``          ``silu(g) * u``                                   none
``swiglu_clamped``  ``silu(min(g, L)) * clamp(u, -L, L)``             ``limit`` (7.0)
``swiglu_oai``      ``(clamp(u, -L, L) + 1) * g' * sigmoid(a * g')``  ``alpha`` (1.702),
                    with ``g' = min(g, L)`` (GPT-OSS, MiniMax-M3)     ``limit`` (7.0)
``geglu_tanh``      ``gelu_tanh(g) * u`` (GELU, tanh approximation)   none
==================  ================================================  ===================

A constant an activation does not use must be None (passing one raises ``ValueError``);
``limit`` must be positive and both must be finite numbers within float32's range. The
math runs in float32 for 16-bit inputs (float64 stays float64). Clamps pass the gradient
where the input lies inside the closed interval, as ``torch.clamp`` does.

Packed gate+up tensors (``layout=``): ``"halves"`` holds the gate in columns ``[:I]`` and
up in ``[I:]`` (Hugging Face's ``gate_up_proj``); ``"interleaved"`` holds the gate in the
even columns and up in the odd ones (GPT-OSS).
"""

from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, check_fp8_call, check_offs, check_same, check_tensor
from .autograd.experts import (
    FP8_IMPL,
    Experts,
    ExpertsFp8,
    GroupedLinear,
    RowWeight,
    Swiglu,
    SwigluPacked,
)
from .autograd.fp8_cache import Fp8WeightCache
from .autograd.slot import WeightGradSlot
from .config import EXPERT_PRECISIONS, GATE_UP_IMPLS
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
    """Per-expert linear map: ``y[rows of e] = x[rows of e] @ weight[e].T`` for every e.

    Args:
        x: ``(N, in)``, rows grouped by expert.
        weight: ``(E, out, in)``, in ``x``'s dtype and on its device (any strides: a
            ``.transpose(1, 2)`` view of an ``(E, in, out)`` parameter is used as it is).
        offs: ``(E,)`` int32 on ``x``'s device, cumulative row ends, ``offs[-1] == N``.

    Returns:
        ``y``, ``(N, out)`` in ``x``'s dtype; an expert without rows contributes nothing.

    Raises:
        TypeError: a tensor argument is not a tensor, ``x``/``weight`` not a floating dtype
            above or not one dtype, ``offs`` not int32.
        ValueError: wrong number of dimensions; ``weight``'s last dimension is not
            ``x.shape[1]``; ``offs`` has not ``E`` entries, is on another device, or (where
            checked) decreases, is negative or does not end at ``N``.
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
    """A gated activation of separate halves: ``h = act(gate, up) [* weights[:, None]]``.

    Args:
        gate: ``(N, I)``.
        up: ``(N, I)``, in ``gate``'s dtype and on its device.
        activation: ``"swiglu"`` (default), ``"swiglu_clamped"``, ``"swiglu_oai"`` or
            ``"geglu_tanh"`` (the table in this module's docstring).
        alpha: ``swiglu_oai``'s sigmoid scale; None for its default 1.702. Other
            activations take None.
        limit: the clamp of ``swiglu_clamped`` and ``swiglu_oai``; None for 7.0. Others
            take None.
        weights: ``(N,)`` per-row routing weights folded into the output (any floating
            dtype, on ``gate``'s device; they get a gradient too), or None.

    Returns:
        ``h``, ``(N, I)`` in ``gate``'s dtype.

    Raises:
        TypeError: a tensor argument is not a tensor or not a floating dtype; ``gate`` and
            ``up`` differ in dtype.
        ValueError: an unknown activation; a constant the activation does not use, or one
            that is not a finite number in float32's range (``limit`` also positive);
            ``gate`` or ``up`` not 2-D, of different shapes or devices; ``weights`` not
            ``(N,)`` or on another device.
    """
    act_id, alpha, limit = resolve_activation(activation, alpha, limit)
    check_swiglu_args(gate, up, weights)
    return Swiglu.apply(gate, up, weights, act_id, alpha, limit)


def swiglu_packed(gate_up, *, activation="swiglu", layout="halves", alpha=None, limit=None,
                  weights=None):
    """A gated activation read in place from packed gate+up rows:
    ``h = act(gate, up) [* weights[:, None]]``, no split or copy made.

    Args:
        gate_up: ``(N, 2I)``, packed per ``layout``.
        activation, alpha, limit, weights: as for ``swiglu``.
        layout: ``"halves"`` (default: gate in columns ``[:I]``, up in ``[I:]``, Hugging
            Face's packing) or ``"interleaved"`` (gate in the even columns, GPT-OSS's).

    Returns:
        ``h``, ``(N, I)`` in ``gate_up``'s dtype. Its gradient with respect to ``gate_up``
        comes back packed in the same layout.

    Raises:
        TypeError: ``gate_up`` or ``weights`` is not a tensor or not a floating dtype.
        ValueError: an unknown activation or layout; a constant as for ``swiglu``;
            ``gate_up`` not 2-D or of odd width; ``weights`` not ``(N,)`` or on another
            device.
    """
    act_id, alpha, limit = resolve_activation(activation, alpha, limit)
    layout_id = resolve_layout(layout)
    check_swiglu_packed_args(gate_up, weights)
    return SwigluPacked.apply(gate_up, weights, act_id, alpha, limit, layout_id)


def row_weight(rows, weights):
    """Scale each row by its weight: ``out = rows * weights[:, None]``.

    The product is computed in float32 for 16-bit rows (float64 stays float64) and rounded
    once to ``rows``' dtype, which is where it differs from ``rows * weights.to(rows.dtype)``.

    Args:
        rows: ``(N, D)``.
        weights: ``(N,)``, any floating dtype, on ``rows``' device.

    Returns:
        ``(N, D)`` in ``rows``' dtype; the gradients reach both inputs.

    Raises:
        TypeError: an argument is not a tensor or not a floating dtype.
        ValueError: ``rows`` not 2-D, ``weights`` not ``(N,)``, or on different devices.
    """
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
            down_bias=None, weight_grad_slot=None, precision="native", fp8_weights=None):
    """The expert MLP on rows grouped by expert:
    ``y = down(act(gate_up(x) [+ gate_up_bias]) [* weights]) [+ down_bias]``, each row
    through its own expert's weights.

    Args:
        x: ``(N, H)``, rows grouped by expert.
        gate_up_proj: ``(E, 2I, H)``, gate and up packed per ``layout`` (Hugging Face's
            ``experts.gate_up_proj``), in ``x``'s dtype and on its device.
        down_proj: ``(E, H, I)``, likewise.
        offs: ``(E,)`` int32 on ``x``'s device, cumulative row ends, ``offs[-1] == N``.
        activation, alpha, limit: the gated activation and its constants (this module's
            docstring); default ``"swiglu"``.
        gate_up_impl: ``"fused"`` (default: one grouped GEMM over the packed weight, then
            the packed activation reading both halves in place) or ``"separate"`` (a GEMM
            per half, then the separate activation).
        layout: ``"halves"`` (default) or ``"interleaved"``: how ``gate_up_proj`` (and
            ``gate_up_bias``) pack gate and up.
        weights: ``(N,)`` per-row routing weights folded into the activation (any
            floating dtype), or None. The down bias is added after them, so they do not
            scale it: to weight the whole expert output, weight the result instead
            (``row_weight``; MoELayer's ``score_apply="post"``).
        gate_up_bias: ``(E, 2I)``, packed as the weight, or None (GPT-OSS has one).
        down_bias: ``(E, H)``, or None.
        weight_grad_slot: a ``moe_fn.autograd.slot.WeightGradSlot`` into which the
            backward defers the weight-gradient GEMMs (and the biases' gradients) instead
            of running them, or None. MoELayer's ``overlap_weight_grad`` uses it; whoever
            passes one must drain it in a later backward.
        precision: ``"native"`` (default: the GEMMs in ``x``'s dtype) or
            ``"fp8_rowwise"``: the gate+up and down GEMMs and their input gradients in
            float8 e4m3 with per-row power-of-two scales, weight gradients in ``x``'s dtype
            (``MoEConfig.expert_precision``; needs ``gate_up_impl="fused"``, H and I
            multiples of 16, on CUDA bfloat16 on compute capability 9.0+, on the CPU
            bfloat16 or float32, emulated).
        fp8_weights: with ``"fp8_rowwise"``, a ``moe_fn.autograd.fp8_cache.Fp8WeightCache``
            that keeps the quantised weights until they change (a MoELayer owns one);
            None quantises them on every call.

    The weights may be views of other storage: GPT-OSS's ``(E, H, 2I)`` / ``(E, I, H)``
    parameters passed as ``.transpose(1, 2)`` are used as they are (no copy), and their
    gradients flow back through the view.

    Returns:
        ``y``, ``(N, H)`` in ``x``'s dtype.

    Raises:
        TypeError: a tensor argument is not a tensor or not a floating dtype; ``x`` and
            the weights (or a bias) differ in dtype; ``offs`` not int32;
            ``weight_grad_slot`` not a ``WeightGradSlot``.
        ValueError: an unknown ``gate_up_impl``, activation or layout; a constant as for
            ``swiglu``; a shape that does not match ``x`` and ``gate_up_proj`` (an odd
            ``2I`` included); tensors on different devices; ``offs`` as for
            ``grouped_linear``.
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
    if precision not in EXPERT_PRECISIONS:
        raise ValueError(f"precision must be one of {EXPERT_PRECISIONS}, got {precision!r}")
    if precision == "fp8_rowwise":
        return _experts_fp8(x, gate_up_proj, down_proj, offs, weights, gate_up_bias, down_bias,
                            act_id, alpha, limit, layout_id, gate_up_impl, weight_grad_slot,
                            fp8_weights)
    if fp8_weights is not None:
        raise ValueError("fp8_weights holds quantised weights for precision='fp8_rowwise'; "
                         "this call computes natively: pass precision='fp8_rowwise', or no "
                         "fp8_weights")
    return Experts.apply(x, gate_up_proj, down_proj, offs, weights, gate_up_bias, down_bias,
                         act_id, alpha, limit, layout_id, gate_up_impl == "fused",
                         weight_grad_slot)


def _experts_fp8(x, gate_up_proj, down_proj, offs, weights, gate_up_bias, down_bias, act_id,
                 alpha, limit, layout_id, gate_up_impl, slot, cache):
    fix = "or precision='native'"
    if gate_up_impl != "fused":
        raise ValueError("precision='fp8_rowwise' computes gate+up as one FP8 GEMM over the "
                         "packed weight: pass gate_up_impl='fused', " + fix)
    h, two_i = x.shape[1], gate_up_proj.shape[1]
    if h % 16 or (two_i // 2) % 16:
        raise ValueError(f"precision='fp8_rowwise' needs H and I multiples of 16 (the FP8 "
                         f"GEMMs' rows are 16-byte aligned), got H={h}, I={two_i // 2}: " + fix)
    if not hasattr(torch, "_scaled_grouped_mm"):
        raise ValueError("precision='fp8_rowwise' needs torch._scaled_grouped_mm: upgrade "
                         "torch, " + fix)
    check_fp8_call(x)
    if cache is not None and not isinstance(cache, Fp8WeightCache):
        raise TypeError(f"fp8_weights must be a moe_fn.autograd.fp8_cache.Fp8WeightCache or "
                        f"None, got {type(cache).__name__}")
    quantized = (cache or Fp8WeightCache()).get(gate_up_proj, down_proj, FP8_IMPL)
    return ExpertsFp8.apply(x, None, gate_up_proj, down_proj, offs, weights, gate_up_bias,
                            down_bias, quantized, act_id, alpha, limit, layout_id, slot)
