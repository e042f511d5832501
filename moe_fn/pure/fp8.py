"""FP8 (e4m3) rows with per-row power-of-two scales: the contract of the FP8 expert path.

A row ``x (D,)`` is stored as ``q = saturate(round(x / s))`` in ``float8_e4m3fn`` and a float32
scale ``s``, the smallest power of two with ``amax(|x|) / s <= 448`` (e4m3's largest finite
value), so that ``q * s`` approximates ``x`` to e4m3's 3 mantissa bits. A power of two makes
``x / s`` exact in float32: the only rounding is the cast to e4m3 (round to nearest even), and
``q * s`` is exact in bfloat16 and float32 (dequantising loses nothing). A row of zeros gets
the scale of ``amax = 2**-64`` and quantises to zeros; a row holding inf or NaN gets a NaN
scale (``moe_fn.set_debug_checks(True)`` makes the layer raise on one).

The kernels (``moe_fn.kernels.fp8``) produce these same bits; this module is their oracle and
the CPU path. ``fp8_grouped_mm`` is ``torch._scaled_grouped_mm``'s meaning (products of the
e4m3 values, summed, times both scales) computed exactly from the dequantised operands, as
the CPU path and the reference for the GPU's GEMM.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Rows of zeros are scaled as if their largest magnitude were this (any scale gives zeros).
AMAX_FLOOR = 2.0 ** -64
# A packed FP8 row is [D bytes of e4m3 | the float32 scale | 12 bytes of zeros]: one row
# of bytes, so exchanges move rows and scales together as rows of any other dtype.
PACK_TAIL = 16


class Fp8Rows(NamedTuple):
    """Quantised rows: ``q (n, D)`` float8_e4m3fn (row stride may exceed D: a view of packed
    rows), ``scale (n,)`` float32, contiguous; ``q.float() * scale[:, None]`` is the value."""

    q: torch.Tensor
    scale: torch.Tensor


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``s`` with ``amax / s <= 448``, float32; NaN where ``amax``
    is not finite. ``amax`` float32, >= 0."""
    a = amax.float().clamp_min(AMAX_FLOOR)
    # a = m * 2**e with m in [0.5, 1); 448 = 0.875 * 2**9.
    m, e = torch.frexp(a)
    s = torch.ldexp(torch.ones_like(a), e - 9 + (m > 0.875).to(e.dtype))
    return torch.where(torch.isfinite(amax), s, torch.full_like(s, float("nan")))


def quantize_rows(x: torch.Tensor, index: torch.Tensor | None = None) -> Fp8Rows:
    """``x (n, D)`` (rows ``x[index]`` when given), any floating dtype but float64 (whose
    division by the scale would round before the cast), quantised row by row."""
    if index is not None:
        x = x.index_select(0, index)
    xf = x.float()
    s = pow2_scale(xf.abs().amax(dim=-1) if xf.shape[-1] else xf.new_zeros(xf.shape[:-1]))
    q = (xf / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Rows(q, s.contiguous())


def dequantize_rows(rows: Fp8Rows, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in ``dtype`` (exact in bfloat16, float16 within its range, and
    float32)."""
    return (rows.q.float() * rows.scale[:, None]).to(dtype)


def pack_rows_fp8(rows: Fp8Rows) -> torch.Tensor:
    """``(n, D + 16)`` uint8: each row's e4m3 bytes, its scale's 4 bytes, 12 zero bytes."""
    n, d = rows.q.shape
    out = torch.zeros(n, d + PACK_TAIL, dtype=torch.uint8, device=rows.q.device)
    out[:, :d] = rows.q.view(torch.uint8)
    out[:, d:d + 4] = rows.scale.reshape(n, 1).view(torch.uint8)
    return out


def unpack_rows_fp8(packed: torch.Tensor, d: int) -> Fp8Rows:
    """The quantised rows of ``(n, d + 16)`` packed bytes: ``q`` a row-strided view (no
    copy), ``scale`` copied out contiguous."""
    if packed.shape[-1] != d + PACK_TAIL or packed.dtype != torch.uint8:
        raise ValueError(f"packed FP8 rows must be uint8 (n, {d + PACK_TAIL}), got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    q = packed[:, :d].view(FP8_DTYPE)
    scale = packed[:, d:d + 4].contiguous().view(torch.float32).reshape(-1)
    return Fp8Rows(q, scale)


def quantize_rows_packed(x: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """``pack_rows_fp8(quantize_rows(x, index))``: the one pass the FP8 dispatch makes."""
    return pack_rows_fp8(quantize_rows(x, index))


def _bounds(offs: torch.Tensor):
    ends = offs.tolist()  # host sync: reference path only
    return list(zip([0] + ends[:-1], ends))


def fp8_grouped_mm(a: Fp8Rows, b: Fp8Rows, offs: torch.Tensor, out_dtype: torch.dtype):
    """``y[rows of e] = A_e @ B_e^T`` with ``A = a.q * a.scale`` (M, K) and ``B_e =
    b.q[e] * b.scale[e][:, None]`` (N, K) for ``b.q (E, N, K)``, ``b.scale (E, N)``, rounded
    once to ``out_dtype``; rows past ``offs[-1]`` are zero. Summed in float64, which holds
    every such sum exactly for K <= 512 (an e4m3 product has 8 significant bits, the
    products of one row and column span at most 2**36, and 36 + 8 + 9 bits fit in 53), so
    the result depends on no summation order (beyond, within 2**-53 of the exact sum); the
    GPU's GEMM accumulates in float32."""
    af = a.q.double() * a.scale.double()[:, None]
    bf = b.q.double() * b.scale.double()[..., None]
    out = af.new_zeros(af.shape[0], bf.shape[1])
    for e, (s, t) in enumerate(_bounds(offs)):
        if t > s:
            out[s:t] = af[s:t] @ bf[e].transpose(0, 1)
    return out.to(out_dtype)


def quantize_weight(w: torch.Tensor) -> Fp8Rows:
    """``w (E, N, K)`` quantised per output channel (each ``(e, n)`` row over K): ``q (E, N,
    K)``, ``scale (E, N)``; the operand ``b`` of ``fp8_grouped_mm`` computing ``x @
    w[e]^T``."""
    e, n, k = w.shape
    rows = quantize_rows(w.reshape(e * n, k))
    return Fp8Rows(rows.q.reshape(e, n, k), rows.scale.reshape(e, n))


def scaled_grouped_mm_available() -> bool:
    """Whether this torch has ``torch._scaled_grouped_mm`` (the GPU's grouped FP8 GEMM)."""
    return hasattr(torch, "_scaled_grouped_mm")


def grouped_mm_fp8(a: Fp8Rows, b: Fp8Rows, offs: torch.Tensor, out_dtype: torch.dtype):
    """``fp8_grouped_mm`` computed by ``torch._scaled_grouped_mm`` on CUDA (bfloat16 out, as
    it requires; fast accumulation, without which it ran at half bf16's speed on an H200),
    by the reference loop elsewhere."""
    if a.q.is_cuda and a.q.shape[0]:
        return torch._scaled_grouped_mm(a.q, b.q.transpose(-2, -1), a.scale, b.scale,
                                        offs=offs, out_dtype=out_dtype, use_fast_accum=True)
    return fp8_grouped_mm(a, b, offs, out_dtype)
