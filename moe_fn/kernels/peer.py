"""Triton kernels that read rows straight out of other GPUs' memory (``moe_fn.comm.peer``).

Each rank exposes a tensor of rows (and optionally one value per row) in memory every
rank can address (torch symmetric memory over NVLink); a *pull* then builds its output in
final order in one pass, reading each row from whichever rank holds it. That removes the
send-side gather, the collective's copies and the arrival gather of an all_to_all.

Peers are addressed by element offsets from one local tensor (``ref``): the kernels add
``delta[rank] + row * width`` to ``ref``'s pointer. The offsets are kept multiples of 16
bytes (checked), so Triton can still vectorise the row copies, which it cannot for a
pointer loaded from memory. Under ``TRITON_INTERPRET=1`` the same kernels run on CPU
tensors, where the "peers" are ordinary tensors of one process.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, launch, next_pow2

_BLOCK_C = 2048
# Rows per program step of the pull, tokens per step of the pull-sum, and warps, from a
# sweep on two H200s (bench/RESULTS.md): with the whole GPU, and on the few SMs an
# overlapped backward combine gets, where each program needs more reads in flight.
PULL_ROWS, PULL_WARPS = 16, 8
SUM_TOKENS, SUM_BLOCK_C, SUM_WARPS = 2, 1024, 8
FEW_SMS_PULL_WARPS = 16
FEW_SMS_SUM_TOKENS, FEW_SMS_SUM_WARPS = 8, 16
_DELTAS: dict = {}


@triton.jit
def _pull_rows_kernel(ref, rows_delta, vref, vals_delta, rank_ptr, idx_ptr, out_ptr, vout_ptr,
                      n, width, s_o, ROW_DIV: tl.constexpr, HAS_ROWS: tl.constexpr,
                      HAS_VALS: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
                      VEC: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for start in range(pid * ROWS, n, nprog * ROWS):
        i = start + tl.arange(0, ROWS)
        mi = i < n
        s = tl.load(rank_ptr + i, mask=mi, other=0)
        j = tl.load(idx_ptr + i, mask=mi, other=0).to(tl.int64)
        if HAS_VALS:  # loaded first so that their latency overlaps the rows' copy
            vd = tl.load(vals_delta + s, mask=mi, other=0)
            v = tl.load(vref + vd + j, mask=mi)
        if HAS_ROWS:
            d = tl.multiple_of(tl.load(rows_delta + s, mask=mi, other=0), VEC)
            src = ref + (d + (j // ROW_DIV) * width)[:, None]
            dst = out_ptr + (i.to(tl.int64) * s_o)[:, None]
            for c0 in range(0, width, BLOCK_C):
                cols = c0 + tl.arange(0, BLOCK_C)
                m = mi[:, None] & (cols < width)[None, :]
                tl.store(dst + cols[None, :], tl.load(src + cols[None, :], mask=m), mask=m)
        if HAS_VALS:
            tl.store(vout_ptr + i, v, mask=mi)


@triton.jit
def _pull_gather_sum_kernel(ref, rows_delta, vref, vals_delta, local_ptr, me, rank_ptr,
                            pos_ptr, vpos_ptr, w_ptr, out_ptr, vout_ptr, n_tok, width, s_l,
                            s_o, K: tl.constexpr, HAS_W: tl.constexpr, HAS_VALS: tl.constexpr,
                            TOK: tl.constexpr, BLOCK_C: tl.constexpr, VEC: tl.constexpr):
    # TOK tokens a step, so that K * TOK rows are in flight per program (reads over
    # NVLink have microseconds of latency). Rows of rank ``me`` are read from
    # ``local_ptr`` (row stride ``s_l``), the others from the peers' exposed rows.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for start in range(pid * TOK, n_tok, nprog * TOK):
        t = (start + tl.arange(0, TOK)).to(tl.int64)
        mt = t < n_tok
        for c0 in range(0, width, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            m = mt[:, None] & (cols < width)[None, :]
            acc = tl.zeros((TOK, BLOCK_C), dtype=tl.float32)
            for j in tl.static_range(K):
                s = tl.load(rank_ptr + t * K + j, mask=mt, other=0)
                p = tl.load(pos_ptr + t * K + j, mask=mt, other=0).to(tl.int64)
                d = tl.multiple_of(tl.load(rows_delta + s, mask=mt, other=0), VEC)
                src = tl.where((s == me)[:, None], local_ptr + (p * s_l)[:, None],
                               ref + (d + p * width)[:, None])
                v = tl.load(src + cols[None, :], mask=m, other=0.0).to(tl.float32)
                if HAS_W:
                    v = v * tl.load(w_ptr + t * K + j, mask=mt, other=0.0).to(tl.float32)[:, None]
                acc += v
            tl.store(out_ptr + (t * s_o)[:, None] + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=m)
        if HAS_VALS:
            for j in tl.static_range(K):
                s = tl.load(rank_ptr + t * K + j, mask=mt, other=0)
                p = tl.load(vpos_ptr + t * K + j, mask=mt, other=0).to(tl.int64)
                vd = tl.load(vals_delta + s, mask=mt, other=0)
                tl.store(vout_ptr + t * K + j, tl.load(vref + vd + p, mask=mt), mask=mt)


def _deltas(peers, rank: int, vec: int) -> torch.Tensor:
    """Element offsets of every peer tensor from ``peers[rank]`` as an int64 tensor on its
    device, cached: the exposed regions stay where they are between calls."""
    ref = peers[rank]
    key = (ref.device, ref.dtype, tuple(p.data_ptr() for p in peers), rank)
    d = _DELTAS.get(key)
    if d is None:
        es = ref.element_size()
        diffs = [p.data_ptr() - ref.data_ptr() for p in peers]
        if any(x % (es * vec) for x in diffs):
            raise ValueError(f"peer regions must lie a multiple of {es * vec} bytes apart, got "
                             f"offsets {diffs}")
        d = torch.tensor([x // es for x in diffs], dtype=torch.int64, device=ref.device)
        if len(_DELTAS) > 64:  # regions are re-allocated only when a buffer grows
            _DELTAS.clear()
        _DELTAS[key] = d
    return d


def _vec(width: int, t: torch.Tensor) -> int:
    v = max(1, 16 // t.element_size())
    while v > 1 and width % v:
        v //= 2
    return v


def launch_pull_rows(rows, values, rank: int, src_rank, src_idx, *, row_div: int = 1,
                     num_programs: int, rows_per_program: int | None = None,
                     num_warps: int | None = None):
    """``out[i] = rows[src_rank[i]][src_idx[i] // row_div]`` and, with ``values``,
    ``vout[i] = values[src_rank[i]][src_idx[i]]``. ``rows``/``values``: one contiguous
    tensor per rank (this process addresses all of them), either may be None; ``rank`` is
    this rank's index. Returns ``(out (n, width) or None, vout (n,) or None)``."""
    n = src_idx.numel()
    out = rows[rank].new_empty((n, rows[rank].shape[1])) if rows is not None else None
    vout = values[rank].new_empty(n) if values is not None else None
    if n == 0 or (rows is None and values is None):
        return out, vout
    if rows is not None:
        ref, width = rows[rank], rows[rank].shape[1]
        vec = _vec(width, ref)
        deltas = _deltas(rows, rank, vec)
    else:
        ref, width, vec = values[rank], 0, 1
        deltas = _deltas(values, rank, 1)
    vref = values[rank] if values is not None else ref
    vdeltas = _deltas(values, rank, 1) if values is not None else deltas
    block = min(_BLOCK_C, next_pow2(max(width, 1)))
    dummy = out if out is not None else vout
    per = rows_per_program or PULL_ROWS
    launch(_pull_rows_kernel, (max(1, min(num_programs, cdiv(n, per))),),
           ref, deltas, vref, vdeltas, src_rank, src_idx, dummy,
           vout if vout is not None else dummy, n, width, width, ROW_DIV=row_div,
           HAS_ROWS=rows is not None, HAS_VALS=values is not None, ROWS=per, BLOCK_C=block,
           VEC=vec, num_warps=num_warps or (PULL_WARPS if block >= 1024 else 4))
    return out, vout


def launch_pull_gather_sum(rows, values, rank: int, src_rank, src_pos, top_k: int,
                           weights=None, *, local=None, values_pos=None, num_programs: int,
                           tokens_per_program: int | None = None, block_c: int | None = None,
                           num_warps: int | None = None):
    """``out[t] = sum_j [weights[t*k+j] *] row(t*k+j)`` (float32 accumulation) where
    ``row(i) = rows[src_rank[i]][src_pos[i]]``, or ``local[src_pos[i]]`` when
    ``src_rank[i]`` is ``rank`` and ``local`` is given (rows this rank never exposed);
    with ``values``, ``vout[i] = values[src_rank[i]][values_pos[i]]`` (default
    ``src_pos``)."""
    ref = rows[rank]
    width = ref.shape[1]
    n_tok = src_pos.numel() // top_k
    out = ref.new_empty((n_tok, width))
    vout = values[rank].new_empty(n_tok * top_k) if values is not None else None
    if n_tok == 0:
        return out, vout
    if local is not None and (local.shape[1] != width or local.stride(-1) != 1
                              or local.dtype != ref.dtype):
        raise ValueError(f"local rows must be (*, {width}) {ref.dtype} with contiguous "
                         f"columns, got {tuple(local.shape)} {local.dtype}")
    vec = _vec(width, ref)
    deltas = _deltas(rows, rank, vec)
    vref = values[rank] if values is not None else ref
    vdeltas = _deltas(values, rank, 1) if values is not None else deltas
    local_arg = local if local is not None else ref
    if local_arg.stride(0) % vec:
        vec = 1
    block = min(block_c or SUM_BLOCK_C, next_pow2(max(width, 1)))
    tok = tokens_per_program or SUM_TOKENS
    launch(_pull_gather_sum_kernel, (max(1, min(num_programs, cdiv(n_tok, tok))),),
           ref, deltas, vref, vdeltas, local_arg, rank if local is not None else -1,
           src_rank, src_pos, values_pos if values_pos is not None else src_pos,
           weights if weights is not None else src_pos, out,
           vout if vout is not None else out, n_tok, width, local_arg.stride(0), width,
           K=top_k, HAS_W=weights is not None, HAS_VALS=values is not None, TOK=tok,
           BLOCK_C=block, VEC=vec, num_warps=num_warps or (SUM_WARPS if block >= 512 else 4))
    return out, vout
