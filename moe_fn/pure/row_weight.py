"""Row weighting: ``out = rows * w[:, None]`` (math in float32 for half types)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._checks import FLOAT_DTYPES, check_same, check_tensor
from .activations import compute_dtype
from .dispatch import behind, check_own_rows_args


class RowWeightRes(NamedTuple):
    rows: torch.Tensor
    weights: torch.Tensor


def check_row_weight_args(rows, weights) -> None:
    check_tensor("rows", rows, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weights", weights, ndim=1, dtypes=FLOAT_DTYPES)
    if weights.shape[0] != rows.shape[0]:
        raise ValueError(
            f"weights must have one entry per row ({rows.shape[0]}), got {weights.shape[0]}"
        )
    check_same("rows and weights", rows, weights, dtype=False)


def row_weight_fwd(rows, weights):
    cd = compute_dtype(rows.dtype)
    out = (rows.to(cd) * weights.to(cd)[:, None]).to(rows.dtype)
    return out, RowWeightRes(rows, weights)


# d_rows = d_out * w;  d_w = sum_j d_out * rows.
def row_weight_bwd(res: RowWeightRes, d_out, *, needs=(True, True)):
    cd = compute_dtype(res.rows.dtype)
    d_out = d_out.to(cd)
    d_rows = (d_out * res.weights.to(cd)[:, None]).to(res.rows.dtype) if needs[0] else None
    d_w = (d_out * res.rows.to(cd)).sum(dim=-1).to(res.weights.dtype) if needs[1] else None
    return d_rows, d_w


def check_gather_row_weight_args(src, own, own_tokens) -> None:
    check_own_rows_args(src, own, own_tokens, names=("own", "own_tokens"))


def gather_row_weight_bwd(src, index, rows, weights, *, own=None, own_tokens=None):
    """The row weighting's backward on gathered gradients, ``d = src[index[i]]``:
    ``(d_rows = w * d, d_w = <d, rows>)``. Given ``own`` and ``own_tokens``, entries from
    ``len(src)`` on read ``own[own_tokens[j - len(src)]]``, as if those rows were gathered
    behind ``src``."""
    check_gather_row_weight_args(src, own, own_tokens)
    return row_weight_bwd(RowWeightRes(rows, weights),
                          behind(src, own, own_tokens).index_select(0, index))
