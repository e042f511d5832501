"""The expert MLP: ``y = down(act(gate_up(x) [+ b_gu]) [* weights]) [+ b_down]`` per expert.

x ``(N, H)`` with rows grouped by expert (``offs (E,)`` int32 cumulative ends),
``gate_up_proj (E, 2I, H)``, ``down_proj (E, H, I)``, optional routing weight
``weights (N,)`` folded into the activation, optional biases ``gate_up_bias (E, 2I)`` (in
the packed weight's layout) and ``down_bias (E, H)`` (GPT-OSS). ``fused`` picks one GEMM
over the packed weight plus the packed activation; otherwise two GEMMs over its halves plus
the separate one. A bias is added to the rows of its expert, found from ``offs`` on the
device (``expert_of_row``, no host sync); ``down_bias`` is not scaled by ``weights``.

The backward is split in two so the weight gradients can be deferred:
``experts_bwd_input`` returns dX (and the routing-weight gradient) at once plus an
``ExpertsWgradWork`` holding exactly what the weight gradients need, and
``experts_bwd_weight(work)`` runs the dW GEMMs (and the bias gradients, sums over each
expert's rows) whenever the caller chooses.

``act_impl`` is any object with ``swiglu_fwd``, ``swiglu_bwd``, ``swiglu_packed_fwd`` and
``swiglu_packed_bwd`` of the pure signatures (``moe_fn.kernels`` for the shells); it
defaults to ``pure.activations`` and is kept in ``res`` as a static field.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import activations as _pure_act
from .activations import SwigluPackedRes, SwigluRes, split_packed
from .gate_up import (
    gate_up_fused_fwd,
    gate_up_separate_dw,
    gate_up_separate_dx,
    gate_up_separate_fwd,
)
from .grouped import grouped_linear_dw, grouped_linear_dx, grouped_linear_fwd


class ExpertsRes(NamedTuple):
    x: torch.Tensor  # (N, H)
    gate_up_proj: torch.Tensor  # (E, 2I, H)
    down_proj: torch.Tensor  # (E, H, I)
    offs: torch.Tensor  # (E,) int32
    gate_up: torch.Tensor | None  # (N, 2I) pre-activation, packed (fused path)
    gate: torch.Tensor | None  # (N, I) pre-activation gate (separate path)
    up: torch.Tensor | None  # (N, I) pre-activation up (separate path)
    h: torch.Tensor  # (N, I) activation output (weights folded in): input of down
    weights: torch.Tensor | None  # (N,) routing weight or None
    act_id: int
    alpha: float
    limit: float
    layout_id: int
    fused: bool
    act_impl: Any  # static: the activation implementation (module or namespace)
    has_gate_up_bias: bool = False  # a (E, 2I) bias was added after gate+up
    has_down_bias: bool = False  # a (E, H) bias was added after down


class ExpertsWgradWork(NamedTuple):
    """What the weight gradients need, and nothing else."""

    x: torch.Tensor  # (N, H)
    h: torch.Tensor  # (N, I)
    dy: torch.Tensor  # (N, H), contiguous
    d_gate_up: torch.Tensor | None  # (N, 2I) packed pre-activation gradient (fused)
    d_gate: torch.Tensor | None  # (N, I) (separate)
    d_up: torch.Tensor | None  # (N, I) (separate)
    offs: torch.Tensor
    layout_id: int
    fused: bool
    has_gate_up_bias: bool = False
    has_down_bias: bool = False


def expert_of_row(offs: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``(N,)`` int64: the expert owning each row (rows past ``offs[-1]`` get ``E``), computed
    on the device from the cumulative ends, no host sync."""
    rows = torch.arange(num_rows, dtype=offs.dtype, device=offs.device)
    return torch.searchsorted(offs, rows, right=True)


def _row_bias_sum(offs, *d_rows, layout_id: int = 0):
    """``(E, D)``: the expert-sorted rows of ``d_rows (N, D)`` summed per expert, as the
    weight gradient of a grouped linear layer whose input is all ones (a grouped GEMM with
    no atomics, so the same bits every run, and, where ``torch._grouped_mm`` takes it, no
    host sync and float32 accumulation for bfloat16). Two
    ``(N, I)`` tensors (gate, up) are summed into the halves of one ``(E, 2I)`` in the
    packing ``layout_id``."""
    first = d_rows[0]
    # Eight columns of ones keep the GEMM operand 16-byte aligned; the first is the sum.
    ones = first.new_ones((first.shape[0], 8))
    sums = [grouped_linear_dw(ones, d, offs)[..., 0] for d in d_rows]
    if len(sums) == 1:
        return sums[0].contiguous()
    acc = first.new_empty(offs.shape[0], sum(d.shape[1] for d in d_rows))
    for part, total in zip(split_packed(acc, layout_id), sums):
        part.copy_(total)
    return acc


def experts_fwd(x, gate_up_proj, down_proj, offs, weights=None, gate_up_bias=None,
                down_bias=None, *, act_id: int, alpha: float, limit: float, layout_id: int,
                fused: bool, act_impl=None):
    """``y (N, H)`` and the residual for ``experts_bwd*``."""
    impl = _pure_act if act_impl is None else act_impl
    gate_up = gate = up = None
    eid = None
    if gate_up_bias is not None or down_bias is not None:
        eid = expert_of_row(offs, x.shape[0])
    # The gate+up bias is added in place into a fresh GEMM output (never into an input).
    if fused:
        gate_up, _ = gate_up_fused_fwd(x, gate_up_proj, offs, layout_id=layout_id)
        if gate_up_bias is not None:
            gate_up = gate_up.add_(gate_up_bias.index_select(0, eid))
        h, _ = impl.swiglu_packed_fwd(gate_up, weights, act_id=act_id, alpha=alpha,
                                      limit=limit, layout_id=layout_id)
    else:
        (gate, up), _ = gate_up_separate_fwd(x, gate_up_proj, offs, layout_id=layout_id)
        if gate_up_bias is not None:
            b_gate, b_up = split_packed(gate_up_bias, layout_id)
            gate = gate.add_(b_gate.index_select(0, eid))
            up = up.add_(b_up.index_select(0, eid))
        h, _ = impl.swiglu_fwd(gate, up, weights, act_id=act_id, alpha=alpha, limit=limit)
    y, _ = grouped_linear_fwd(h, down_proj, offs)
    if down_bias is not None:
        # Out of place: y is what the experts' autograd.Function returns, and under
        # torch.compile torch 2.11 (2.13 no longer) differentiates a Function whose output
        # its forward wrote in place wrongly (every gradient off). Same bytes moved.
        y = y + down_bias.index_select(0, eid)
    res = ExpertsRes(x, gate_up_proj, down_proj, offs, gate_up, gate, up, h, weights, act_id,
                     alpha, limit, layout_id, bool(fused), act_impl, gate_up_bias is not None,
                     down_bias is not None)
    return y, res


# dh = dy @ D_e;  (dg, du, dw) = act'(g, u, w) * dh;  dx = [dg du] @ W_e (one GEMM when fused).
def experts_bwd_input(res: ExpertsRes, dy, *, needs_x: bool = True, needs_weights: bool = True):
    """Returns ``(dx (N, H) or None, d_weights (N,) or None, ExpertsWgradWork)``."""
    impl = _pure_act if res.act_impl is None else res.act_impl
    dy = dy.contiguous()
    dh = grouped_linear_dx(dy, res.down_proj, res.offs)
    needs_w = needs_weights and res.weights is not None
    dx = d_gate_up = d_gate = d_up = None
    if res.fused:
        ares = SwigluPackedRes(res.gate_up, res.weights, res.act_id, res.alpha, res.limit,
                               res.layout_id)
        d_gate_up, d_weights = impl.swiglu_packed_bwd(ares, dh, needs=(True, needs_w))
        d_gate_up = d_gate_up.contiguous()
        if needs_x:
            dx = grouped_linear_dx(d_gate_up, res.gate_up_proj, res.offs)
    else:
        ares = SwigluRes(res.gate, res.up, res.weights, res.act_id, res.alpha, res.limit)
        d_gate, d_up, d_weights = impl.swiglu_bwd(ares, dh, needs=(True, True, needs_w))
        d_gate, d_up = d_gate.contiguous(), d_up.contiguous()
        if needs_x:
            dx = gate_up_separate_dx(d_gate, d_up, res.gate_up_proj, res.offs,
                                     layout_id=res.layout_id)
    if not needs_w:
        d_weights = None
    work = ExpertsWgradWork(res.x, res.h, dy, d_gate_up, d_gate, d_up, res.offs, res.layout_id,
                            res.fused, res.has_gate_up_bias, res.has_down_bias)
    return dx, d_weights, work


# dW_gate_up_e = d[g u]_e^T @ x_e (packed as the weight);  dD_e = dy_e^T @ h_e;
# d b_gu_e = sum over rows of e of d[g u];  d b_down_e = sum over rows of e of dy.
def experts_bwd_weight(work: ExpertsWgradWork, *, needs=(True, True, True, True)):
    """Returns ``(d_gate_up_proj (E, 2I, H), d_down_proj (E, H, I), d_gate_up_bias (E, 2I),
    d_down_bias (E, H))``; zeros for empty experts, None where ``needs`` says it is not
    wanted or the forward had no such bias."""
    d_gup = d_down = d_gub = d_db = None
    if needs[0]:
        if work.fused:
            d_gup = grouped_linear_dw(work.x, work.d_gate_up, work.offs)
        else:
            d_gup = gate_up_separate_dw(work.x, work.d_gate, work.d_up, work.offs,
                                        layout_id=work.layout_id)
    if needs[1]:
        d_down = grouped_linear_dw(work.h, work.dy, work.offs)
    need_gub = needs[2] and work.has_gate_up_bias
    need_db = needs[3] and work.has_down_bias
    if need_gub or need_db:
        if need_gub:
            d_rows = (work.d_gate_up,) if work.fused else (work.d_gate, work.d_up)
            d_gub = _row_bias_sum(work.offs, *d_rows, layout_id=work.layout_id)
        if need_db:
            d_db = _row_bias_sum(work.offs, work.dy)
    return d_gup, d_down, d_gub, d_db


def experts_bwd(res: ExpertsRes, dy, *, needs=(True, True, True, True, True, True)):
    """Returns ``(dx, d_gate_up_proj, d_down_proj, d_weights, d_gate_up_bias, d_down_bias)``
    (the forward's differentiable inputs in order); ``needs`` follows that order."""
    dx, d_weights, work = experts_bwd_input(res, dy, needs_x=needs[0], needs_weights=needs[3])
    d_gup, d_down, d_gub, d_db = experts_bwd_weight(
        work, needs=(needs[1], needs[2], needs[4], needs[5]))
    return dx, d_gup, d_down, d_weights, d_gub, d_db
