"""Gate and up projections over the packed weight ``gate_up_proj (E, 2I, H)``.

Packings (``layout_id`` from ``activations.resolve_layout``): ``halves`` (HF) keeps the gate
in rows ``[:I]`` of each expert's weight and the up projection in rows ``[I:]``;
``interleaved`` (GPT-OSS) keeps the gate in even rows and up in odd rows.

- fused: one grouped GEMM ``x @ gate_up_proj^T`` gives the packed ``(N, 2I)`` tensor in
  the weight's own packing; backward is one input-gradient GEMM over the packed gradient
  and one weight-gradient GEMM straight into ``(E, 2I, H)``.
- separate: two grouped GEMMs over strided views of the two halves (``_grouped_mm``
  accepts those views as they are: rows stay unit-stride, so nothing is copied); backward
  sums two input-gradient GEMMs and packs the two weight gradients back into the layout.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .activations import LAYOUT_ID
from .grouped import grouped_linear_dw, grouped_linear_dx, grouped_linear_fwd


class GateUpRes(NamedTuple):
    x: torch.Tensor  # (N, H)
    gate_up_proj: torch.Tensor  # (E, 2I, H)
    offs: torch.Tensor  # (E,) int32 cumulative row ends
    layout_id: int


def weight_halves(gate_up_proj: torch.Tensor, layout_id: int):
    """Views ``(w_gate, w_up)``, each ``(E, I, H)``, of the packed weight."""
    if layout_id == LAYOUT_ID["halves"]:
        i = gate_up_proj.shape[1] // 2
        return gate_up_proj[:, :i], gate_up_proj[:, i:]
    return gate_up_proj[:, 0::2], gate_up_proj[:, 1::2]


def join_weight_halves(w_gate: torch.Tensor, w_up: torch.Tensor, layout_id: int):
    """Pack ``(E, I, H)`` gate and up tensors into ``(E, 2I, H)`` in the given layout."""
    if layout_id == LAYOUT_ID["halves"]:
        return torch.cat([w_gate, w_up], dim=1)
    return torch.stack([w_gate, w_up], dim=2).flatten(1, 2)


# ---- fused ---------------------------------------------------------------------------


def gate_up_fused_fwd(x, gate_up_proj, offs, *, layout_id: int):
    """Packed ``gate_up (N, 2I)`` in the weight's layout, one grouped GEMM."""
    gu, _ = grouped_linear_fwd(x, gate_up_proj, offs)
    return gu, GateUpRes(x, gate_up_proj, offs, layout_id)


# dx = d_gate_up @ W_e (both halves in one GEMM);  dW_e = d_gate_up_e^T @ x_e (packed as W).
def gate_up_fused_bwd(res: GateUpRes, d_gate_up, *, needs=(True, True)):
    """Returns ``(dx (N, H), d_gate_up_proj (E, 2I, H))``."""
    dx = grouped_linear_dx(d_gate_up, res.gate_up_proj, res.offs) if needs[0] else None
    dw = grouped_linear_dw(res.x, d_gate_up, res.offs) if needs[1] else None
    return dx, dw


# ---- separate ------------------------------------------------------------------------


def gate_up_separate_fwd(x, gate_up_proj, offs, *, layout_id: int):
    """``(gate, up)``, each ``(N, I)``, from two grouped GEMMs over views of the weight."""
    w_gate, w_up = weight_halves(gate_up_proj, layout_id)
    gate, _ = grouped_linear_fwd(x, w_gate, offs)
    up, _ = grouped_linear_fwd(x, w_up, offs)
    return (gate, up), GateUpRes(x, gate_up_proj, offs, layout_id)


# dx = d_gate @ Wg_e + d_up @ Wu_e.
def gate_up_separate_dx(d_gate, d_up, gate_up_proj, offs, *, layout_id: int):
    w_gate, w_up = weight_halves(gate_up_proj, layout_id)
    return grouped_linear_dx(d_gate, w_gate, offs) + grouped_linear_dx(d_up, w_up, offs)


# dWg_e = d_gate_e^T @ x_e,  dWu_e = d_up_e^T @ x_e, packed into (E, 2I, H).
def gate_up_separate_dw(x, d_gate, d_up, offs, *, layout_id: int):
    dwg = grouped_linear_dw(x, d_gate, offs)
    dwu = grouped_linear_dw(x, d_up, offs)
    return join_weight_halves(dwg, dwu, layout_id)


def gate_up_separate_bwd(res: GateUpRes, d_gate, d_up, *, needs=(True, True)):
    """Returns ``(dx (N, H), d_gate_up_proj (E, 2I, H))``."""
    dx = dw = None
    if needs[0]:
        dx = gate_up_separate_dx(d_gate, d_up, res.gate_up_proj, res.offs,
                                 layout_id=res.layout_id)
    if needs[1]:
        dw = gate_up_separate_dw(res.x, d_gate, d_up, res.offs, layout_id=res.layout_id)
    return dx, dw
