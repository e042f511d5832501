"""Triton kernels registered as torch custom ops, with the signatures of ``moe_fn.pure``.

The functions here are drop-in replacements for the pure pairs of the same names (same
arguments, same ``Res`` NamedTuples, same outputs), so a shell may call either module.
They call the ``torch.ops.moe_fn.*`` custom ops (see ``_registry``): CUDA tensors of
float16/bfloat16/float32 run the Triton kernels, everything else the pure pair.

Ops: ``swiglu_fwd``, ``swiglu_bwd``, ``swiglu_packed_fwd``, ``swiglu_packed_bwd``,
``row_weight_fwd``, ``row_weight_bwd``. The explicit Triton launchers (any device; CPU
under ``TRITON_INTERPRET=1``) are ``moe_fn.kernels.activation.launch_*`` and
``moe_fn.kernels.row_weight.launch_*``.
"""

from __future__ import annotations

import torch

from ..pure.activations import SwigluPackedRes, SwigluRes
from ..pure.row_weight import RowWeightRes
from . import _registry  # noqa: F401  (registers the ops)
from ._registry import use_triton

__all__ = [
    "gather_sum_fwd",
    "RowWeightRes",
    "SwigluPackedRes",
    "SwigluRes",
    "row_weight_bwd",
    "row_weight_fwd",
    "swiglu_bwd",
    "swiglu_fwd",
    "swiglu_packed_bwd",
    "swiglu_packed_fwd",
    "use_triton",
]

_ops = torch.ops.moe_fn


def swiglu_fwd(gate, up, weights=None, *, act_id: int, alpha: float, limit: float):
    """``h = act(gate, up) [* weights]``; gate, up ``(N, I)``, weights ``(N,)``."""
    h = _ops.swiglu_fwd(gate, up, weights, act_id, alpha, limit)
    return h, SwigluRes(gate, up, weights, act_id, alpha, limit)


# h = act(g, u) * w:  dg = dh * w * da/dg,  du = dh * w * da/du,  dw = sum_j dh * act(g, u).
def swiglu_bwd(res: SwigluRes, dh, *, needs=(True, True, True)):
    """Returns ``(d_gate, d_up, d_weights)``; ``d_weights`` is None without weights."""
    dg, du, dw = _ops.swiglu_bwd(res.gate, res.up, res.weights, dh, res.act_id, res.alpha,
                                 res.limit, bool(needs[0]), bool(needs[1]), bool(needs[2]))
    return (dg if needs[0] else None, du if needs[1] else None,
            dw if (needs[2] and res.weights is not None) else None)


def swiglu_packed_fwd(gate_up, weights=None, *, act_id: int, alpha: float, limit: float,
                      layout_id: int):
    """``h = act(gate, up) [* weights]`` reading both halves of ``gate_up (N, 2I)`` in place."""
    h = _ops.swiglu_packed_fwd(gate_up, weights, act_id, alpha, limit, layout_id)
    return h, SwigluPackedRes(gate_up, weights, act_id, alpha, limit, layout_id)


def swiglu_packed_bwd(res: SwigluPackedRes, dh, *, needs=(True, True)):
    """Returns ``(d_gate_up, d_weights)``, ``d_gate_up`` packed in the input's layout."""
    dgu, dw = _ops.swiglu_packed_bwd(res.gate_up, res.weights, dh, res.act_id, res.alpha,
                                     res.limit, res.layout_id, bool(needs[0]), bool(needs[1]))
    return (dgu if needs[0] else None,
            dw if (needs[1] and res.weights is not None) else None)


def row_weight_fwd(rows, weights):
    """``out = rows * weights[:, None]``."""
    out = _ops.row_weight_fwd(rows, weights)
    return out, RowWeightRes(rows, weights)


# d_rows = d_out * w;  d_w = sum_j d_out * rows.
def row_weight_bwd(res: RowWeightRes, d_out, *, needs=(True, True)):
    d_rows, d_w = _ops.row_weight_bwd(res.rows, res.weights, d_out, bool(needs[0]),
                                      bool(needs[1]))
    return (d_rows if needs[0] else None), (d_w if needs[1] else None)


def gather_sum_fwd(rows, index, top_k: int):
    """``out[t] = sum_j rows[index[t*k + j]]`` in one pass (the fused combine)."""
    from ..pure.dispatch import GatherSumRes

    out = _ops.gather_sum(rows, index, int(top_k))
    return out, GatherSumRes(index, rows.shape[0], int(top_k))
