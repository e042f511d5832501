"""Triton kernel of the router forward (``moe_fn.pure.router.router_fwd`` is the contract):
scores, biased choice, expert groups, top-k, gather, normalise and scale in ONE launch
instead of ~15 small ops. One program owns ``BLOCK_T`` token rows and all E experts
(``BLOCK_E = next_power_of_2(E)`` columns, masked); math is float32. The router linear
``x @ W^T`` can run in the same launch (``launch_router_linear_fwd``): an eager layer's
forward waits on its host time, and ``F.linear`` with its autograd bookkeeping cost more
than the kernel's GPU time.

Top-k is k rounds of "largest, ties to the lower index, then mask it out", which lists the
experts exactly as ``torch.sort(descending=True, stable=True)`` does. The comparisons run
on an int32 order key of the float bits, so NaN (canonicalised) sorts above +inf and equal
values, -0.0 and +0.0 included, compare equal, as in torch.sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..pure.router import NORM_EPS
from ._launch import cdiv, int32_columns, launch, next_pow2
from ._registry import KERNEL_DTYPES
from .activation import interpreting

# Elements per program (BLOCK_T * BLOCK_E): enough rows to fill the warps for small E.
_TILE = 4096
_KEY_MIN = tl.constexpr(-2147483648)  # below every real key (-inf gives 0x807FFFFF)
_KEY_NEG_INF = tl.constexpr(-2139095041)  # the key of -inf (0x807FFFFF as int32)
_NORM_EPS = tl.constexpr(NORM_EPS)  # jit code reads only constexpr globals


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    # tl.exp is ex2.approx on NVIDIA; libdevice expf is what torch's CUDA kernels call, so the
    # scores (and hence near-tie choices) match torch. The interpreter has no libdevice.
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _order_key(c):
    """int32 key, monotone in the float order with every NaN largest and -0.0 == +0.0."""
    bits = c.to(tl.int32, bitcast=True)
    bits = tl.where(c != c, 0x7FC00000, bits)  # one NaN: all NaNs tie, as in torch.sort
    bits = tl.where(c == 0.0, 0, bits)  # -0.0 == +0.0 in torch.sort: same key
    # Negative floats: flip the magnitude bits so a larger magnitude gives a smaller key.
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _first_max(key, pos, vals, WIDTH: tl.constexpr, AXIS: tl.constexpr):
    """Along ``AXIS`` (the last): the position of the largest key (ties to the lower
    position), it as a mask, and the value there (an exact gather: -0.0 is the identity
    of + for every float, -0.0 and NaN included)."""
    kmax = tl.max(key, axis=AXIS)
    first = tl.min(tl.where(key == tl.expand_dims(kmax, AXIS), pos, WIDTH), axis=AXIS)
    hit = pos == tl.expand_dims(first, AXIS)
    return first, hit, tl.sum(tl.where(hit, vals, -0.0), axis=AXIS)


@triton.jit
def _keep_groups(c, key, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                 N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP2: tl.constexpr):
    """DeepSeek-style group limit: the key with every expert outside the ``TOPK_GROUP``
    best of ``N_GROUP`` contiguous groups set to the key of -inf (as the pure code's
    ``masked_fill(-inf)``). A group scores its top-2 sum (``TOP2``) or its max, computed
    on the order keys so NaN ranks as torch.topk ranks it; groups tie to the lower index."""
    PG: tl.constexpr = BLOCK_E // N_GROUP
    key3 = tl.reshape(key, (BLOCK_T, N_GROUP, PG))
    c3 = tl.reshape(c, (BLOCK_T, N_GROUP, PG))
    pos = tl.arange(0, PG)[None, None, :]
    _, hit1, v1 = _first_max(key3, pos, c3, PG, 2)
    gscore = v1
    if TOP2:
        _, _, v2 = _first_max(tl.where(hit1, _KEY_MIN, key3), pos, c3, PG, 2)
        gscore = v1 + v2
    gkey = _order_key(gscore)
    gpos = tl.arange(0, N_GROUP)[None, :]
    keep = tl.zeros((BLOCK_T, N_GROUP), dtype=tl.int32)
    for _ in range(TOPK_GROUP):
        _, hit, _ = _first_max(gkey, gpos, gscore, N_GROUP, 1)
        keep = tl.where(hit, 1, keep)
        gkey = tl.where(hit, _KEY_MIN, gkey)
    keep_cols = tl.reshape(tl.broadcast_to(keep[:, :, None], (BLOCK_T, N_GROUP, PG)),
                           (BLOCK_T, BLOCK_E))
    return tl.where(keep_cols != 0, key, _KEY_NEG_INF)


@triton.jit
def _linear_tile(h_ptr, wr_ptr, lb_ptr, rows, cols, rmask, cmask, H, s_hr, s_wr,
                 HAS_LB: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_H: tl.constexpr, DOT_F32: tl.constexpr):
    """``h[rows] @ W[cols]^T (+ b)`` for a tile, accumulated in float32 (unit column
    strides: the launcher's condition). ``DOT_F32``: the operands go to the dot as float32
    (exact for 16-bit inputs; the interpreter's dot mis-reads bfloat16)."""
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        hm = hs < H
        a = tl.load(h_ptr + rows[:, None] * s_hr + hs[None, :],
                    mask=rmask[:, None] & hm[None, :], other=0.0)
        b = tl.load(wr_ptr + cols[None, :] * s_wr + hs[:, None],
                    mask=cmask[None, :] & hm[:, None], other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    if HAS_LB:
        acc += tl.load(lb_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _router_fwd_kernel(x_ptr, bias_ptr, idx_ptr, raw_ptr, w_ptr, scores_ptr,
                       T, E, s_xr, s_xc, scale, wr_ptr, lb_ptr, logits_ptr, H, s_wr,
                       K: tl.constexpr, KP: tl.constexpr, SCORE: tl.constexpr,
                       HAS_BIAS: tl.constexpr, NORM: tl.constexpr, PRECISE: tl.constexpr,
                       N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP2: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                       LINEAR: tl.constexpr = False, HAS_LB: tl.constexpr = False,
                       REPLAY: tl.constexpr = False, BLOCK_H: tl.constexpr = 64):
    # LINEAR: x is the router input (T, H) and the logits are computed here from the router
    # weight (and bias) and stored; else x is the logits. REPLAY: idx holds a recorded route
    # to weight, not to choose.
    pid = tl.program_id(0)
    rows = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < T
    cmask = cols < E
    m2 = rmask[:, None] & cmask[None, :]
    if LINEAR:
        # Not PRECISE means interpreting: the interpreter's dot needs float32 operands.
        acc = _linear_tile(x_ptr, wr_ptr, lb_ptr, rows, cols, rmask, cmask, H, s_xr, s_wr,
                           HAS_LB, BLOCK_T, BLOCK_E, BLOCK_H, not PRECISE)
        # Rounded once to the input dtype, as F.linear returns the logits, so the routing
        # below sees the values the caller gets.
        lg = acc.to(logits_ptr.dtype.element_ty)
        tl.store(logits_ptr + rows[:, None] * E + cols[None, :], lg, mask=m2)
        x = lg.to(tl.float32)
    else:
        # other=0.0 keeps the padded rows finite (no stores there); padded columns are masked.
        x = tl.load(x_ptr + rows[:, None] * s_xr + cols[None, :] * s_xc, mask=m2, other=0.0)
        x = x.to(tl.float32)

    if SCORE == 0:
        xm = tl.where(cmask[None, :], x, float("-inf"))
        mx = tl.max(xm, axis=1)
        e = tl.where(cmask[None, :], _exp(xm - mx[:, None], PRECISE), 0.0)
        # div_rn: Triton's "/" is the approximate div.full.f32; torch divides exactly.
        s = tl.div_rn(e, tl.sum(e, axis=1)[:, None])
        tl.store(scores_ptr + rows[:, None] * E + cols[None, :], s, mask=m2)
    elif SCORE == 1:
        s = tl.div_rn(1.0, 1.0 + _exp(-x, PRECISE))  # torch's formula
    else:
        s = x

    kcols = tl.arange(0, KP)
    kmask = kcols < K
    mk2 = rmask[:, None] & kmask[None, :]
    offs = rows[:, None] * K + kcols[None, :]
    raw_t = tl.zeros((BLOCK_T, KP), dtype=tl.float32)
    if REPLAY:
        # The recorded experts' scores: an exact gather, as scores.gather(1, idx).
        idx_t = tl.load(idx_ptr + offs, mask=mk2, other=0).to(tl.int32)
        for j in range(K):
            here = kcols[None, :] == j
            pick = tl.sum(tl.where(here, idx_t, 0), axis=1)
            v = tl.sum(tl.where(cols[None, :] == pick[:, None], s, -0.0), axis=1)
            raw_t = tl.where(here, v[:, None], raw_t)
    else:
        if HAS_BIAS:
            c = s + tl.load(bias_ptr + cols, mask=cmask, other=0.0)[None, :]
        else:
            c = s
        key = tl.where(cmask[None, :], _order_key(c), _KEY_MIN)
        if N_GROUP > 1:  # E == BLOCK_E here (the launcher's condition): no padded columns
            key = _keep_groups(c, key, BLOCK_T, BLOCK_E, N_GROUP, TOPK_GROUP, TOP2)
        idx_t = tl.zeros((BLOCK_T, KP), dtype=tl.int32)
        for j in range(K):
            pick, hit, v = _first_max(key, cols[None, :], s, BLOCK_E, 1)
            key = tl.where(hit, _KEY_MIN, key)
            here = kcols[None, :] == j
            idx_t = tl.where(here, pick[:, None], idx_t)
            raw_t = tl.where(here, v[:, None], raw_t)
        tl.store(idx_ptr + offs, idx_t.to(tl.int64), mask=mk2)

    if SCORE == 2:
        # softmax over the k chosen logits (GPT-OSS).
        rm = tl.where(kmask[None, :], raw_t, float("-inf"))
        mk = tl.max(rm, axis=1)
        ek = tl.where(kmask[None, :], _exp(rm - mk[:, None], PRECISE), 0.0)
        raw_t = tl.div_rn(ek, tl.sum(ek, axis=1)[:, None])
    w_t = raw_t
    if NORM:
        den = tl.sum(tl.where(kmask[None, :], w_t, 0.0), axis=1)[:, None] + _NORM_EPS
        w_t = tl.div_rn(w_t, den)
    w_t = w_t * scale

    tl.store(raw_ptr + offs, raw_t, mask=mk2)
    tl.store(w_ptr + offs, w_t, mask=mk2)


def groups_supported(num_experts: int, n_group: int) -> bool:
    """Expert groups run in the kernel when they tile a power-of-two expert count."""
    return n_group == 1 or (num_experts & (num_experts - 1) == 0
                            and num_experts % n_group == 0)


def launch_router_fwd(logits: torch.Tensor, bias: torch.Tensor | None = None, *, top_k: int,
                      score_id: int, norm: bool, scale: float, n_group: int = 1,
                      topk_group: int = 1, top2_sum: bool = True):
    """The Triton path on any device (CPU tensors under ``TRITON_INTERPRET=1``); arguments
    already validated (``top_k <= E``, the group options). Returns ``(topk_idx int64
    (T, k), w fp32 (T, k), scores fp32 (T, E) for softmax else None, raw fp32 (T, k))``.
    Expert groups need ``groups_supported(E, n_group)``."""
    if logits.dtype not in KERNEL_DTYPES:
        raise TypeError(f"router kernel takes float16/bfloat16/float32 logits, got {logits.dtype}")
    logits = int32_columns(logits)
    t, e = logits.shape
    block_e = next_pow2(e)
    block_t = max(1, min(64, _TILE // block_e, next_pow2(t)))
    return _launch(logits, bias, None, t, e, block_t, block_e,
                   (logits.stride(0), logits.stride(1)), None, top_k=top_k, score_id=score_id,
                   norm=norm, scale=scale, n_group=n_group, topk_group=topk_group,
                   top2_sum=top2_sum, num_warps=4 if block_t * block_e >= 2048 else 2)


# Logits tile of the fused linear (BLOCK_T x BLOCK_E float32 entries, at least 16 rows for
# the dot). Swept on an H200 at 8192 tokens, H 2048, E 128 (2, 3 stages; 4, 8 warps; BLOCK_H
# 64, 128; BLOCK_T 16-64): 64 rows, BLOCK_H 128, 4 warps took 22 us, against 9 + 11 us for
# cuBLAS's linear and the router kernel; 32 rows 28 us, 16 rows 47 us.
_LINEAR_TILE = 8192
_LINEAR_BLOCK_H = 128
# The weight's (BLOCK_H, BLOCK_E) tile, pipelined over 3 stages, is the kernel's shared
# memory: at most this many entries keeps it at 144 KiB for E = 128 and under 100 KiB above
# (compiled for sm_90 on the CPU), where 128 columns of 512 experts would need 264 KiB.
_LINEAR_W_TILE = 16384
# Experts at most for the layer's fused path. GPU time on an H200 (8192 tokens, H 2048),
# fused against cuBLAS + the router kernel: E 64 14 / 16 us, 128 22 / 20, 256 60 / 33, 512
# 157 / 69 — past 128 each program's narrower tiles re-read the weight more often than the
# launch it saves is worth to a forward queued behind other work.
_LINEAR_MAX_E = 128


def linear_supported(h: torch.Tensor, weight: torch.Tensor, lin_bias, n_group: int) -> bool:
    """Whether the layer runs ``launch_router_linear_fwd`` on these operands: 16-bit floats
    of one dtype with unit column strides, 16 (``tl.dot``'s smallest tile) to 128 experts
    (where it saves time), an ``(E,)`` bias or none, and a group layout the kernel runs.
    The launcher itself also runs wider expert counts (tested up to 512)."""
    e = weight.shape[0] if weight.dim() == 2 else 0
    return (h.dim() == 2 and weight.dim() == 2 and h.dtype in (torch.float16, torch.bfloat16)
            and weight.dtype == h.dtype and weight.shape[1] == h.shape[1]
            and h.stride(1) == 1 and weight.stride(1) == 1 and 16 <= e <= _LINEAR_MAX_E
            and (lin_bias is None or (lin_bias.dtype == h.dtype and lin_bias.shape == (e,)
                                      and lin_bias.stride(0) == 1))
            and groups_supported(e, n_group))


def launch_router_linear_fwd(h: torch.Tensor, weight: torch.Tensor, lin_bias=None, bias=None,
                             *, top_k: int, score_id: int, norm: bool, scale: float,
                             n_group: int = 1, topk_group: int = 1, top2_sum: bool = True,
                             topk_idx=None):
    """The router linear ``logits = h @ weight^T (+ lin_bias)`` and the routing in one
    launch; operands as ``linear_supported`` accepts them, the other arguments already
    validated by the caller (``moe_fn.kernels.router_linear_fwd`` does). With
    ``topk_idx`` (a recorded route) the experts are not chosen again: their weights are
    computed from the new logits. Returns ``(logits (T, E) in h's dtype, topk_idx, w,
    scores, raw)`` as ``launch_router_fwd``."""
    t, e = h.shape[0], weight.shape[0]
    logits = torch.empty((t, e), dtype=h.dtype, device=h.device)
    block_e = next_pow2(e)
    block_t = max(16, min(64, _LINEAR_TILE // block_e, next_pow2(t)))
    linear = (weight, lin_bias, logits, h.shape[1])
    out = _launch(h, bias, topk_idx, t, e, block_t, block_e, (h.stride(0), 1), linear,
                  top_k=top_k, score_id=score_id, norm=norm, scale=scale, n_group=n_group,
                  topk_group=topk_group, top2_sum=top2_sum, num_warps=4)
    return (logits, *out)


def _launch(x, bias, topk_idx, t, e, block_t, block_e, x_strides, linear, *, top_k, score_id,
            norm, scale, n_group, topk_group, top2_sum, num_warps):
    """Both launchers' shared part; ``linear`` is ``(weight, lin_bias, logits out, H)`` for the
    fused linear, else None (``x`` holds the logits)."""
    if not groups_supported(e, n_group):
        raise ValueError(f"the router kernel runs expert groups on a power-of-two expert "
                         f"count divisible by n_group; got E={e}, n_group={n_group}")
    dev = x.device
    idx = (torch.empty((t, top_k), dtype=torch.int64, device=dev) if topk_idx is None
           else topk_idx.contiguous())
    raw = torch.empty((t, top_k), dtype=torch.float32, device=dev)
    w = torch.empty((t, top_k), dtype=torch.float32, device=dev)
    scores = (torch.empty((t, e), dtype=torch.float32, device=dev) if score_id == 0 else None)
    if t == 0:
        return idx, w, scores, raw
    # The pure path adds bias.to(float32): the same rounding here. A replayed route makes no
    # choice, so the bias (which moves only the choice) is not read.
    b = bias.to(torch.float32).contiguous() if bias is not None and topk_idx is None else None
    if linear is None:
        tail, flags = (raw, raw, raw, 0, 0), {}  # unused without LINEAR
    else:
        weight, lin_bias, logits, h = linear
        tail = (weight, lin_bias if lin_bias is not None else raw, logits, h, weight.stride(0))
        flags = {"LINEAR": True, "HAS_LB": lin_bias is not None, "REPLAY": topk_idx is not None,
                 "BLOCK_H": max(16, min(_LINEAR_BLOCK_H, next_pow2(h),
                                        _LINEAR_W_TILE // block_e))}
    launch(_router_fwd_kernel, (cdiv(t, block_t),),
           x, b if b is not None else raw, idx, raw, w, scores if scores is not None else raw,
           t, e, x_strides[0], x_strides[1], float(scale), *tail,
           K=top_k, KP=next_pow2(top_k), SCORE=score_id, HAS_BIAS=b is not None,
           NORM=bool(norm), PRECISE=not interpreting(), N_GROUP=n_group,
           TOPK_GROUP=topk_group, TOP2=bool(top2_sum), BLOCK_T=block_t, BLOCK_E=block_e,
           **flags, num_warps=num_warps)
    return idx, w, scores, raw
