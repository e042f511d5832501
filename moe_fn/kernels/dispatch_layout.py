"""Triton kernels of the dispatch layout (``moe_fn.pure.dispatch.layout`` is the contract):
the per-expert counts, their int32 cumulative ends and a stable sort of the flattened
``(token, k)`` rows by expert, with its inverse, in two or three launches instead of ~13
ops.

The rows are cut into chunks of ``CHUNK``. Chunk ``c``'s rows of expert ``e`` land, in row
order, at the sorted positions ``start[e] + sum_{c' < c} hist[c', e] + (0, 1, ...)``, where
``start`` is the exclusive prefix sum of the counts; sorting the keys ``e * CHUNK + i``
within a chunk (unique keys, so the sort is stable for free) puts the ``hist[c, e]`` rows
of expert ``e`` after the ``local[c, e] = sum_{e' < e} hist[c, e']`` rows of smaller
experts, so sorted slot ``j`` goes to ``delta[c, e] + j`` with
``delta = start + sum_{c' < c} hist[c', :] - local``.

1. ``_hist_kernel`` (a program per chunk): ``hist[c, :]``.
2. ``_scan_kernel`` (a program per block of experts): in place, ``hist`` becomes its
   exclusive prefix sum over chunks; the column totals are ``counts``. For a small table
   (training shapes up to 64K rows at E = 128) this launch is skipped and every scatter
   program sums the table itself.
3. ``_scatter_kernel`` (a program per chunk): ``start`` from ``counts`` and ``local`` from
   the chunk's own histogram (both in registers; program 0 also writes ``offs``), sort the
   keys, write ``perm``, ``inv_perm`` and ``token_of_sorted`` (``perm // k``, which the
   caller would otherwise compute in another launch).

Every position is a pure function of ``topk_idx``: no atomics, so the result is the same
on every run and equals the pure ``torch.sort(stable=True)`` bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, launch, next_pow2

# Rows per chunk, at most (small inputs use the next power of two of their row count, so a
# decode step does not sort a mostly empty chunk). On an H200, against 1024 and 2048, 512
# was fastest or within 10% from 4K to 2M rows and E = 8 to 1024: about 8 us of GPU time
# at 4K-32K rows, 40 us at 512K, 130 us at 2M, against 43-670 us for the pure ops. Smaller
# chunks make a longer (C, E) table to scan, larger ones a longer sort per program.
CHUNK = 512
# Scan tiles: BLOCK_E experts a program (programs run in parallel), about _SCAN_TILE
# entries a step of its loop over the chunks.
_SCAN_BLOCK_E = 32
_SCAN_TILE = 4096
# Largest (chunks x experts) table every scatter program sums itself (64 KB of int32):
# 64K rows at 128 experts, or 8K rows at 1024.
_FUSED_SCAN_MAX = 16384


@triton.jit
def _hist_kernel(idx_ptr, hist_ptr, N, E, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    c = tl.program_id(0)
    rows = c * CHUNK + tl.arange(0, CHUNK)
    m = rows < N
    raw = tl.load(idx_ptr + rows, mask=m, other=0)
    # Ids outside [0, E) (unchecked on CUDA without debug checks) are left out here and in
    # the scatter, so a bad route leaves slots unwritten instead of writing out of bounds.
    # Tested before the int32 cast, which would wrap int64 ids.
    m = m & (raw >= 0) & (raw < E)
    h = tl.histogram(tl.where(m, raw, 0).to(tl.int32), E_PAD, mask=m)
    bins = tl.arange(0, E_PAD)
    tl.store(hist_ptr + c * E + bins, h, mask=bins < E)


# In place: hist[c, e] becomes sum_{c' < c} hist[c', e] (an exclusive scan down each
# column; columns are independent, so a program per block of experts).
@triton.jit
def _scan_kernel(hist_ptr, counts_ptr, C, E, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    em = cols < E
    carry = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, C, BLOCK_C):
        cs = c0 + tl.arange(0, BLOCK_C)
        m = (cs < C)[:, None] & em[None, :]
        ptrs = hist_ptr + cs[:, None] * E + cols[None, :]
        h = tl.load(ptrs, mask=m, other=0)
        tl.store(ptrs, carry[None, :] + tl.cumsum(h, axis=0) - h, mask=m)
        carry += tl.sum(h, axis=0)
    tl.store(counts_ptr + cols, carry.to(tl.int64), mask=em)


@triton.jit
def _scatter_kernel(idx_ptr, before_ptr, counts_ptr, offs_ptr, perm_ptr, inv_ptr, tok_ptr,
                    N, E, K, C, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                    SCAN: tl.constexpr, BLOCK_C: tl.constexpr):
    c = tl.program_id(0)
    bins = tl.arange(0, E_PAD)
    bm = bins < E
    if SCAN:
        # The scan done here, from the unscanned histograms: each program sums the whole
        # (C, E) table (small: the launcher picks this only then), program 0 writes counts.
        cnt = tl.zeros((E_PAD,), dtype=tl.int32)
        before = tl.zeros((E_PAD,), dtype=tl.int32)
        for c0 in range(0, C, BLOCK_C):
            cs = c0 + tl.arange(0, BLOCK_C)
            hc = tl.load(before_ptr + cs[:, None] * E + bins[None, :],
                         mask=(cs < C)[:, None] & bm[None, :], other=0)
            cnt += tl.sum(hc, axis=0)
            before += tl.sum(tl.where((cs < c)[:, None], hc, 0), axis=0)
        if c == 0:
            tl.store(counts_ptr + bins, cnt.to(tl.int64), mask=bm)
    else:
        cnt = tl.load(counts_ptr + bins, mask=bm, other=0).to(tl.int32)
        before = tl.load(before_ptr + c * E + bins, mask=bm, other=0)
    i = tl.arange(0, CHUNK)
    rows = c * CHUNK + i
    m = rows < N
    # Tail rows (and bad ids) get expert E: their keys sort after every real row's.
    raw = tl.load(idx_ptr + rows, mask=m, other=E)
    m = m & (raw >= 0) & (raw < E)
    e = tl.where(m, raw, E).to(tl.int32)
    key = tl.sort(e * CHUNK + i)
    se = key // CHUNK
    row = (c * CHUNK + key % CHUNK).to(tl.int64)
    sm = se < E
    # Per expert: delta = start + (rows in earlier chunks) - local, where local counts this
    # chunk's rows of smaller experts (its histogram again: cheaper than storing it).
    ends = tl.cumsum(cnt, axis=0)
    if c == 0:
        tl.store(offs_ptr + bins, ends, mask=bm)
    h = tl.histogram(tl.where(m, e, 0), E_PAD, mask=m)
    delta = ends - cnt + before - (tl.cumsum(h, axis=0) - h)
    pos = (tl.gather(delta, tl.where(sm, se, 0), 0) + i).to(tl.int64)
    tl.store(perm_ptr + pos, row, mask=sm)
    tl.store(inv_ptr + row, pos, mask=sm)
    tl.store(tok_ptr + pos, row // K, mask=sm)


def launch_layout(topk_idx: torch.Tensor, num_experts: int, *, chunk: int | None = None,
                  fuse_scan: bool | None = None):
    """The Triton path on any device (CPU tensors under ``TRITON_INTERPRET=1``); no argument
    checks. Returns ``(counts, offs, perm, inv_perm, token_of_sorted)``. ``chunk`` (a power
    of two) overrides the chunk size; tests use small ones to cross chunk edges cheaply.
    ``fuse_scan`` forces the two-launch (True) or three-launch (False) form; by default
    two launches while the (chunks, experts) table has at most ``_FUSED_SCAN_MAX`` entries."""
    dev = topk_idx.device
    k = topk_idx.shape[1]
    flat = topk_idx.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    n, e = flat.numel(), num_experts
    perm = torch.empty(n, dtype=torch.int64, device=dev)
    inv_perm = torch.empty(n, dtype=torch.int64, device=dev)
    tok = torch.empty(n, dtype=torch.int64, device=dev)
    if n == 0:
        return (torch.zeros(e, dtype=torch.int64, device=dev),
                torch.zeros(e, dtype=torch.int32, device=dev), perm, inv_perm, tok)
    if chunk is None:
        chunk = min(CHUNK, max(16, next_pow2(n)))
    elif chunk < 2 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 2, got {chunk}")
    c = cdiv(n, chunk)
    e_pad = next_pow2(e)
    table = torch.empty((c, e), dtype=torch.int32, device=dev)
    counts = torch.empty(e, dtype=torch.int64, device=dev)
    offs = torch.empty(e, dtype=torch.int32, device=dev)
    warps = 4 if chunk >= 256 else 2
    launch(_hist_kernel, (c,), flat, table, n, e, E_PAD=e_pad, CHUNK=chunk, num_warps=warps)
    # A small table is summed by every scatter program instead of scanned in a launch of
    # its own: a launch costs the host tens of microseconds, reading the table costs the
    # GPU less while it stays small.
    fused_scan = c * e <= _FUSED_SCAN_MAX if fuse_scan is None else fuse_scan
    if fused_scan:
        block_c = min(next_pow2(c), max(1, _SCAN_TILE // e_pad))
    else:
        block_e = min(e_pad, _SCAN_BLOCK_E)
        block_c = min(next_pow2(c), max(1, _SCAN_TILE // block_e))
        launch(_scan_kernel, (cdiv(e, block_e),), table, counts, c, e, BLOCK_E=block_e,
               BLOCK_C=block_c, num_warps=4)
    launch(_scatter_kernel, (c,), flat, table, counts, offs, perm, inv_perm, tok, n, e, k, c,
           E_PAD=e_pad, CHUNK=chunk, SCAN=fused_scan, BLOCK_C=block_c,
           num_warps=warps)
    return counts, offs, perm, inv_perm, tok
