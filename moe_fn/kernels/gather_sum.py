"""Triton kernels of the fused combine (``moe_fn.pure.dispatch.gather_sum_fwd`` and
``weighted_gather_sum_fwd/bwd`` are the contracts): ``out[t] = sum_j [w[t*k+j] *]
rows[index[t*k + j]]`` in one pass, accumulated in float32, without materialising the
(T*k, H) gathered rows; and the weighted form's backward in one pass over the rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pure.dispatch import (
    check_copy_rows_args,
    check_gather_sum_own_args,
    check_split_rows_args,
    value_rows_bytes,
)
from ..pure.row_weight import check_gather_row_weight_args
from ._launch import cdiv, launch, next_pow2

_BLOCK_C = 1024


def _vec(t: torch.Tensor, *strides: int) -> int:
    """The widest power of two (elements of ``t``, at most 16 bytes) dividing every row
    stride. Triton assumes an int argument aligned only when it is a multiple of 16 (base
    pointers it checks itself), so a packed view's row stride (H + 8 bf16 elements) would
    hide the rows' alignment; the kernels take row strides in units of ``VEC`` and multiply
    back."""
    v = max(1, 16 // t.element_size())
    while v > 1 and any(s % v for s in strides):
        v //= 2
    return v


@triton.jit
def _two_source_row(r, rows_ptr, own_ptr, own_idx_ptr, split, s_r, s_own, VEC: tl.constexpr):
    """Row ``r`` of [rows; own[own_idx]]: ``rows[r]`` below ``split``, else
    ``own[own_idx[r - split]]`` read where it is (never copied behind ``rows``)."""
    q = tl.load(own_idx_ptr + tl.maximum(r - split, 0), mask=r >= split, other=0).to(tl.int64)
    return tl.where(r < split, rows_ptr + r * (s_r * VEC), own_ptr + q * (s_own * VEC))


@triton.jit
def _gather_sum_kernel(rows_ptr, index_ptr, w_ptr, own_ptr, own_idx_ptr, out_ptr, vals_ptr,
                       own_vals_ptr, vout_ptr, H, split, s_r, s_own, s_o, s_v,
                       K: tl.constexpr, HAS_W: tl.constexpr, MASKED: tl.constexpr,
                       W_BY_ROW: tl.constexpr, TWO_SRC: tl.constexpr, HAS_VALS: tl.constexpr,
                       VB: tl.constexpr, VB_P: tl.constexpr, BLOCK_C: tl.constexpr,
                       VEC: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = cols < H
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for j in tl.static_range(K):
        r = tl.load(index_ptr + t * K + j).to(tl.int64)
        mj = m
        present = r >= 0
        if MASKED:  # -1 marks an absent entry
            # An absent entry masks its whole row: its column bound drops to 0.
            mj = cols < tl.where(present, H, 0)
            r = tl.maximum(r, 0)
        src = rows_ptr + r * (s_r * VEC)
        if TWO_SRC:
            src = _two_source_row(r, rows_ptr, own_ptr, own_idx_ptr, split, s_r, s_own, VEC)
        if HAS_VALS:  # the entry's VB value bytes from where its row is, by one program
            b = tl.arange(0, VB_P)
            mb = b < tl.where(tl.program_id(1) == 0, VB, 0)
            vsrc = vals_ptr + r * s_v
            if TWO_SRC:
                vsrc = _two_source_row(r, vals_ptr, own_vals_ptr, own_idx_ptr, split, s_v, VB,
                                       1)
            tl.store(vout_ptr + (t * K + j) * VB + b, tl.load(vsrc + b, mask=mb), mask=mb)
        v = tl.load(src + cols, mask=mj, other=0.0).to(tl.float32)
        if HAS_W:
            if W_BY_ROW:  # a weight per gathered row
                w = tl.load(w_ptr + r).to(tl.float32)
            else:  # a weight per (t, j) entry
                w = tl.load(w_ptr + t * K + j).to(tl.float32)
            if MASKED:  # an absent entry's stand-in weight is 0 too (inf * 0 is NaN)
                w = tl.where(present, w, 0.0)
            v = v * w
        acc += v
    tl.store(out_ptr + t * (s_o * VEC) + cols, acc.to(out_ptr.dtype.element_ty), mask=m)


def _output(out, t: int, h: int, rows: torch.Tensor) -> torch.Tensor:
    """A new ``(t, h)`` output, or ``out`` checked: it may be a row-strided view."""
    if out is None:
        return torch.empty((t, h), dtype=rows.dtype, device=rows.device)
    if out.shape != (t, h) or out.stride(-1) != 1 or out.dtype != rows.dtype:
        raise ValueError(f"out must be ({t}, {h}) {rows.dtype} with contiguous columns, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    return out


def launch_gather_sum(rows: torch.Tensor, index: torch.Tensor, top_k: int,
                      weights: torch.Tensor | None = None, *,
                      out: torch.Tensor | None = None, own: torch.Tensor | None = None,
                      own_index: torch.Tensor | None = None, values=None, own_values=None,
                      values_out=None) -> torch.Tensor:
    """The Triton path on any device (CPU tensors under ``TRITON_INTERPRET=1``). ``rows``
    and ``out`` may be row-strided views (columns contiguous), e.g. slices of wider rows.
    Given ``own`` and ``own_index``, entries ``j >= len(rows)`` read
    ``own[own_index[j - len(rows)]]``, and given ``values`` (``own_values`` with ``own``),
    each entry's value bytes go to ``values_out[j]`` in the same pass
    (``moe_fn.pure.dispatch.gather_sum_own``)."""
    if any(a is not None for a in (own, own_index, values, own_values, values_out)):
        check_gather_sum_own_args(rows, index, top_k, weights, own, own_index, values,
                                  own_values, values_out)
    if own is not None:
        own = own if own.stride(-1) == 1 else own.contiguous()
        if own_index.numel() == 0:
            own = own_values = None
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    t = index.numel() // top_k
    h = rows.shape[1]
    out = _output(out, t, h, rows)
    if t == 0 or (h == 0 and values is None):
        return out.zero_()
    block = min(_BLOCK_C, next_pow2(max(h, 1)))
    grid = (t, max(1, cdiv(h, block)))  # (zero-width rows: one program gathers values)
    w = index if weights is None else weights.contiguous()
    two = own is not None
    split = rows.shape[0]
    if two and split == 0:  # nothing arrived: dummy pointers, never read below split 0
        rows, values = own, own_values
    second = own if two else rows
    vec = _vec(rows, rows.stride(0), second.stride(0), out.stride(0))
    vals = vout = own_vals = out  # dummies unless values are gathered
    vb = s_v = 0
    if values is not None:
        vals, vout = value_rows_bytes(values), values_out.view(torch.uint8)
        own_vals = vals if own_values is None else value_rows_bytes(own_values).contiguous()
        vb, s_v = vout.shape[1], vals.stride(0)
    launch(_gather_sum_kernel, grid, rows, index.contiguous(), w, second,
           own_index.contiguous() if two else index, out, vals, own_vals, vout, h, split,
           rows.stride(0) // vec, second.stride(0) // vec, out.stride(0) // vec, s_v,
           K=top_k, HAS_W=weights is not None, MASKED=False, W_BY_ROW=False, TWO_SRC=two,
           HAS_VALS=values is not None, VB=vb, VB_P=next_pow2(max(vb, 1)), BLOCK_C=block,
           VEC=vec, num_warps=4 if block >= 512 else 2)
    return out


def launch_masked_gather_sum(rows: torch.Tensor, table: torch.Tensor,
                             weights: torch.Tensor | None = None, *,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """``moe_fn.pure.dispatch.masked_gather_sum`` in one pass: entries of ``table (R, K)``
    below 0 are absent; ``weights (N,)`` scale the gathered rows. ``rows`` and ``out`` may
    be row-strided views."""
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    r, k = table.shape
    h = rows.shape[1]
    out = _output(out, r, h, rows)
    if r == 0 or h == 0 or k == 0 or rows.shape[0] == 0:
        return out.zero_()
    block = min(_BLOCK_C, next_pow2(h))
    w = table if weights is None else weights.contiguous()
    vec = _vec(rows, rows.stride(0), out.stride(0))
    table = table.contiguous()
    launch(_gather_sum_kernel, (r, cdiv(h, block)),
           rows, table, w, rows, table, out, out, out, out, h, 0, rows.stride(0) // vec,
           rows.stride(0) // vec, out.stride(0) // vec, 0, K=k, HAS_W=weights is not None,
           MASKED=True, W_BY_ROW=True, TWO_SRC=False, HAS_VALS=False, VB=0, VB_P=1,
           BLOCK_C=block, VEC=vec, num_warps=4 if block >= 512 else 2)
    return out


@triton.jit
def _scale_and_dot(d_row, y_row, dst_row, w, H, BLOCK_C: tl.constexpr):
    """One row of a weighting's backward: ``dst = w * d`` and the return value
    ``<d, y>`` (float32), walking the columns in ``BLOCK_C`` chunks."""
    dot = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for c0 in range(0, H, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        m = cols < H
        d = tl.load(d_row + cols, mask=m, other=0.0).to(tl.float32)
        y = tl.load(y_row + cols, mask=m, other=0.0).to(tl.float32)
        dot += d * y
        tl.store(dst_row + cols, (d * w).to(dst_row.dtype.element_ty), mask=m)
    return tl.sum(dot, axis=0)


@triton.jit
def _weighted_gather_sum_bwd_kernel(d_out_ptr, rows_ptr, pos_to_row_ptr, w_ptr, lo_ptr,
                                    hi_ptr, hi_idx_ptr, dw_ptr, H, split, s_d, s_r, s_lo,
                                    s_hi, K: tl.constexpr, HAS_HI_IDX: tl.constexpr,
                                    BLOCK_C: tl.constexpr, VEC: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    r = tl.load(pos_to_row_ptr + p).to(tl.int64)
    t = r // K
    w = tl.load(w_ptr + r).to(tl.float32)
    # Positions below ``split`` go to one buffer (the rows to send), the rest to another
    # (own rows, written straight where they end up, at ``hi_idx`` when given): no copy
    # afterwards.
    q = p - split
    if HAS_HI_IDX:
        q = tl.load(hi_idx_ptr + tl.maximum(q, 0), mask=p >= split, other=0).to(tl.int64)
    dst = tl.where(p < split, lo_ptr + p * (s_lo * VEC), hi_ptr + q * (s_hi * VEC))
    dot = _scale_and_dot(d_out_ptr + t * (s_d * VEC), rows_ptr + p * (s_r * VEC), dst, w, H,
                         BLOCK_C)
    tl.store(dw_ptr + r, dot.to(dw_ptr.dtype.element_ty))


def launch_weighted_gather_sum_bwd(d_out, rows, pos_to_row, weights, top_k: int, *,
                                   split: int | None = None, hi_out=None, hi_index=None,
                                   lo_out=None):
    """``d_rows[p] = w[r] * d_out[r // k]`` and ``d_w[r] = <d_out[r // k], rows[p]>`` for
    ``r = pos_to_row[p]``. Rows ``p < split`` land in ``lo_out`` (``(split, H)``, its
    columns contiguous; new when None), the rest in ``hi_out`` (``(P - split, H)``; new
    when None) or, given ``hi_index``, row ``p`` at ``hi_out[hi_index[p - split]]`` of a
    ``hi_out`` of any length. Returns ``(lo, hi, d_w)``, ``lo`` / ``hi`` being ``lo_out``
    / ``hi_out`` when given."""
    d_out = d_out if d_out.stride(-1) == 1 else d_out.contiguous()
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    p, h = rows.shape
    split = p if split is None else split
    check_split_rows_args(p, split, hi_out, hi_index, lo_out, like=rows)
    lo = rows.new_empty((split, h)) if lo_out is None else lo_out
    hi = rows.new_empty((p - split, h)) if hi_out is None else hi_out
    d_w = torch.empty(p, dtype=weights.dtype, device=rows.device)
    if p == 0:
        return lo, hi, d_w
    if h == 0:
        return lo, hi, d_w.zero_()
    block = min(_BLOCK_C, next_pow2(h))
    # Dummy pointers for an empty side; never dereferenced (no position maps there).
    lo_arg = lo if split else rows
    hi_arg = hi if p - split else rows
    strides = (d_out.stride(0), rows.stride(0), lo_arg.stride(0), hi_arg.stride(0))
    vec = _vec(rows, *strides)
    launch(_weighted_gather_sum_bwd_kernel, (p,),
           d_out, rows, pos_to_row.contiguous(), weights.contiguous(), lo_arg, hi_arg,
           pos_to_row if hi_index is None else hi_index.contiguous(), d_w, h, split,
           *(s // vec for s in strides), K=top_k, HAS_HI_IDX=hi_index is not None,
           BLOCK_C=block, VEC=vec, num_warps=4 if block >= 512 else 2)
    return lo, hi, d_w


@triton.jit
def _gather_row_weight_bwd_kernel(src_ptr, index_ptr, own_ptr, own_tok_ptr, rows_ptr, w_ptr,
                                  out_ptr, dw_ptr, H, split, s_s, s_own, s_r, s_o,
                                  TWO_SRC: tl.constexpr, BLOCK_C: tl.constexpr,
                                  VEC: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    j = tl.load(index_ptr + i).to(tl.int64)
    w = tl.load(w_ptr + i).to(tl.float32)
    d_row = src_ptr + j * (s_s * VEC)
    if TWO_SRC:
        d_row = _two_source_row(j, src_ptr, own_ptr, own_tok_ptr, split, s_s, s_own, VEC)
    dot = _scale_and_dot(d_row, rows_ptr + i * (s_r * VEC), out_ptr + i * (s_o * VEC), w, H,
                         BLOCK_C)
    tl.store(dw_ptr + i, dot.to(dw_ptr.dtype.element_ty))


def launch_gather_row_weight_bwd(src, index, rows, weights, *, own=None, own_tokens=None):
    """With ``d = src[index[i]]`` (the output gradient gathered to expert row i):
    ``d_rows[i] = w[i] * d`` and ``d_w[i] = <d, rows[i]>`` — the row weighting's backward
    fused with the gather that brings the gradient to the rows. Given ``own`` and
    ``own_tokens``, an entry ``j >= len(src)`` reads ``own[own_tokens[j - len(src)]]``
    instead (rows read where they are, never copied behind ``src``). Returns
    ``(d_rows, d_w)``."""
    src = src if src.stride(-1) == 1 else src.contiguous()
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    check_gather_row_weight_args(src, own, own_tokens)
    two = own is not None
    if two:
        own = own if own.stride(-1) == 1 else own.contiguous()
    n, h = rows.shape
    out = rows.new_empty((n, h))
    d_w = torch.empty(n, dtype=weights.dtype, device=rows.device)
    if n == 0:
        return out, d_w
    if h == 0:
        return out, d_w.zero_()
    block = min(_BLOCK_C, next_pow2(h))
    strides = (src.stride(0), (own if two else src).stride(0), rows.stride(0), out.stride(0))
    vec = _vec(rows, *strides)
    launch(_gather_row_weight_bwd_kernel, (n,), src, index.contiguous(),
           own if two else src, own_tokens.contiguous() if two else index, rows,
           weights.contiguous(), out, d_w, h, src.shape[0], *(s // vec for s in strides),
           TWO_SRC=two, BLOCK_C=block, VEC=vec, num_warps=4 if block >= 512 else 2)
    return out, d_w


@triton.jit
def _pack_block(blk, rows_ptr, index_ptr, vals_ptr, vidx_ptr, didx_ptr, out_ptr, vout_ptr,
                N, H, s_r, s_o, s_v, s_vo, tail, HAS_ROWS: tl.constexpr, HAS_IDX: tl.constexpr,
                HAS_VALS: tl.constexpr, HAS_VIDX: tl.constexpr, HAS_DIDX: tl.constexpr,
                VB: tl.constexpr, VB_P: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_C: tl.constexpr, VEC: tl.constexpr):
    # Values are raw bytes: VB of them at ``vals_ptr + j * s_v`` go to ``vout_ptr + o * s_vo
    # + tail`` (a packed row's tail, or a plain array's row when tail is 0).
    i = (blk * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    mi = i < N
    o = i  # the output row
    if HAS_DIDX:
        o = tl.load(didx_ptr + i, mask=mi, other=0).to(tl.int64)
    if HAS_VALS:  # loaded before the rows' copy, so their latency can overlap it
        j = i
        if HAS_VIDX:
            j = tl.load(vidx_ptr + i, mask=mi, other=0).to(tl.int64)
        b = tl.arange(0, VB_P)
        mb = mi[:, None] & (b < VB)[None, :]
        raw = tl.load(vals_ptr + j[:, None] * s_v + b[None, :], mask=mb)
    if HAS_ROWS:
        r = i
        if HAS_IDX:
            r = tl.load(index_ptr + i, mask=mi, other=0).to(tl.int64)
        src = rows_ptr + r[:, None] * (s_r * VEC)
        dst = out_ptr + o[:, None] * (s_o * VEC)
        for c0 in range(0, H, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            m = mi[:, None] & (cols < H)[None, :]
            tl.store(dst + cols[None, :], tl.load(src + cols[None, :], mask=m), mask=m)
    if HAS_VALS:
        tl.store(vout_ptr + o[:, None] * s_vo + tail + b[None, :], raw, mask=mb)


@triton.jit
def _pack_rows_kernel(rows_ptr, index_ptr, vals_ptr, vidx_ptr, didx_ptr, out_ptr, vout_ptr,
                      N, H, s_r, s_o, s_v, s_vo, tail, HAS_ROWS: tl.constexpr,
                      HAS_IDX: tl.constexpr, HAS_VALS: tl.constexpr, HAS_VIDX: tl.constexpr,
                      HAS_DIDX: tl.constexpr, VB: tl.constexpr, VB_P: tl.constexpr,
                      ROWS: tl.constexpr, BLOCK_C: tl.constexpr, VEC: tl.constexpr,
                      PERSISTENT: tl.constexpr):
    # ROWS rows a block (swept with BLOCK_C: bench/RESULTS.md, gather.json): one block per program,
    # or on a capped grid (PERSISTENT) every num_programs-th block.
    if PERSISTENT:
        for blk in range(tl.program_id(0), tl.cdiv(N, ROWS), tl.num_programs(0)):
            _pack_block(blk, rows_ptr, index_ptr, vals_ptr, vidx_ptr, didx_ptr, out_ptr,
                        vout_ptr, N, H, s_r, s_o, s_v, s_vo, tail, HAS_ROWS, HAS_IDX,
                        HAS_VALS, HAS_VIDX, HAS_DIDX, VB, VB_P, ROWS, BLOCK_C, VEC)
    else:
        _pack_block(tl.program_id(0), rows_ptr, index_ptr, vals_ptr, vidx_ptr, didx_ptr,
                    out_ptr, vout_ptr, N, H, s_r, s_o, s_v, s_vo, tail, HAS_ROWS, HAS_IDX,
                    HAS_VALS, HAS_VIDX, HAS_DIDX, VB, VB_P, ROWS, BLOCK_C, VEC)


# Rows per program and columns per step of the packing/gather kernel (from a sweep on an
# H200: bench/RESULTS.md, gather.json).
PACK_ROWS, PACK_BLOCK_C, PACK_WARPS = 4, 1024, 8


def launch_gather_rows(src, index, out=None, *, rows_per_program=None, block_c=None,
                       num_warps=None):
    """``out[i] = src[index[i]]``; ``src`` and ``out`` may be row-strided views."""
    src = src if src.stride(-1) == 1 else src.contiguous()
    out = _output(out, index.numel(), src.shape[1], src)
    return _launch_pack(src, index, None, None, out, 0, rows_per_program, block_c,
                        num_warps)


def launch_copy_rows(src, index, out, out_index=None, *, values=None, values_index=None,
                     values_out=None, num_programs=None):
    """``out[out_index[i]] = src[index[i]]`` (``src[i]`` without ``index``, ``out[i]``
    without ``out_index``; one of them given) for every entry, and in the same pass
    ``values_out[out_index[i]] = values[values_index[i]]`` when values are given (as raw
    bytes); ``num_programs`` caps the grid. ``src``, ``out`` and ``values`` may be
    row-strided views; ``out``'s columns must be contiguous."""
    n = check_copy_rows_args(src, index, out, out_index, values, values_index, values_out)
    if out.stride(-1) != 1:
        raise ValueError(f"out's columns must be contiguous, got strides {out.stride()}")
    if src.stride(-1) != 1:
        src = src.contiguous()
    vals = None if values is None else value_rows_bytes(values)
    vout = None if values is None else values_out.view(torch.uint8)
    _launch_pack(src, index, vals, values_index, out, 0, None, None, None, num_rows=n,
                 out_index=None if out_index is None else out_index.contiguous(),
                 num_programs=num_programs, values_out=vout)
    return out


def launch_pack_rows(rows, index, values, values_index, out, tail: int, *,
                     rows_per_program=None, block_c=None, num_warps=None):
    """One pass over packed rows ``out (n, W)`` (rows contiguous, W wider than the rows):
    ``out[i, :H] = rows[index[i]]`` (unless ``rows`` is None) and row i's bytes
    ``[tail, tail + values' row bytes)`` = ``values[values_index[i]]`` (``values[i]`` when
    ``values_index`` is None), copied as raw bytes."""
    n = out.shape[0]
    if out.stride(-1) != 1 or (n > 1 and out.stride(0) != out.shape[1]):
        raise ValueError(f"out must hold whole packed rows, got strides {out.stride()}")
    vals = value_rows_bytes(values).contiguous()
    if tail < 0 or tail + vals.shape[1] > out.shape[1] * out.element_size():
        raise ValueError(f"the values' {vals.shape[1]} bytes at {tail} do not fit a packed "
                         f"row of {out.shape[1] * out.element_size()} bytes")
    if rows is not None:
        if rows.dtype != out.dtype or rows.shape[1] * out.element_size() > tail:
            raise ValueError(f"rows ({rows.dtype}, {rows.shape[1]} wide) must be of out's "
                             f"dtype {out.dtype} and end before the values at byte {tail}")
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
    return _launch_pack(rows, index, vals, values_index, out, tail, rows_per_program,
                        block_c, num_warps)


def _launch_pack(rows, index, vals, values_index, out, tail, rows_per_program, block_c,
                 num_warps, *, num_rows=None, out_index=None, num_programs=None,
                 values_out=None):
    """The one launch behind the gathers, copies and packing. Values (bytes, ``vals``) go
    to ``values_out`` rows when given, else to the tails of ``out``'s packed rows."""
    n = out.shape[0] if num_rows is None else num_rows
    if n == 0:
        return out
    h = 0 if rows is None else rows.shape[1]
    per = rows_per_program or PACK_ROWS
    block = min(block_c or PACK_BLOCK_C, next_pow2(max(h, 1)))
    src = out if rows is None else rows
    vec = _vec(out, src.stride(0), out.stride(0))
    vb = 0 if vals is None else vals.shape[1]
    if vals is None:
        vout, s_vo = out, 0
    elif values_out is None:
        vout, s_vo = out.view(torch.uint8), out.stride(0) * out.element_size()
    else:
        vout, s_vo = values_out, values_out.stride(0)
    dummy = out
    blocks = cdiv(n, per)
    grid = blocks if num_programs is None else max(1, min(num_programs, blocks))
    launch(_pack_rows_kernel, (grid,),
           src, dummy if index is None else index.contiguous(),
           dummy if vals is None else vals,
           dummy if values_index is None else values_index.contiguous(),
           dummy if out_index is None else out_index, out, vout, n, h, src.stride(0) // vec,
           out.stride(0) // vec, 0 if vals is None else vals.stride(0), s_vo, tail,
           HAS_ROWS=rows is not None, HAS_IDX=index is not None,
           HAS_VALS=vals is not None, HAS_VIDX=values_index is not None,
           HAS_DIDX=out_index is not None, VB=vb, VB_P=next_pow2(max(vb, 1)),
           ROWS=per, BLOCK_C=block, VEC=vec,
           PERSISTENT=grid < blocks, num_warps=num_warps or PACK_WARPS)
    return out
