"""Triton kernels that read rows straight out of other GPUs' memory (for
``moe_fn.comm.peer_memory`` and ``moe_fn.comm.symm_mem``).

Each rank exposes a tensor of rows (and optionally one value per row) in memory every
rank can address (torch symmetric memory over NVLink); a *pull* then builds its output in
final order in one pass, reading each row from whichever rank holds it. That removes the
send-side gather, the collective's copies and the arrival gather of an all_to_all. The
token pull reads a token once per rank and writes all its expert rows there; for the
combine, ``slot_sum`` sums each token's rows where they were computed (into the exposed
buffer) and ``pull_partials`` adds the partials at the token's home.

Peers are addressed by element offsets from one local tensor (``ref``): the kernels add
``delta[rank] + row * row_stride`` to ``ref``'s pointer. The offsets are checked to be
multiples of ``VEC`` elements (up to 16 bytes) and row strides are passed in units of
``VEC`` (as in ``gather_sum``), so Triton can still vectorise the row copies, which it
cannot for a pointer loaded from memory. The offsets can be given (symmetric memory:
one table per buffer) or are derived from the peer tensors. Under ``TRITON_INTERPRET=1``
the same kernels run on CPU tensors, where the "peers" are ordinary tensors of one
process.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pure.dispatch import PEER_MAX_RANKS
from ._launch import cdiv, launch, next_pow2
from .gather_sum import _vec

_BLOCK_C = 2048
# Rows per program step of the pull, tokens per step of the combine's sums, and warps,
# from a sweep on two H200s (bench/RESULTS.md): with the whole GPU, and for the partials'
# pull on the few SMs an overlapped backward combine gets, where each program needs more
# reads in flight.
PULL_ROWS, PULL_WARPS = 16, 8
SUM_TOKENS, SUM_BLOCK_C, SUM_WARPS = 2, 1024, 8
# (The combine's partial pull on 12 / 20 / 24 programs: 32 tokens a step and 16 warps took
# 0.58 / 0.41 / 0.34 ms, 8 tokens 0.76 / 0.50 / 0.45, the whole GPU 0.30-0.33.)
FEW_SMS_SUM_TOKENS, FEW_SMS_SUM_WARPS = 32, 16
# The token-once pull (each token read once, written up to K times): tokens per program
# step, columns, warps and programs per SM, from a sweep on two H200s (bench/RESULTS.md:
# 0.200 ms against 0.215-0.237 for the other shapes tried, the row-by-row pull 0.507).
PULL_TOKENS, PULL_TOKENS_BLOCK_C, PULL_TOKENS_WARPS, PULL_TOKENS_PER_SM = 4, 1024, 8, 8
_DELTAS: dict = {}


@triton.jit
def _pull_rows_kernel(ref, rows_delta, vref, vals_delta, rank_ptr, idx_ptr, out_ptr, vout_ptr,
                      n, width, s_r, s_o, ROW_DIV: tl.constexpr, HAS_ROWS: tl.constexpr,
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
            src = ref + (d + (j // ROW_DIV) * (s_r * VEC))[:, None]
            dst = out_ptr + (i.to(tl.int64) * (s_o * VEC))[:, None]
            for c0 in range(0, width, BLOCK_C):
                cols = c0 + tl.arange(0, BLOCK_C)
                m = mi[:, None] & (cols < width)[None, :]
                tl.store(dst + cols[None, :], tl.load(src + cols[None, :], mask=m), mask=m)
        if HAS_VALS:
            tl.store(vout_ptr + i, v, mask=mi)


@triton.jit
def _slot_groups(slots_ptr, start, n_groups, K: tl.constexpr, SEGS: tl.constexpr):
    """Groups ``g = start + [0, SEGS)`` of a (group, K) slot table, and which of them have a
    slot (>= 0): the only ones worth reading or writing."""
    g = (start + tl.arange(0, SEGS)).to(tl.int64)
    used = tl.zeros((SEGS,), dtype=tl.int1)
    for q in tl.static_range(K):
        used = used | (tl.load(slots_ptr + g * K + q, mask=g < n_groups, other=-1) >= 0)
    return g, used


@triton.jit
def _pull_token_rows_kernel(ref, rows_delta, vref, vals_delta, slots_ptr, out_ptr, vout_ptr,
                            n_groups, max_tokens, width, s_r, s_o, K: tl.constexpr,
                            HAS_VALS: tl.constexpr, SEGS: tl.constexpr, BLOCK_C: tl.constexpr,
                            VEC: tl.constexpr):
    # Group g = (rank s, token t) has K slots: the output rows copying that token (-1 where
    # none). Its row is read once (over NVLink for a peer's) and stored to each of them.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for start in range(pid * SEGS, n_groups, nprog * SEGS):
        g, used = _slot_groups(slots_ptr, start, n_groups, K, SEGS)
        s = g // max_tokens
        t = g - s * max_tokens
        d = tl.multiple_of(tl.load(rows_delta + s, mask=used, other=0), VEC)
        src = ref + (d + t * (s_r * VEC))[:, None]
        for c0 in range(0, width, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            mc = (cols < width)[None, :]
            x = tl.load(src + cols[None, :], mask=used[:, None] & mc)
            for q in tl.static_range(K):
                i = tl.load(slots_ptr + g * K + q, mask=used, other=-1).to(tl.int64)
                tl.store(out_ptr + (i * (s_o * VEC))[:, None] + cols[None, :], x,
                         mask=(i >= 0)[:, None] & mc)
        if HAS_VALS:  # values are per output row: one read each, at (t, q) of rank s
            vd = tl.load(vals_delta + s, mask=used, other=0)
            for q in tl.static_range(K):
                i = tl.load(slots_ptr + g * K + q, mask=used, other=-1).to(tl.int64)
                v = tl.load(vref + vd + t * K + q, mask=i >= 0)
                tl.store(vout_ptr + i, v, mask=i >= 0)


@triton.jit
def _slot_sum_kernel(y_ptr, w_ptr, slots_ptr, out_ptr, n_groups, width, s_y, s_o,
                     K: tl.constexpr, HAS_W: tl.constexpr, SEGS: tl.constexpr,
                     BLOCK_C: tl.constexpr, VEC_Y: tl.constexpr, VEC_O: tl.constexpr):
    # out[g] = sum_q [w[i] *] y[i] over the slots i = slots[g, q] >= 0, in float32; groups
    # without a slot are not written (nobody reads them).
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for start in range(pid * SEGS, n_groups, nprog * SEGS):
        g, used = _slot_groups(slots_ptr, start, n_groups, K, SEGS)
        for c0 in range(0, width, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            mc = (cols < width)[None, :]
            acc = tl.zeros((SEGS, BLOCK_C), dtype=tl.float32)
            for q in tl.static_range(K):
                i = tl.load(slots_ptr + g * K + q, mask=used, other=-1).to(tl.int64)
                v = tl.load(y_ptr + (i * (s_y * VEC_Y))[:, None] + cols[None, :],
                            mask=(i >= 0)[:, None] & mc, other=0.0).to(tl.float32)
                if HAS_W:
                    v = v * tl.load(w_ptr + i, mask=i >= 0, other=0.0).to(tl.float32)[:, None]
                acc += v
            tl.store(out_ptr + (g * (s_o * VEC_O))[:, None] + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=used[:, None] & mc)


@triton.jit
def _pull_partials_kernel(ref, rows_delta, vref, vals_delta, rank_ptr, vpos_ptr, out_ptr,
                          vout_ptr, n_tok, me, max_tokens, width, s_r, s_o, K: tl.constexpr,
                          EP: tl.constexpr, HAS_VALS: tl.constexpr, TOK: tl.constexpr,
                          BLOCK_C: tl.constexpr, VEC: tl.constexpr, VEC_O: tl.constexpr):
    # out[t] = sum over the ranks o computing any of token t's rows of o's partial for
    # (this rank, t), read from o's exposed partials at row me * max_tokens + t.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for start in range(pid * TOK, n_tok, nprog * TOK):
        t = (start + tl.arange(0, TOK)).to(tl.int64)
        mt = t < n_tok
        # The ranks holding any of each token's rows, as bits (read once, not per column).
        ranks = tl.zeros((TOK,), dtype=tl.int64)
        for j in tl.static_range(K):
            r = tl.load(rank_ptr + t * K + j, mask=mt, other=0).to(tl.int64)
            ranks = ranks | tl.where(mt, tl.full((TOK,), 1, tl.int64) << r, 0)
        for c0 in range(0, width, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            m = mt[:, None] & (cols < width)[None, :]
            acc = tl.zeros((TOK, BLOCK_C), dtype=tl.float32)
            for o in tl.static_range(EP):
                here = ((ranks >> o) & 1) != 0
                d = tl.multiple_of(tl.load(rows_delta + o), VEC)
                src = ref + (d + (me * max_tokens + t) * (s_r * VEC))[:, None]
                acc += tl.load(src + cols[None, :], mask=m & here[:, None],
                               other=0.0).to(tl.float32)
            tl.store(out_ptr + (t * (s_o * VEC_O))[:, None] + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=m)
        if HAS_VALS:
            for j in tl.static_range(K):
                s = tl.load(rank_ptr + t * K + j, mask=mt, other=0)
                p = tl.load(vpos_ptr + t * K + j, mask=mt, other=0).to(tl.int64)
                vd = tl.load(vals_delta + s, mask=mt, other=0)
                tl.store(vout_ptr + t * K + j, tl.load(vref + vd + p, mask=mt), mask=mt)


def element_offsets(byte_offsets, element_size: int, device) -> torch.Tensor:
    """Byte offsets between peer tensors as element offsets (an int64 tensor on ``device``,
    what the kernels add to their reads)."""
    if any(b % element_size for b in byte_offsets):
        raise ValueError(f"peer tensors must lie a whole number of elements apart, got byte "
                         f"offsets {list(byte_offsets)}")
    return torch.tensor([b // element_size for b in byte_offsets], dtype=torch.int64,
                        device=device)


def deltas(peers, rank: int) -> torch.Tensor:
    """Element offsets of every peer tensor from ``peers[rank]`` as an int64 tensor on its
    device, cached by the tensors' addresses (the exposed regions stay where they are)."""
    ref = peers[rank]
    key = (ref.device, ref.dtype, tuple(p.data_ptr() for p in peers), rank)
    d = _DELTAS.get(key)
    if d is None:
        d = element_offsets([p.data_ptr() - ref.data_ptr() for p in peers],
                            ref.element_size(), ref.device)
        if len(_DELTAS) > 64:
            _DELTAS.clear()
        _DELTAS[key] = d
    return d


def _peer_args(peers, rank, name, offsets):
    ref = peers[rank]
    for p in peers:
        if (p.dtype != ref.dtype or p.device != ref.device or p.shape[1:] != ref.shape[1:]
                or not p.is_contiguous()):
            got = [(tuple(q.shape), q.dtype, q.is_contiguous()) for q in peers]
            raise ValueError(f"{name} must be contiguous tensors of one dtype, device and row "
                             f"width, got {got}")
    return ref, (offsets if offsets is not None else deltas(peers, rank))


def _aligned_vec(ref, byte_offsets, *strides) -> int:
    """``_vec`` over the row strides, lowered until the peers' offsets are multiples too."""
    vec = _vec(ref, *strides)
    while vec > 1 and any(b % (vec * ref.element_size()) for b in byte_offsets):
        vec //= 2
    return vec


def _index(t):
    return t if t.is_contiguous() else t.contiguous()


def launch_pull_rows(rows, values, rank: int, src_rank, src_idx, *, row_div: int = 1,
                     num_programs: int, rows_offsets=None, values_offsets=None,
                     byte_offsets=None):
    """``out[i] = rows[src_rank[i]][src_idx[i] // row_div]`` and, with ``values``,
    ``vout[i] = values[src_rank[i]][src_idx[i]]``. ``rows``/``values``: one contiguous
    tensor per rank (this process addresses all of them), either may be None; ``rank`` is
    this rank's index. ``*_offsets``: the peers' element offsets from this rank's tensor
    (``deltas``), and ``byte_offsets`` the rows' in bytes, when the caller knows them.
    Returns ``(out (n, width) or None, vout (n,) or None)``."""
    n = src_idx.numel()
    if src_rank.numel() != n:
        raise ValueError(f"src_rank and src_idx must have one entry per row, got "
                         f"{src_rank.numel()} and {n}")
    src_rank, src_idx = _index(src_rank), _index(src_idx)
    out = vout = None
    if rows is not None:
        ref, rows_offsets = _peer_args(rows, rank, "rows", rows_offsets)
        width = ref.shape[1]
        out = ref.new_empty((n, width))
    if values is not None:
        vref, values_offsets = _peer_args(values, rank, "values", values_offsets)
        vout = vref.new_empty(n)
    if n == 0 or (rows is None and values is None):
        return out, vout
    if rows is None:
        ref, width, vec, rows_offsets = vref, 0, 1, values_offsets
    else:
        if byte_offsets is None:
            byte_offsets = [p.data_ptr() - ref.data_ptr() for p in rows]
        vec = _aligned_vec(ref, byte_offsets, width)
    if values is None:
        vref, values_offsets = ref, rows_offsets
    block = min(_BLOCK_C, next_pow2(max(width, 1)))
    dummy = out if out is not None else vout
    per = PULL_ROWS
    launch(_pull_rows_kernel, (max(1, min(num_programs, cdiv(n, per))),),
           ref, rows_offsets, vref, values_offsets, src_rank, src_idx, dummy,
           vout if vout is not None else dummy, n, width, width // vec, width // vec,
           ROW_DIV=row_div, HAS_ROWS=rows is not None, HAS_VALS=values is not None, ROWS=per,
           BLOCK_C=block, VEC=vec,
           num_warps=PULL_WARPS if block >= 1024 else 4)
    return out, vout


def launch_pull_token_rows(rows, values, rank: int, token_slots, num_rows: int, top_k: int,
                           *, num_programs: int, tokens_per_program: int | None = None,
                           rows_offsets=None, values_offsets=None, byte_offsets=None):
    """``out[i] = rows[s][t]`` and, with ``values``, ``vout[i] = values[s][t * top_k + j]``
    for every output row ``i = token_slots[(s * T + t) * top_k + j]`` (``T`` =
    ``rows[0].shape[0]``; -1 slots are skipped), reading each token row once however many
    output rows copy it. Every one of the ``num_rows`` outputs must have one slot.
    ``rows`` is required; offsets as in ``launch_pull_rows``."""
    ref, rows_offsets = _peer_args(rows, rank, "rows", rows_offsets)
    max_tokens, width = ref.shape
    n_groups = len(rows) * max_tokens
    if top_k < 1 or token_slots.numel() != n_groups * top_k:
        raise ValueError(f"token_slots must hold top_k ({top_k}) slots for each of the "
                         f"{len(rows)} ranks' {max_tokens} tokens, got {token_slots.numel()}")
    out = ref.new_empty((num_rows, width))
    vout = None
    if values is not None:
        vref, values_offsets = _peer_args(values, rank, "values", values_offsets)
        if vref.shape[0] < max_tokens * top_k:
            raise ValueError(f"values must hold top_k ({top_k}) entries per token row, got "
                             f"{vref.shape[0]} for {max_tokens} tokens")
        vout = vref.new_empty(num_rows)
    else:
        vref, values_offsets = ref, rows_offsets
    if num_rows == 0 or n_groups == 0:
        return out, vout
    if byte_offsets is None:
        byte_offsets = [p.data_ptr() - ref.data_ptr() for p in rows]
    vec = _aligned_vec(ref, byte_offsets, width)
    block = min(PULL_TOKENS_BLOCK_C, next_pow2(max(width, 1)))
    segs = tokens_per_program or PULL_TOKENS
    launch(_pull_token_rows_kernel, (max(1, min(num_programs, cdiv(n_groups, segs))),),
           ref, rows_offsets, vref, values_offsets, _index(token_slots), out,
           vout if vout is not None else out, n_groups, max_tokens, width, width // vec,
           width // vec, K=top_k, HAS_VALS=values is not None, SEGS=segs, BLOCK_C=block,
           VEC=vec, num_warps=PULL_TOKENS_WARPS if block >= 1024 else 4)
    return out, vout


def launch_slot_sum(rows, token_slots, top_k: int, out, weights=None, *, num_programs: int,
                    tokens_per_program: int | None = None):
    """``out[g] = sum_j [weights[i] *] rows[i]`` over ``i = token_slots[g * top_k + j] >= 0``
    (float32 accumulation, stored in ``out``'s dtype) for every group ``g`` with a slot;
    the others' rows of ``out`` are left as they are. ``out (G, width)`` may be a view with
    any row stride (an exposed buffer)."""
    n_groups = token_slots.numel() // max(top_k, 1)
    if top_k < 1 or token_slots.numel() != n_groups * top_k or out.shape[0] < n_groups:
        raise ValueError(f"token_slots must hold top_k ({top_k}) slots per group and out one "
                         f"row per group, got {token_slots.numel()} slots, {out.shape[0]} rows")
    width = rows.shape[1]
    if (out.dim() != 2 or out.shape[1] != width or out.stride(-1) != 1 or rows.dim() != 2
            or rows.stride(-1) != 1 or out.device != rows.device):
        raise ValueError(f"rows and out must be (*, {width}) with contiguous columns on one "
                         f"device, got {tuple(rows.shape)} and {tuple(out.shape)}")
    if n_groups == 0 or rows.shape[0] == 0:
        return out
    vec_y, vec_o = _vec(rows, width, rows.stride(0)), _vec(out, width, out.stride(0))
    block = min(SUM_BLOCK_C, next_pow2(max(width, 1)))
    segs = tokens_per_program or SUM_TOKENS
    launch(_slot_sum_kernel, (max(1, min(num_programs, cdiv(n_groups, segs))),), rows,
           weights.contiguous() if weights is not None else rows, _index(token_slots), out,
           n_groups, width, rows.stride(0) // vec_y, out.stride(0) // vec_o, K=top_k,
           HAS_W=weights is not None, SEGS=segs, BLOCK_C=block, VEC_Y=vec_y, VEC_O=vec_o,
           num_warps=SUM_WARPS if block >= 512 else 4)
    return out


def launch_pull_partials(partials, values, rank: int, home_rank, values_pos, top_k: int,
                         max_tokens: int, out_dtype, *, num_programs: int,
                         tokens_per_program: int | None = None, num_warps: int | None = None,
                         rows_offsets=None, values_offsets=None, byte_offsets=None):
    """``out[t] = sum_o partials[o][rank * max_tokens + t]`` over the ranks ``o`` among
    ``home_rank[t*k:(t+1)*k]`` (each once; float32 accumulation, ``out_dtype`` output), and
    with ``values`` ``vout[i] = values[home_rank[i]][values_pos[i]]``: the combine of the
    expert side's per-token partials (``launch_slot_sum``). Offsets as in
    ``launch_pull_rows``."""
    ref, rows_offsets = _peer_args(partials, rank, "partials", rows_offsets)
    width = ref.shape[1]
    n = home_rank.numel()
    if len(partials) > PEER_MAX_RANKS:
        raise ValueError(f"at most {PEER_MAX_RANKS} ranks, got {len(partials)}")
    if ref.shape[0] < len(partials) * max_tokens:
        raise ValueError(f"partials must hold a row per (rank, token): {len(partials)} ranks "
                         f"of {max_tokens} tokens, got {ref.shape[0]} rows")
    if values is not None and values_pos is None:
        raise ValueError("values need values_pos: each (token, k) value's position at its rank")
    if top_k < 1 or n % top_k or (values_pos is not None and values_pos.numel() != n):
        raise ValueError(f"home_rank (and values_pos) must hold top_k ({top_k}) entries per "
                         f"token, got {n}")
    n_tok = n // top_k
    out = torch.empty((n_tok, width), dtype=out_dtype, device=ref.device)
    vout = None
    if values is not None:
        vref, values_offsets = _peer_args(values, rank, "values", values_offsets)
        vout = vref.new_empty(n)
    else:
        vref, values_offsets = ref, rows_offsets
    if n_tok == 0:
        return out, vout
    if byte_offsets is None:
        byte_offsets = [p.data_ptr() - ref.data_ptr() for p in partials]
    vec, vec_o = _aligned_vec(ref, byte_offsets, width), _vec(out, width)
    block = min(SUM_BLOCK_C, next_pow2(max(width, 1)))
    tok = tokens_per_program or SUM_TOKENS
    home_rank = _index(home_rank)
    launch(_pull_partials_kernel, (max(1, min(num_programs, cdiv(n_tok, tok))),),
           ref, rows_offsets, vref, values_offsets, home_rank,
           _index(values_pos) if values_pos is not None else home_rank, out,
           vout if vout is not None else out, n_tok, rank, max_tokens, width, width // vec,
           width // vec_o, K=top_k, EP=len(partials), HAS_VALS=values is not None, TOK=tok,
           BLOCK_C=block, VEC=vec, VEC_O=vec_o,
           num_warps=num_warps or (SUM_WARPS if block >= 512 else 4))
    return out, vout
