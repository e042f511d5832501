"""Triton kernel of the fused combine (``moe_fn.pure.dispatch.gather_sum_fwd`` is the
contract): ``out[t] = sum_j rows[index[t*k + j]]`` in one pass, accumulated in float32,
without materialising the (T*k, H) gathered rows. One program per (token, column block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_C = 1024


@triton.jit
def _gather_sum_kernel(rows_ptr, index_ptr, out_ptr, H, s_r, s_o,
                       K: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = cols < H
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for j in tl.static_range(K):
        r = tl.load(index_ptr + t * K + j).to(tl.int64)
        acc += tl.load(rows_ptr + r * s_r + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * s_o + cols, acc.to(out_ptr.dtype.element_ty), mask=m)


def launch_gather_sum(rows: torch.Tensor, index: torch.Tensor, top_k: int) -> torch.Tensor:
    """The Triton path on any device (CPU tensors under ``TRITON_INTERPRET=1``)."""
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    t = index.numel() // top_k
    h = rows.shape[1]
    out = torch.empty((t, h), dtype=rows.dtype, device=rows.device)
    if t == 0 or h == 0:
        return out.zero_()
    block = min(_BLOCK_C, triton.next_power_of_2(h))
    grid = (t, triton.cdiv(h, block))
    _gather_sum_kernel[grid](rows, index.contiguous(), out, h, rows.stride(0), out.stride(0),
                             K=top_k, BLOCK_C=block, num_warps=4 if block >= 512 else 2)
    return out
