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

from .._checks import debug_checks
from . import activations as _act

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


def quantize_rows_t(w: torch.Tensor) -> Fp8Rows:
    """``w (E, N, K)`` transposed and quantised: ``q (E, K, N)`` contiguous, ``scale (E,
    K)``, each row ``k`` of expert ``e`` (``w[e, :, k]``) scaled over ``N``. The layout the
    input-gradient GEMMs read the weights in."""
    e, n, k = w.shape
    rows = quantize_rows(w.transpose(1, 2).reshape(e * k, n))
    return Fp8Rows(rows.q.reshape(e, k, n), rows.scale.reshape(e, k))


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


# ----------------------------------------------------------------------------- checks

FP8_SOURCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


def check_fp8_source(name: str, x) -> None:
    """A tensor the FP8 path quantises: float16, bfloat16 or float32 (float64 would round
    to float32 before the cast to e4m3, two roundings instead of one)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FP8_SOURCE_DTYPES:
        raise TypeError(f"{name}: the FP8 path quantises float16, bfloat16 or float32, got "
                        f"{x.dtype}; cast it first (x.float())")


def check_quantize_t_args(w) -> None:
    """``quantize_rows_t``'s argument: ``w (E, N, K)`` of an FP8 source dtype."""
    check_fp8_source("w", w)
    if w.dim() != 3:
        raise ValueError(f"w must be 3-D (experts, N, K), got shape {tuple(w.shape)}")


def check_quantize_args(x, index=None, *, packed: bool = False, values: bool = True) -> None:
    """``quantize_rows``' arguments: ``x (T, D)`` of an FP8 source dtype; ``index (n,)``
    int32/int64 on x's device with values in ``[0, T)`` (unless ``values`` is False, as in
    fakes: checked on CPU, and on CUDA under ``moe_fn.set_debug_checks(True)``, where it
    costs a host sync); for the packed form ``D % 16 == 0``."""
    check_fp8_source("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (rows, D), got shape {tuple(x.shape)}")
    if packed and x.shape[1] % PACK_TAIL:
        raise ValueError(f"packed FP8 rows need D % {PACK_TAIL} == 0 (the float32 scale sits "
                         f"at byte D of each 16-byte aligned row), got D = {x.shape[1]}; pad "
                         f"the rows or use quantize_rows")
    if index is None:
        return
    if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.dtype not in \
            _INDEX_DTYPES:
        got = (f"{index.dtype} {tuple(index.shape)}" if isinstance(index, torch.Tensor)
               else type(index).__name__)
        raise TypeError(f"index must be a 1-D int32 or int64 tensor of row numbers, got {got}")
    if index.device != x.device:
        raise ValueError(f"index must be on x's device {x.device}, got {index.device}")
    if (values and index.numel() and not torch.compiler.is_compiling()
            and (index.device.type == "cpu" or debug_checks())):
        lo, hi = int(index.min()), int(index.max())
        if lo < 0 or hi >= x.shape[0]:
            raise ValueError(f"index values must lie in [0, {x.shape[0]}) (rows of x), got "
                             f"[{lo}, {hi}]")


def check_fp8_rows(rows) -> None:
    """``rows``: an ``Fp8Rows`` (or pair) of ``q (n, D)`` float8_e4m3fn and ``scale (n,)``
    float32 on one device."""
    if not isinstance(rows, tuple) or len(rows) != 2:
        raise TypeError(f"rows must be Fp8Rows(q, scale), got {type(rows).__name__}")
    q, scale = rows
    if not isinstance(q, torch.Tensor) or q.dtype != FP8_DTYPE or q.dim() != 2:
        got = f"{q.dtype} {tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
        raise TypeError(f"rows.q must be a 2-D float8_e4m3fn tensor, got {got}")
    if (not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32
            or tuple(scale.shape) != (q.shape[0],)):
        got = (f"{scale.dtype} {tuple(scale.shape)}" if isinstance(scale, torch.Tensor)
               else type(scale).__name__)
        raise TypeError(f"rows.scale must be float32 of shape ({q.shape[0]},) (one scale per "
                        f"row of q), got {got}")
    if scale.device != q.device:
        raise ValueError(f"rows.q and rows.scale must be on one device, got {q.device} and "
                         f"{scale.device}")


# ----------------------------------------------------------------------------- activation

# The activation whose output feeds the FP8 down GEMM, and its backward whose input gradient
# feeds the FP8 dX GEMM: the bf16 pair's results, quantised. The kernels fuse the
# quantisation into the pass that produces them (moe_fn.kernels.swiglu_packed_fwd_fp8).


def swiglu_packed_fwd_fp8(gate_up, weights=None, *, act_id: int, alpha: float, limit: float,
                          layout_id: int):
    """``(quantize_rows(h), res)`` with ``h, res = swiglu_packed_fwd(...)``: ``h`` rounded
    to gate_up's dtype first, so the FP8 rows are those of the bf16 path's output."""
    check_fp8_source("gate_up", gate_up)
    h, res = _act.swiglu_packed_fwd(gate_up, weights, act_id=act_id, alpha=alpha,
                                    limit=limit, layout_id=layout_id)
    return quantize_rows(h), res


def check_fp8_bwd_needs(needs) -> None:
    if not needs[0]:
        raise ValueError("swiglu_packed_bwd_fp8 exists to produce d_gate_up and its FP8 rows; "
                         "for d_weights alone call swiglu_packed_bwd(res, dh, needs=(False, "
                         "True))")


# The derivative is swiglu_packed_bwd's; the FP8 rows are those of its d_gate_up.
def swiglu_packed_bwd_fp8(res, dh, *, needs=(True, True)):
    """``(d_gate_up, quantize_rows(d_gate_up), d_weights)`` of ``swiglu_packed_bwd``:
    ``d_gate_up (N, 2I)`` in gate_up's dtype and packed layout, its FP8 rows (the dX GEMM's
    operand), ``d_weights`` or None. ``needs[0]`` must be True."""
    check_fp8_bwd_needs(needs)
    check_fp8_source("gate_up", res.gate_up)
    dgu, dw = _act.swiglu_packed_bwd(res, dh, needs=(True, needs[1]))
    return dgu, quantize_rows(dgu), dw
