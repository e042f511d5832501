"""Dispatch layout and row movement: sort the ``T * k`` routed rows by expert and back.

Row numbering: the flattened routed row ``r = t * k + j`` is token ``t``'s ``j``-th choice
(``topk_idx[t, j]``). The layout sorts these rows by expert, stably (rows of one expert stay
in ``r`` order), into the expert-contiguous order a grouped GEMM consumes:

- ``perm[i]``: which flattened row sits at sorted position ``i``;
- ``inv_perm[r]``: the sorted position of flattened row ``r`` (``perm[inv_perm] == arange``);
- ``counts[e]``: rows routed to expert ``e`` (int64); ``offs = cumsum(counts)`` as int32
  (``torch._grouped_mm``'s cumulative ends; ``offs[-1] == T * k``).

Pairs: ``permute`` (tokens -> sorted rows), ``unpermute`` (sorted rows -> ``(t, j)`` order),
``weighted_combine`` (``out[t] = sum_j w[t, j] * rows[t * k + j]``) and ``combine_sum`` (the
same without weights, for when they were applied on the expert side). These are the
contract, each step on its own. The exchanges move rows with fused forms of them:
``gather_sum`` and ``weighted_gather_sum`` (unpermute and the sum over k in one step, with
or without the weights; the tests check both against the pairs composed),
``masked_gather_sum`` (the token-once exchanges' per-token sums) and the ``peer_*`` /
``slot_sum`` twins of the ``symm_mem`` exchange's kernels. Sums run in float32 for half
types (float64 stays float64) and are cast once. No host syncs; backward passes are
deterministic (gathers, permutation scatters and fixed-order sums, no atomics), except
``gather_sum_bwd``'s ``index_add``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._checks import FLOAT_DTYPES, check_same, check_tensor, debug_checks
from .activations import compute_dtype

_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_top_k(top_k) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")


def _check_perm(name: str, p, num_rows: int, device) -> None:
    check_tensor(name, p, ndim=1, dtypes=_INDEX_DTYPES)
    if p.shape[0] != num_rows:
        raise ValueError(f"{name} must have one entry per routed row ({num_rows}), "
                         f"got {p.shape[0]}")
    if p.device != device:
        raise ValueError(f"{name} must be on {device}, got {p.device}")


# ----------------------------------------------------------------------------- layout


def check_layout_args(topk_idx, num_experts) -> None:
    check_tensor("topk_idx", topk_idx, ndim=2, dtypes=_INDEX_DTYPES)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    # Value check: free on CPU, a host sync on CUDA (debug only); skipped while compiling.
    if (topk_idx.numel() and not torch.compiler.is_compiling()
            and (topk_idx.device.type == "cpu" or debug_checks())):
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(
                f"topk_idx values must lie in [0, {num_experts}), got [{lo}, {hi}]"
            )


def layout(topk_idx, num_experts: int):
    """``topk_idx (T, k)`` -> ``(counts int64 (E,), offs int32 (E,), perm int64 (T*k,),
    inv_perm int64 (T*k,))``; ``perm`` is a stable sort of the flattened rows by expert."""
    check_layout_args(topk_idx, num_experts)
    flat = topk_idx.reshape(-1).to(torch.int64)
    n = flat.shape[0]
    # scatter_add, not bincount: bincount on CUDA reads the max back to the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts = counts.scatter_add(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    perm = torch.sort(flat, stable=True)[1]
    inv_perm = torch.empty_like(perm).scatter(
        0, perm, torch.arange(n, dtype=torch.int64, device=flat.device)
    )
    return counts, offs, perm, inv_perm


def _invert(p: torch.Tensor) -> torch.Tensor:
    p = p.to(torch.int64)
    return torch.empty_like(p).scatter(0, p, torch.arange(p.shape[0], dtype=torch.int64,
                                                           device=p.device))


# ----------------------------------------------------------------------------- permute


class PermuteRes(NamedTuple):
    perm: torch.Tensor       # (T*k,) int, sorted position -> flattened row
    num_tokens: int          # T
    top_k: int               # k


def check_permute_args(x, perm, top_k) -> None:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    _check_top_k(top_k)
    _check_perm("perm", perm, x.shape[0] * top_k, x.device)


def permute_fwd(x, perm, top_k: int):
    """``rows[i] = x[perm[i] // top_k]``: ``x (T, H)`` -> ``rows (T*k, H)`` in sorted order."""
    check_permute_args(x, perm, top_k)
    rows = x.index_select(0, torch.div(perm, top_k, rounding_mode="floor"))
    return rows, PermuteRes(perm, x.shape[0], top_k)


# d_x[t] = sum_j d_rows[inv_perm[t*k + j]]  (a gather by the inverse, then a k-sum; no atomics).
def permute_bwd(res: PermuteRes, d_rows, *, needs=(True,)):
    """Returns ``d_x (T, H)`` in ``d_rows``' dtype."""
    if not needs[0]:
        return None
    cd = compute_dtype(d_rows.dtype)
    d_tk = d_rows.index_select(0, _invert(res.perm))
    d_x = d_tk.to(cd).view(res.num_tokens, res.top_k, d_rows.shape[-1]).sum(dim=1)
    return d_x.to(d_rows.dtype)


# ----------------------------------------------------------------------------- unpermute


class UnpermuteRes(NamedTuple):
    inv_perm: torch.Tensor   # (T*k,) int, flattened row -> sorted position


def check_unpermute_args(rows_sorted, inv_perm) -> None:
    check_tensor("rows_sorted", rows_sorted, ndim=2, dtypes=FLOAT_DTYPES)
    _check_perm("inv_perm", inv_perm, rows_sorted.shape[0], rows_sorted.device)


def unpermute_fwd(rows_sorted, inv_perm):
    """``rows_tk[r] = rows_sorted[inv_perm[r]]``: back to ``(token, k)`` order."""
    check_unpermute_args(rows_sorted, inv_perm)
    return rows_sorted.index_select(0, inv_perm), UnpermuteRes(inv_perm)


# d_sorted[inv_perm[r]] = d_tk[r]  (inv_perm is a permutation: a gather by perm).
def unpermute_bwd(res: UnpermuteRes, d_rows_tk, *, needs=(True,)):
    """Returns ``d_rows_sorted (T*k, H)``."""
    if not needs[0]:
        return None
    return d_rows_tk.index_select(0, _invert(res.inv_perm))


# ----------------------------------------------------------------------------- combine


class WeightedCombineRes(NamedTuple):
    rows_tk: torch.Tensor    # (T*k, H) in (token, k) order
    weights: torch.Tensor    # (T, k)
    top_k: int


def check_weighted_combine_args(rows_tk, weights, top_k) -> None:
    check_tensor("rows_tk", rows_tk, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weights", weights, ndim=2, dtypes=FLOAT_DTYPES)
    _check_top_k(top_k)
    if weights.shape[1] != top_k:
        raise ValueError(f"weights must have top_k ({top_k}) columns, got {weights.shape[1]}")
    if rows_tk.shape[0] != weights.shape[0] * top_k:
        raise ValueError(f"rows_tk must have T * top_k ({weights.shape[0]} * {top_k}) rows, "
                         f"got {rows_tk.shape[0]}")
    check_same("rows_tk and weights", rows_tk, weights, dtype=False)


def weighted_combine_fwd(rows_tk, weights, top_k: int):
    """``out[t] = sum_j rows_tk[t*k + j] * weights[t, j]``; ``out (T, H)`` in rows' dtype."""
    check_weighted_combine_args(rows_tk, weights, top_k)
    cd = compute_dtype(rows_tk.dtype)
    t = weights.shape[0]
    r = rows_tk.to(cd).reshape(t, top_k, rows_tk.shape[-1])
    out = (r * weights.to(cd)[:, :, None]).sum(dim=1).to(rows_tk.dtype)
    return out, WeightedCombineRes(rows_tk, weights, top_k)


# d_rows[t*k + j] = d_out[t] * w[t, j];  d_w[t, j] = <d_out[t], rows[t*k + j]>.
def weighted_combine_bwd(res: WeightedCombineRes, d_out, *, needs=(True, True)):
    """Returns ``(d_rows_tk (T*k, H), d_weights (T, k))``."""
    rows, w, k = res.rows_tk, res.weights, res.top_k
    cd = compute_dtype(rows.dtype)
    t, h = w.shape[0], rows.shape[-1]
    d = d_out.to(cd)
    d_rows = d_w = None
    if needs[0]:
        d_rows = (d[:, None, :] * w.to(cd)[:, :, None]).reshape(t * k, h).to(rows.dtype)
    if needs[1]:
        d_w = (rows.to(cd).reshape(t, k, h) * d[:, None, :]).sum(dim=-1).to(w.dtype)
    return d_rows, d_w


class CombineSumRes(NamedTuple):
    num_tokens: int
    top_k: int


def check_combine_sum_args(rows_tk, top_k) -> None:
    check_tensor("rows_tk", rows_tk, ndim=2, dtypes=FLOAT_DTYPES)
    _check_top_k(top_k)
    if rows_tk.shape[0] % top_k:
        raise ValueError(f"rows_tk's row count ({rows_tk.shape[0]}) must be a multiple of "
                         f"top_k ({top_k})")


def combine_sum_fwd(rows_tk, top_k: int):
    """``out[t] = sum_j rows_tk[t*k + j]``; ``out (T, H)`` in rows' dtype."""
    check_combine_sum_args(rows_tk, top_k)
    cd = compute_dtype(rows_tk.dtype)
    t = rows_tk.shape[0] // top_k
    out = rows_tk.to(cd).reshape(t, top_k, rows_tk.shape[-1]).sum(dim=1).to(rows_tk.dtype)
    return out, CombineSumRes(t, top_k)


# d_rows[t*k + j] = d_out[t].
def combine_sum_bwd(res: CombineSumRes, d_out, *, needs=(True,)):
    """Returns ``d_rows_tk (T*k, H)`` (a materialised expand of ``d_out``)."""
    if not needs[0]:
        return None
    t, k = res.num_tokens, res.top_k
    return d_out[:, None, :].expand(t, k, d_out.shape[-1]).reshape(t * k, d_out.shape[-1])


class GatherSumRes(NamedTuple):
    index: torch.Tensor
    num_rows: int
    top_k: int


def gather_sum_fwd(rows, index, top_k: int):
    """``out[t] = sum_j rows[index[t*k + j]]`` (float32 accumulation for half types):
    unpermute and the sum over k in one step. ``rows (N, H)``, ``index (T*k,)`` int64."""
    _check_top_k(top_k)
    t = index.numel() // top_k
    g = rows.index_select(0, index).reshape(t, top_k, rows.shape[-1])
    out = g.sum(dim=1, dtype=compute_dtype(rows.dtype)).to(rows.dtype)
    return out, GatherSumRes(index, rows.shape[0], top_k)


# d_rows[index[t*k + j]] += d_out[t].
def gather_sum_bwd(res: GatherSumRes, d_out, *, needs=(True,)):
    if not needs[0]:
        return (None,)
    src = d_out.repeat_interleave(res.top_k, dim=0)
    d_rows = d_out.new_zeros((res.num_rows, d_out.shape[-1]))
    return (d_rows.index_add(0, res.index, src),)


class WeightedGatherSumRes(NamedTuple):
    rows: torch.Tensor       # (P, H) the gathered rows (home-buffer order)
    index: torch.Tensor      # (T*k,) int64, flattened row -> position in ``rows``
    weights: torch.Tensor    # (T*k,) routing weights
    top_k: int


def weighted_gather_sum_fwd(rows, index, weights, top_k: int):
    """``out[t] = sum_j weights[t*k + j] * rows[index[t*k + j]]`` (float32 accumulation for
    half types): unpermute, the routing weights and the sum over k in one step, so the
    weights never travel to the experts. ``index`` must be a bijection onto ``rows``."""
    _check_top_k(top_k)
    t = index.numel() // top_k
    cd = compute_dtype(rows.dtype)
    g = rows.index_select(0, index).to(cd) * weights.to(cd)[:, None]
    out = g.reshape(t, top_k, rows.shape[-1]).sum(dim=1).to(rows.dtype)
    return out, WeightedGatherSumRes(rows, index, weights, top_k)


def check_own_rows_args(rows, own, own_index, names=("own", "own_index")) -> None:
    """A second source of rows read in place, ``own[own_index]``, checked against
    ``rows``."""
    if (own is None) != (own_index is None):
        raise ValueError(f"{names[0]} and {names[1]} go together")
    if own is None:
        return
    check_tensor(names[1], own_index, ndim=1, dtypes=_INDEX_DTYPES)
    check_same(f"rows, {names[0]} and {names[1]}", rows, own, own_index, dtype=False)
    if own.dtype != rows.dtype or own.shape[1:] != rows.shape[1:]:
        raise ValueError(f"{names[0]} rows ({tuple(own.shape)} {own.dtype}) must match rows "
                         f"({tuple(rows.shape)} {rows.dtype})")


def behind(rows, own, own_index):
    """``[rows; own[own_index]]``: what a two-source kernel reads in place, materialised
    (the pure twins' form)."""
    return rows if own is None else torch.cat([rows, own.index_select(0, own_index)])


def check_gather_sum_own_args(rows, index, top_k, weights, own, own_index, values=None,
                              own_values=None, values_out=None) -> None:
    _check_top_k(top_k)
    if index.dim() != 1 or index.numel() % top_k:
        raise ValueError(f"index must be 1-D with a multiple of top_k={top_k} entries, got "
                         f"shape {tuple(index.shape)}")
    if weights is not None and weights.shape != index.shape:
        raise ValueError(f"weights must have one entry per index entry "
                         f"({tuple(index.shape)}), got {tuple(weights.shape)}")
    check_tensor("rows", rows, ndim=2)
    check_own_rows_args(rows, own, own_index)
    if (values is None) != (values_out is None) or (values is None and own_values is not None):
        raise ValueError("values and values_out go together (own_values with them)")
    if values is None:
        return
    if (own is None) != (own_values is None):
        raise ValueError("own_values go with own: one value row per own row")
    check_value_rows("values", values, "values_out", values_out, like=rows)
    if own_values is not None:
        check_value_rows("own_values", own_values, "values_out", values_out, like=rows)
    for name, v, r in (("values", values, rows), ("own_values", own_values, own)):
        if v is not None and v.shape[0] != r.shape[0]:
            raise ValueError(f"{name} must have a row per row of the rows they go with "
                             f"({r.shape[0]}), got {v.shape[0]}")
    if values_out.shape[0] != index.numel() or not values_out.is_contiguous():
        raise ValueError(f"values_out must be contiguous with a row per index entry "
                         f"({index.numel()}), got {tuple(values_out.shape)} strides "
                         f"{values_out.stride()}")


def gather_sum_own(rows, index, top_k: int, weights=None, *, own, own_index, values=None,
                   own_values=None, values_out=None):
    """``gather_sum_fwd`` (``weighted_gather_sum_fwd`` given ``weights``) over ``rows`` with
    ``own[own_index]`` behind them: an entry ``j >= len(rows)`` reads
    ``own[own_index[j - len(rows)]]``. The combine's sum over the rows that arrived and the
    rank's own rows where the experts left them, none copied behind the others. Given
    ``values`` (a row per row of ``rows``, e.g. the raw bytes packed behind them) and
    ``own_values`` (a row per row of ``own``), each entry's value row is also gathered from
    the same place into ``values_out[j]``, as raw bytes."""
    check_gather_sum_own_args(rows, index, top_k, weights, own, own_index, values, own_values,
                              values_out)
    if values is not None:
        every_v = behind(value_rows_bytes(values),
                         None if own_values is None else value_rows_bytes(own_values),
                         own_index)
        values_out.view(torch.uint8).copy_(every_v.index_select(0, index))
    every = behind(rows, own, own_index)
    if weights is None:
        return gather_sum_fwd(every, index, top_k)[0]
    return weighted_gather_sum_fwd(every, index, weights, top_k)[0]


def check_split_rows_args(num_rows: int, split: int, hi_out, hi_index, lo_out=None, *,
                          like=None) -> None:
    """Where rows from ``split`` on go: a new tensor, ``hi_out`` in order (its first
    ``num_rows - split`` rows), or ``hi_out`` at the rows ``hi_index`` names; rows before
    ``split``: a new tensor or ``lo_out``, ``(split, H)`` with contiguous columns, of
    ``like``'s dtype, width and device when given."""
    if lo_out is not None:
        strided = lo_out.dim() == 2 and min(lo_out.shape) > 0 and lo_out.shape[1] > 1
        if (lo_out.dim() != 2 or lo_out.shape[0] != split
                or (strided and lo_out.stride(-1) != 1)):
            raise ValueError(f"lo_out must be ({split}, H) with contiguous columns, got "
                             f"{tuple(lo_out.shape)} with strides {lo_out.stride()}")
        if like is not None and (lo_out.dtype != like.dtype or lo_out.device != like.device
                                 or lo_out.shape[1] != like.shape[1]):
            raise ValueError(f"lo_out ({lo_out.dtype}, {lo_out.shape[1]} wide, on "
                             f"{lo_out.device}) must match the rows ({like.dtype}, "
                             f"{like.shape[1]} wide, on {like.device})")
    n_hi = num_rows - split
    if hi_index is not None and hi_out is None:
        raise ValueError("hi_index needs hi_out")
    if hi_index is not None and hi_index.numel() != n_hi:
        raise ValueError(f"hi_index needs one entry per row from {split} on ({n_hi}), got "
                         f"{hi_index.numel()}")
    if hi_index is None and hi_out is not None and hi_out.shape[0] != n_hi:
        raise ValueError(f"hi_out must hold the {n_hi} rows from {split} on, got "
                         f"{hi_out.shape[0]}")


def split_rows(rows, split: int | None, hi_out=None, hi_index=None, lo_out=None):
    """``(rows[:split], rows[split:])``; given ``hi_out``, the second part is copied into it
    (at its rows ``hi_index`` when that is given too) and ``hi_out`` is returned instead,
    and given ``lo_out`` the first part likewise: the layout the fused weighted-combine
    backward writes directly."""
    split = rows.shape[0] if split is None else split
    check_split_rows_args(rows.shape[0], split, hi_out, hi_index, lo_out, like=rows)
    lo = rows[:split] if lo_out is None else lo_out.copy_(rows[:split])
    if hi_out is None:
        return lo, rows[split:]
    if hi_index is None:
        return lo, hi_out.copy_(rows[split:])
    return lo, hi_out.index_copy_(0, hi_index.long(), rows[split:])


def check_copy_rows_args(src, index, out, out_index, values=None, values_index=None,
                         values_out=None) -> int:
    """``copy_rows``' arguments checked; returns the number of rows to copy."""
    if index is None and out_index is None:
        raise ValueError("copy_rows needs index, out_index or both")
    n = (out_index if out_index is not None else index).numel()
    for name, t in (("index", index), ("values_index", values_index)):
        if t is not None and t.numel() != n:
            raise ValueError(f"{t.numel()} entries in {name} for {n} rows to copy")
    if (index is None and src.shape[0] < n) or (out_index is None and out.shape[0] < n):
        raise ValueError(f"{n} rows to copy from {src.shape[0]} into {out.shape[0]}")
    if src.dtype != out.dtype or src.shape[1:] != out.shape[1:]:
        raise ValueError(f"out ({tuple(out.shape)} {out.dtype}) must take src's rows "
                         f"({tuple(src.shape)} {src.dtype})")
    if (values is None) != (values_out is None):
        raise ValueError("values and values_out go together")
    if values_index is not None and values is None:
        raise ValueError("values_index without values")
    if values is not None:
        check_value_rows("values", values, "values_out", values_out, like=out)
        if values_index is not None:
            check_tensor("values_index", values_index, ndim=1, dtypes=_INDEX_DTYPES)
        if ((values_index is None and values.shape[0] < n)
                or (out_index is None and values_out.shape[0] < n)):
            raise ValueError(f"{n} values to copy from {values.shape[0]} into "
                             f"{values_out.shape[0]}")
    return n


def check_value_rows(name, values, out_name, out, like=None) -> None:
    """Values copied as raw bytes: both 2-D with as many bytes a row (their dtypes may
    differ: packed bytes into float32), on ``like``'s device; ``out`` written through a
    byte view, so its columns contiguous."""
    check_tensor(name, values, ndim=2)
    check_tensor(out_name, out, ndim=2)
    check_same(f"{name} and {out_name}", *((values, out) if like is None else
                                           (like, values, out)), dtype=False)
    if row_bytes(values) != row_bytes(out):
        raise ValueError(f"{out_name} ({tuple(out.shape)} {out.dtype}) must take {name}' rows "
                         f"({tuple(values.shape)} {values.dtype}): as many bytes a row")
    if out.stride(-1) != 1:
        raise ValueError(f"{out_name} must have contiguous columns, got strides {out.stride()}")


def row_bytes(t: torch.Tensor) -> int:
    """Bytes in a row of ``t (M, C)``."""
    return t.shape[1] * t.element_size()


def value_rows_bytes(values: torch.Tensor) -> torch.Tensor:
    """``values (M, C)`` as their raw bytes ``(M, C * element size)``: a view where the
    columns are contiguous (a row-strided view of packed bytes stays one), else a copy (a
    gradient expanded from one value has stride 0)."""
    if values.dtype == torch.uint8 and values.stride(-1) == 1:
        return values
    if values.stride(-1) != 1:
        values = values.clone(memory_format=torch.contiguous_format)
    return values.view(torch.uint8)


def copy_rows(src, index, out, out_index=None, *, values=None, values_index=None,
              values_out=None):
    """``out[out_index[i]] = src[index[i]]`` (``src[i]`` when ``index`` is None, ``out[i]``
    when ``out_index`` is None; one of them given): rows gathered and scattered at once,
    e.g. straight to their expert-major places. Given ``values`` (a row of them per copied
    row, e.g. routing weights), also ``values_out[out_index[i]] = values[values_index[i]]``
    (``values[i]`` without ``values_index``) as raw bytes: their dtypes may differ (packed
    bytes into float32) where their rows hold as many bytes. Writes into ``out`` (and
    ``values_out``) and returns ``out``."""
    n = check_copy_rows_args(src, index, out, out_index, values, values_index, values_out)
    dst = None if out_index is None else out_index.long()

    def put(into, rows):
        if dst is None:
            into[:n].copy_(rows)
        else:
            into.index_copy_(0, dst, rows)
    put(out, src[:n] if index is None else src.index_select(0, index))
    if values is not None:
        raw = value_rows_bytes(values)
        put(values_out.view(torch.uint8),
            raw[:n] if values_index is None else raw.index_select(0, values_index))
    return out


# Row at position p holds flattened row r = pos_to_row[p] of token r // k:
#   d_rows[p] = w[r] * d_out[r // k];  d_w[r] = <d_out[r // k], rows[p]>.
def weighted_gather_sum_bwd(d_out, rows, pos_to_row, weights, top_k: int):
    """Returns ``(d_rows (P, H) in position order, d_weights (T*k,))``; ``pos_to_row`` is
    the inverse of the forward's ``index``."""
    cd = compute_dtype(rows.dtype)
    d_tok = d_out.index_select(0, torch.div(pos_to_row, top_k, rounding_mode="floor")).to(cd)
    w = weights.to(cd).index_select(0, pos_to_row)
    d_rows = (d_tok * w[:, None]).to(rows.dtype)
    d_w_pos = (d_tok * rows.to(cd)).sum(dim=-1)
    d_w = torch.empty_like(d_w_pos).index_copy_(0, pos_to_row, d_w_pos)
    return d_rows, d_w.to(weights.dtype)


# The partials' pull (``kernels.peer``) keeps each token's ranks as bits of an int64.
PEER_MAX_RANKS = 63


def masked_gather_sum(rows, table, weights=None, *, out_dtype=None):
    """``out[r] = sum_j [weights[table[r, j]] *] rows[table[r, j]]`` over the entries with
    ``table[r, j] >= 0`` (float32 accumulation for half types; absent entries are -1).

    The per-token sums of a token-once exchange: a received token's rows on this rank
    (``table`` = its row of each top-k slot), or a home token's partial sums from each rank
    (``table`` = its position in the returned buffer per rank). ``rows (N, H)``,
    ``table (R, K)`` int64, ``weights (N,)`` or None -> ``(R, H)`` in ``out_dtype``
    (default rows' dtype)."""
    r, k = table.shape
    cd = compute_dtype(rows.dtype)
    out_dtype = out_dtype or rows.dtype
    if rows.shape[0] == 0 or r * k == 0:
        return rows.new_zeros((r, rows.shape[1]), dtype=out_dtype)
    present = table >= 0
    g = rows.index_select(0, table.clamp(min=0).reshape(-1)).reshape(r, k, rows.shape[1]).to(cd)
    # Absent slots read row 0 as a stand-in: zero it rather than scale it (inf * 0 is NaN).
    g = torch.where(present[:, :, None], g, 0)
    if weights is not None:
        w = weights.to(cd).index_select(0, table.clamp(min=0).reshape(-1)).reshape(r, k)
        g = g * torch.where(present, w, 0)[:, :, None]
    return g.sum(dim=1).to(out_dtype)


def peer_gather(peers, src_rank, src_idx, row_div: int = 1):
    """``out[i] = peers[src_rank[i]][src_idx[i] // row_div]``: rows (or, for 1-D peers,
    values) gathered from one tensor per rank, the contract of the peer-memory pull
    (``moe_fn.kernels.peer``). Every peer's candidate is gathered and kept where the row
    comes from that peer: no host sync."""
    n = src_idx.numel()
    ref = peers[0]
    j = src_idx.long() // row_div
    out = ref.new_zeros((n, *ref.shape[1:]))
    for s, peer in enumerate(peers):
        if peer.shape[0] == 0:
            continue
        here = (src_rank == s).reshape(-1, *[1] * (ref.dim() - 1))
        out = torch.where(here, peer.index_select(0, j.clamp(0, peer.shape[0] - 1)), out)
    return out


def slot_sum(rows, token_slots, top_k: int, weights=None):
    """``masked_gather_sum`` over the flat slot table ``token_slots (G * top_k,)``, kept in
    its float32 accumulation for half types (zero where a group has no slot): an expert
    side's per-token partials, the contract of ``moe_fn.kernels.peer.launch_slot_sum``."""
    return masked_gather_sum(rows, token_slots.long().reshape(-1, top_k), weights,
                             out_dtype=compute_dtype(rows.dtype))


def peer_partial_sum(peers, home_rank, rank: int, max_tokens: int, top_k: int, out_dtype):
    """``out[t] = sum_o peers[o][rank * max_tokens + t]`` over the ranks ``o`` among
    ``home_rank[t*k:(t+1)*k]``, each once, in rank order (``peers``: every rank's
    ``slot_sum`` partials): the contract of ``moe_fn.kernels.peer.launch_pull_partials``."""
    ranks = home_rank.long().reshape(-1, top_k)
    n_tok = ranks.shape[0]
    out = peers[0].new_zeros((n_tok, peers[0].shape[1]))
    for o, p in enumerate(peers):
        here = (ranks == o).any(1)[:, None]
        out = out + torch.where(here, p[rank * max_tokens:rank * max_tokens + n_tok], 0)
    return out.to(out_dtype)
