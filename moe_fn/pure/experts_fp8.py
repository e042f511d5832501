"""The expert MLP in FP8: the gate+up and down GEMMs forward and the input-gradient GEMMs
backward on e4m3 operands with per-row scales (``moe_fn.pure.fp8``), the weight gradients in
the rows' own dtype from the exactly dequantised operands.

Forward: ``gate_up = grouped(x_q, Wgu_q)`` (x quantised per row, ``Wgu (E, 2I, H)`` per output
channel), the packed activation writing ``h`` quantised per row, ``y = grouped(h_q, Wd_q)``.
Backward: ``dy`` quantised per row; ``dh = grouped(dy_q, Wd^T_q)`` (``Wd^T (E, I, H)``
quantised over H); the activation's backward writing ``d_gate_up`` and its quantisation;
``dx = grouped(d_gate_up_q, Wgu^T_q)`` (``Wgu^T (E, H, 2I)`` quantised over 2I); ``dWgu =
d_gate_up^T x`` and ``dWd = dy^T h`` per expert in the rows' dtype, with ``x`` and ``h``
dequantised (exact), so the weight gradient is that of the function the forward computed.

Weight gradients stay in the rows' dtype: on an H200 at 65,536 rows over 128 experts an FP8
``dW`` is no faster for down and saves less on gate+up than the two transposed per-expert
quantisations it needs would cost (bench/RESULTS.md). ``impl`` is any namespace with
``quantize_rows``, ``quantize_rows_t``, ``dequantize_rows``, ``swiglu_packed_fwd_fp8`` and
``swiglu_packed_bwd_fp8`` of the pure signatures (``moe_fn.kernels`` for the shells); by
default the pure ones.
"""

from __future__ import annotations

import types
from typing import Any, NamedTuple

import torch

from .activations import SwigluPackedRes
from .experts import _row_bias_sum, expert_of_row
from .fp8 import (
    Fp8Rows,
    dequantize_rows,
    grouped_mm_fp8,
    quantize_rows,
    quantize_rows_packed,
    quantize_rows_t,
    swiglu_packed_bwd_fp8,
    swiglu_packed_fwd_fp8,
)
from .grouped import grouped_linear_dw


class Fp8ExpertWeights(NamedTuple):
    """The expert weights as the FP8 GEMMs read them, each an ``Fp8Rows`` over its last
    dimension: ``gate_up (E, 2I, H)`` (forward), ``gate_up_t (E, H, 2I)`` (dx), ``down (E,
    H, I)`` (forward), ``down_t (E, I, H)`` (dh)."""

    gate_up: Fp8Rows
    gate_up_t: Fp8Rows
    down: Fp8Rows
    down_t: Fp8Rows


def quantize_expert_weights(gate_up_proj, down_proj, impl=None) -> Fp8ExpertWeights:
    """The four quantised layouts of ``gate_up_proj (E, 2I, H)`` and ``down_proj (E, H,
    I)``, each per output channel (row over its last dimension): as they are by
    ``impl.quantize_rows``, transposed by ``impl.quantize_rows_t`` (no transposed copy)."""
    impl = PURE if impl is None else impl

    def quantize(w):
        e, n, k = w.shape
        rows = impl.quantize_rows(w.reshape(e * n, k))
        return Fp8Rows(rows.q.reshape(e, n, k), rows.scale.reshape(e, n))

    gu, dn = gate_up_proj.detach(), down_proj.detach()
    return Fp8ExpertWeights(quantize(gu.contiguous()), impl.quantize_rows_t(gu),
                            quantize(dn.contiguous()), impl.quantize_rows_t(dn))


PURE = types.SimpleNamespace(quantize_rows=quantize_rows, quantize_rows_t=quantize_rows_t,
                             dequantize_rows=dequantize_rows,
                             quantize_rows_packed=quantize_rows_packed,
                             swiglu_packed_fwd_fp8=swiglu_packed_fwd_fp8,
                             swiglu_packed_bwd_fp8=swiglu_packed_bwd_fp8)


class ExpertsFp8Res(NamedTuple):
    x: Fp8Rows  # (N, H) quantised input rows
    w: Fp8ExpertWeights
    offs: torch.Tensor  # (E,) int32
    gate_up: torch.Tensor  # (N, 2I) pre-activation (bias added), the rows' dtype
    h: Fp8Rows  # (N, I) quantised activation output (weights folded in)
    weights: torch.Tensor | None  # (N,) routing weight folded into the activation
    act_id: int
    alpha: float
    limit: float
    layout_id: int
    dtype: torch.dtype  # the rows' dtype: GEMM outputs and gradients
    impl: Any
    has_gate_up_bias: bool = False
    has_down_bias: bool = False


class ExpertsFp8WgradWork(NamedTuple):
    """What the FP8 path's weight gradients need."""

    x: Fp8Rows
    h: Fp8Rows
    dy: torch.Tensor  # (N, H) contiguous, the rows' dtype
    d_gate_up: torch.Tensor  # (N, 2I)
    offs: torch.Tensor
    dtype: torch.dtype
    impl: Any
    has_gate_up_bias: bool = False
    has_down_bias: bool = False


def experts_fp8_fwd(x: Fp8Rows, w: Fp8ExpertWeights, offs, weights=None, gate_up_bias=None,
                    down_bias=None, *, act_id: int, alpha: float, limit: float, layout_id: int,
                    dtype: torch.dtype, impl=None):
    """``y (N, H)`` in ``dtype`` and the residual for ``experts_fp8_bwd*``."""
    impl = PURE if impl is None else impl
    eid = None
    if gate_up_bias is not None or down_bias is not None:
        eid = expert_of_row(offs, x.q.shape[0])
    gate_up = grouped_mm_fp8(x, w.gate_up, offs, dtype)
    if gate_up_bias is not None:  # in place into the fresh GEMM output
        gate_up = gate_up.add_(gate_up_bias.index_select(0, eid).to(dtype))
    h, _ = impl.swiglu_packed_fwd_fp8(gate_up, weights, act_id=act_id, alpha=alpha,
                                      limit=limit, layout_id=layout_id)
    y = grouped_mm_fp8(h, w.down, offs, dtype)
    if down_bias is not None:
        y = y + down_bias.index_select(0, eid).to(dtype)
    res = ExpertsFp8Res(x, w, offs, gate_up, h, weights, act_id, alpha, limit, layout_id,
                        dtype, impl, gate_up_bias is not None, down_bias is not None)
    return y, res


# dh = dy @ D_e (dy, D quantised);  (d[g u], dw) = act'(g, u, w) * dh;  dx = d[g u] @ W_e.
def experts_fp8_bwd_input(res: ExpertsFp8Res, dy, *, needs_x: bool = True,
                          needs_weights: bool = True):
    """Returns ``(dx (N, H) or None, d_weights (N,) or None, ExpertsFp8WgradWork)``."""
    impl = res.impl
    dy = dy.contiguous().to(res.dtype)
    dh = grouped_mm_fp8(impl.quantize_rows(dy), res.w.down_t, res.offs, res.dtype)
    needs_w = needs_weights and res.weights is not None
    ares = SwigluPackedRes(res.gate_up, res.weights, res.act_id, res.alpha, res.limit,
                           res.layout_id)
    d_gate_up, d_gate_up_q, d_weights = impl.swiglu_packed_bwd_fp8(ares, dh,
                                                                   needs=(True, needs_w))
    dx = grouped_mm_fp8(d_gate_up_q, res.w.gate_up_t, res.offs, res.dtype) if needs_x else None
    work = ExpertsFp8WgradWork(res.x, res.h, dy, d_gate_up, res.offs, res.dtype, impl,
                               res.has_gate_up_bias, res.has_down_bias)
    return dx, (d_weights if needs_w else None), work


# dWgu_e = d[g u]_e^T @ x_e;  dD_e = dy_e^T @ h_e (x, h dequantised: exact);  bias sums.
def experts_fp8_bwd_weight(work: ExpertsFp8WgradWork, *, needs=(True, True, True, True)):
    """Returns ``(d_gate_up_proj (E, 2I, H), d_down_proj (E, H, I), d_gate_up_bias (E, 2I),
    d_down_bias (E, H))`` in the rows' dtype; None where not wanted or absent."""
    d_gup = d_down = d_gub = d_db = None
    if needs[0]:
        d_gup = grouped_linear_dw(work.impl.dequantize_rows(work.x, work.dtype),
                                  work.d_gate_up, work.offs)
    if needs[1]:
        d_down = grouped_linear_dw(work.impl.dequantize_rows(work.h, work.dtype), work.dy,
                                   work.offs)
    if needs[2] and work.has_gate_up_bias:
        d_gub = _row_bias_sum(work.offs, work.d_gate_up)
    if needs[3] and work.has_down_bias:
        d_db = _row_bias_sum(work.offs, work.dy)
    return d_gup, d_down, d_gub, d_db


def experts_fp8_bwd(res: ExpertsFp8Res, dy, *, needs=(True, True, True, True, True, True)):
    """Returns ``(dx, d_gate_up_proj, d_down_proj, d_weights, d_gate_up_bias,
    d_down_bias)``; ``needs`` follows that order."""
    dx, d_weights, work = experts_fp8_bwd_input(res, dy, needs_x=needs[0],
                                                needs_weights=needs[3])
    d_gup, d_down, d_gub, d_db = experts_fp8_bwd_weight(
        work, needs=(needs[1], needs[2], needs[4], needs[5]))
    return dx, d_gup, d_down, d_weights, d_gub, d_db
