"""Triton kernels of FP8 rows (``moe_fn.pure.fp8`` is the contract): quantise rows, read
through an index or not, into ``(e4m3 rows, float32 scales)`` or into packed byte rows, and
dequantise them; the same bits as the pure functions, on the GPU and under the interpreter.

The e4m3 value of ``v = x / s`` is rounded here in float32 (round to nearest even, see
``_round_e4m3``) and only then cast: the cast of a value e4m3 holds exactly is exact on
every backend, whereas a rounding cast is not portable (the interpreter's truncates). The
scale is built from the bits of the row's largest magnitude (``_pow2_scale``), so it is
exactly ``pure.fp8.pow2_scale``'s, and ``x * (1 / s)`` is ``x / s`` exactly (both are
powers of two, normal in float32).

A program owns ``BLOCK_R`` rows and walks ``D`` in ``BLOCK_C`` chunks twice: the amax, then
scale, round and store; the second reading of a row block comes from L2. The config is
fixed (no autotuning): the kernels are memory-bound and a few rows of 1-2K columns a
program with 8 warps keep enough bytes in flight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pure.fp8 import FP8_DTYPE, PACK_TAIL, Fp8Rows
from ._launch import cdiv, int32_columns, interpreting, launch, next_pow2

# ----------------------------------------------------------------------------- math


@triton.jit
def _round_e4m3(v):
    """``v`` (float32) rounded to the nearest e4m3 value, ties to even, saturated at +-448:
    ``v.clamp(-448, 448).to(float8_e4m3fn)`` as a float32 that casts exactly. NaN is the
    caller's to handle (rows with a NaN scale).

    Adding ``m``, the power of two 20 binades above ``|v|``'s (at least ``2**14``), leaves
    the sum an ulp of ``2**(E - 3)`` (``2**-9`` below e4m3's normal range): the float32 add
    rounds ``|v|`` to e4m3's 3 mantissa bits, or to its subnormal grid, to nearest even;
    subtracting ``m`` is exact."""
    a = tl.minimum(tl.abs(v), 448.0)
    eb = a.to(tl.int32, bitcast=True) & 0x7F800000
    m = (tl.maximum(eb, 0x3C800000) + (20 << 23)).to(tl.float32, bitcast=True)
    r = (a + m) - m
    rb = r.to(tl.uint32, bitcast=True) | (v.to(tl.uint32, bitcast=True) & 0x80000000)
    return rb.to(tl.float32, bitcast=True)


# On a GPU the cast rounds to nearest even and saturates in hardware (cvt.rn.satfinite; the
# same bits as torch's, checked on an H200), and the values are within +-448 by their
# scale: the float32 rounding above is needed only where the cast truncates, under the
# interpreter. Twelve integer and float operations an element less on the GPU.
_EXACT_ROUND = tl.constexpr(interpreting())


@triton.jit
def _e4m3_bytes(v, bad):
    """The e4m3 bytes of ``v`` (float32, within +-448), e4m3's NaN (0x7F) where ``bad`` (a
    row whose scale is NaN)."""
    if _EXACT_ROUND:
        v = _round_e4m3(v)
    b = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return tl.where(bad, 0x7F, b).to(tl.uint8)


@triton.jit
def _abs_max(acc, x):
    """Running elementwise ``max(acc, |x|)`` that keeps NaN (reduce with ``_pow2_scale``)."""
    return tl.maximum(acc, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _pow2_scale(acc):
    """``(scale, 1 / scale, bad)`` per row of ``acc (BLOCK_R, BLOCK_C)`` (``_abs_max``
    partials): ``pure.fp8.pow2_scale`` of the row amax, from its bits. With ``amax = M *
    2**E``, ``M`` in [1, 2): ``scale = 2**(E - 8 + (M > 1.75))`` (448 = 1.75 * 2**8). NaN
    scale (``bad``) where the amax is inf or NaN."""
    # Magnitudes order as their bits, NaN above inf: an integer max keeps NaN (tl.max's
    # float combine would drop it).
    ab = tl.max(acc.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
    bad = ab >= 0x7F800000
    a = tl.maximum(ab, (127 - 64) << 23)  # AMAX_FLOOR: a row of zeros
    e = (a >> 23) - 127 - 8 + ((a & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.where(bad, 0, e)
    sb = tl.where(bad, 0x7FC00000, (e + 127) << 23)
    scale = sb.to(tl.float32, bitcast=True)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    return scale, inv, bad


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _quantize_kernel(x_ptr, idx_ptr, q_ptr, s_ptr, n, D, s_xr, s_xc, s_qr, s_sr,
                     HAS_INDEX: tl.constexpr, TAIL: tl.constexpr, ONE_CHUNK: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows ``x[index[i]]`` (or ``x[i]``) into e4m3 bytes at ``q_ptr + i * s_qr`` and their
    scales at ``s_ptr + i * s_sr``; ``TAIL`` also zeroes the 12 bytes after each scale (the
    packed layout, where ``s_ptr`` is the packed rows viewed as float32). ``ONE_CHUNK``
    (``D <= BLOCK_C``): each row is read once and kept in registers."""
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    rmask = rows < n
    if HAS_INDEX:
        src = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        src = rows
    x_rows = x_ptr + src[:, None] * s_xr
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    if ONE_CHUNK:
        cols = tl.arange(0, BLOCK_C)
        m1 = rmask[:, None] & (cols < D)[None, :]
        x1 = tl.load(x_rows + cols[None, :] * s_xc, mask=m1, other=0.0).to(tl.float32)
        acc = _abs_max(acc, x1)
    else:
        for c0 in range(0, D, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            m = rmask[:, None] & (cols < D)[None, :]
            x = tl.load(x_rows + cols[None, :] * s_xc, mask=m, other=0.0)
            acc = _abs_max(acc, x.to(tl.float32))
    scale, inv, bad = _pow2_scale(acc)
    if TAIL:
        # [scale, 0, 0, 0] as four float32s: the scale and the packed row's zero tail.
        k = tl.arange(0, 4)
        tail = tl.where((k == 0)[None, :], scale[:, None], 0.0)
        tl.store(s_ptr + rows[:, None] * s_sr + k[None, :], tail, mask=rmask[:, None])
    else:
        tl.store(s_ptr + rows * s_sr, scale, mask=rmask)
    q_rows = q_ptr + rows[:, None] * s_qr
    if ONE_CHUNK:
        cols = tl.arange(0, BLOCK_C)
        tl.store(q_rows + cols[None, :], _e4m3_bytes(x1 * inv[:, None], bad[:, None]),
                 mask=m1)
    else:
        for c0 in range(0, D, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            m = rmask[:, None] & (cols < D)[None, :]
            x = tl.load(x_rows + cols[None, :] * s_xc, mask=m, other=0.0)
            q = _e4m3_bytes(x.to(tl.float32) * inv[:, None], bad[:, None])
            tl.store(q_rows + cols[None, :], q, mask=m)


@triton.jit
def _quantize_t_kernel(w_ptr, q_ptr, s_ptr, N, K, s_we, s_wn, s_wk,
                       BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Expert ``e``'s ``w[e] (N, K)`` transposed into e4m3 rows ``q[e] (K, N)`` with a scale
    per row ``k`` (over ``N``): a program owns ``BLOCK_K`` columns of ``w``, read along
    ``K`` (coalesced) in ``(BLOCK_K, BLOCK_N)`` tiles, twice (the amax, then the stores,
    written along ``N``)."""
    pid_k = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    ks = (pid_k * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    kmask = ks < K
    w_cols = w_ptr + e * s_we + ks[:, None] * s_wk
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        m = kmask[:, None] & (ns < N)[None, :]
        x = tl.load(w_cols + ns[None, :] * s_wn, mask=m, other=0.0)
        acc = _abs_max(acc, x.to(tl.float32))
    scale, inv, bad = _pow2_scale(acc)
    tl.store(s_ptr + e * K + ks, scale, mask=kmask)
    q_rows = q_ptr + e * K * N + ks[:, None] * N
    for n0 in range(0, N, BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        m = kmask[:, None] & (ns < N)[None, :]
        x = tl.load(w_cols + ns[None, :] * s_wn, mask=m, other=0.0)
        q = _e4m3_bytes(x.to(tl.float32) * inv[:, None], bad[:, None])
        tl.store(q_rows + ns[None, :], q, mask=m)


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, out_ptr, n, D, s_qr, s_qc, s_s, s_or,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    rmask = rows < n
    scale = tl.load(s_ptr + rows * s_s, mask=rmask, other=0.0)
    for c0 in range(0, D, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        m = rmask[:, None] & (cols < D)[None, :]
        b = tl.load(q_ptr + rows[:, None] * s_qr + cols[None, :] * s_qc, mask=m, other=0)
        f = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        # e4m3's NaN bytes: the interpreter's cast reads them as +-480.
        f = tl.where((b & 0x7F) == 0x7F, float("nan"), f)
        tl.store(out_ptr + rows[:, None] * s_or + cols[None, :],
                 (f * scale[:, None]).to(out_ptr.dtype.element_ty), mask=m)


# ----------------------------------------------------------------------------- launch config


def quantize_blocks(width: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_C, num_warps)`` of the quantise and dequantise kernels."""
    if interpreting():
        # Narrow chunks so small test widths run the column loops and their masks.
        return 4, 32, 4
    return 4, min(max(next_pow2(max(width, 1)), 128), 2048), 8


def _config(width, block_r, block_c, num_warps):
    r, c, w = quantize_blocks(width)
    return block_r or r, block_c or c, num_warps or w


# ----------------------------------------------------------------------------- launchers


def _quantize(x, index, q_bytes, s_view, s_stride, tail, cfg):
    n = x.shape[0] if index is None else index.shape[0]
    d = x.shape[1]
    if n == 0:
        return
    x = int32_columns(x)
    block_r, block_c, nw = _config(d, *cfg)
    launch(_quantize_kernel, (cdiv(n, block_r),),
           x, index if index is not None else x, q_bytes, s_view, n, d,
           x.stride(0), x.stride(1), q_bytes.stride(0), s_stride,
           HAS_INDEX=index is not None, TAIL=tail, ONE_CHUNK=d <= block_c, BLOCK_R=block_r,
           BLOCK_C=block_c, num_warps=nw)


def launch_quantize_rows(x, index=None, *, block_r=None, block_c=None, num_warps=None):
    """Triton ``pure.fp8.quantize_rows(x, index)`` on any device (CPU needs
    TRITON_INTERPRET=1): ``Fp8Rows(q (n, D) contiguous, scale (n,))``. The block sizes
    default to ``quantize_blocks``."""
    n = x.shape[0] if index is None else index.shape[0]
    d = x.shape[1]
    q = torch.empty((n, d), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((n,), dtype=torch.float32, device=x.device)
    _quantize(x, index, q.view(torch.uint8), scale, 1, False, (block_r, block_c, num_warps))
    return Fp8Rows(q, scale)


def launch_quantize_rows_packed(x, index=None, *, out=None, block_r=None, block_c=None,
                                num_warps=None):
    """Triton ``pure.fp8.quantize_rows_packed(x, index)``: ``(n, D + 16)`` uint8 rows of
    e4m3 bytes, the float32 scale and 12 zero bytes, into ``out`` when given (contiguous,
    e.g. an exchange's send buffer: every byte is written). ``D % 16 == 0`` (checked by the
    op)."""
    n = x.shape[0] if index is None else index.shape[0]
    d = x.shape[1]
    if d % PACK_TAIL:
        raise ValueError(f"packed FP8 rows need D % {PACK_TAIL} == 0, got D = {d}")
    if out is None:
        out = torch.empty((n, d + PACK_TAIL), dtype=torch.uint8, device=x.device)
    elif (out.dtype != torch.uint8 or tuple(out.shape) != (n, d + PACK_TAIL)
          or not out.is_contiguous() or out.device != x.device):
        raise ValueError(f"out must be a contiguous uint8 ({n}, {d + PACK_TAIL}) tensor on "
                         f"{x.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    words = out.view(torch.float32)  # (n, (D + 16) / 4)
    _quantize(x, index, out, words[:, d // 4:], words.stride(0), True,
              (block_r, block_c, num_warps))
    return out


def launch_quantize_rows_t(w, *, block_k=None, block_n=None, num_warps=None):
    """Triton ``pure.fp8.quantize_rows_t(w)``: ``w (E, N, K)`` (any strides) into ``Fp8Rows(q
    (E, K, N) contiguous, scale (E, K))`` without a transposed copy."""
    e, n, k = w.shape
    q = torch.empty((e, k, n), dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty((e, k), dtype=torch.float32, device=w.device)
    if q.numel() == 0:
        return Fp8Rows(q, scale)
    if interpreting():
        bk, bn, nw = 4, 32, 4  # small tiles: test widths run the loops and the masks
    else:
        bk, bn, nw = 64, 128, 8
    bk, bn, nw = block_k or bk, block_n or bn, num_warps or nw
    launch(_quantize_t_kernel, (cdiv(k, bk), e),
           w, q.view(torch.uint8), scale, n, k, w.stride(0), w.stride(1), w.stride(2),
           BLOCK_K=bk, BLOCK_N=bn, num_warps=nw)
    return Fp8Rows(q, scale)


def launch_dequantize_rows(rows, dtype, *, block_r=None, block_c=None, num_warps=None):
    """Triton ``pure.fp8.dequantize_rows(rows, dtype)`` (float16/bfloat16/float32);
    ``rows.q`` may be row- or column-strided (a view of packed rows)."""
    q, scale = rows
    n, d = q.shape
    out = torch.empty((n, d), dtype=dtype, device=q.device)
    if n == 0 or d == 0:
        return out
    qb = int32_columns(q.view(torch.uint8))
    block_r, block_c, nw = _config(d, block_r, block_c, num_warps)
    launch(_dequantize_kernel, (cdiv(n, block_r),),
           qb, scale, out, n, d, qb.stride(0), qb.stride(1), scale.stride(0), out.stride(0),
           BLOCK_R=block_r, BLOCK_C=block_c, num_warps=nw)
    return out
