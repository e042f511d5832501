"""Triton kernels for the gated activation family (``moe_fn.pure.activations`` is the contract).

One forward and one backward kernel serve every input form. Each takes a base pointer, a
row stride and a column stride for ``gate`` and for ``up``:

- separate ``(gate, up)``: two tensors, any strides (slices, transposes, expanded views);
- packed halves: the same storage, ``up`` offset by ``I`` columns;
- packed interleaved: ``gate`` at even columns, ``up`` at odd ones. With a unit column stride
  the kernel loads one contiguous ``(BLOCK_R, 2 * BLOCK_C)`` tile and splits the pairs in
  registers (``PAIRED``) so the loads stay vectorised; otherwise it reads two stride-2 views.

A program owns ``BLOCK_R`` rows and walks the ``I`` columns in ``BLOCK_C`` chunks, so the
``d_weights`` row reduction stays in registers (float32) and needs no atomics. Math runs in
float32; stores cast to the output dtype. Float64 is not a kernel dtype (the op layer sends
it to the pure path).

The FP8 expert path's variants (``FP8``) write ``pure.fp8.quantize_rows`` of what the plain
kernels store, in the same launch: the forward writes e4m3 rows of ``h`` and their scales
instead of ``h``; the backward writes ``d_gate_up`` and also its e4m3 rows. Each makes two
passes over a row block's columns, the first for the row amax of the values rounded to
the input dtype, the second to scale, round and store them (recomputed, or in the
backward optionally read back). The plain kernels compile as before (``FP8=False``).

On a GPU (not interpreting) the launch is autotuned over ``(BLOCK_R, BLOCK_C, num_warps)``
keyed on ``I`` and the static flags; ``MOE_FN_AUTOTUNE=0`` picks a fixed heuristic instead
(e.g. for CUDA-graph capture, where benchmarking is not allowed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._checks import env_flag
from ..pure.activations import LAYOUT_ID, split_packed
from ..pure.fp8 import FP8_DTYPE, Fp8Rows, pow2_scale
from ._launch import cdiv, int32_columns, interpreting, launch, next_pow2
from ._registry import KERNEL_DTYPES
from .fp8 import _abs_max, _e4m3_bytes, _pow2_scale


def _autotune_enabled() -> bool:
    return not interpreting() and env_flag("MOE_FN_AUTOTUNE", True)


# ----------------------------------------------------------------------------- math


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _act_fwd_math(g, u, alpha, limit, ACT: tl.constexpr):
    """``act(g, u)`` in float32; ACT: 0 swiglu, 1 swiglu_clamped, 2 swiglu_oai, 3 geglu_tanh."""
    if ACT == 0:
        a = g * _sigmoid(g) * u
    elif ACT == 1:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        a = gc * _sigmoid(gc) * uc
    elif ACT == 2:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        a = (uc + 1.0) * (gc * _sigmoid(alpha * gc))
    else:
        # 0.5 * (1 + tanh(z)) = sigmoid(2 z): no cancellation near tanh = -1.
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = g * _sigmoid(2.0 * z) * u
    return a


@triton.jit
def _act_bwd_math(g, u, alpha, limit, ACT: tl.constexpr):
    """``(act, d act/d g, d act/d u)`` in float32; clamps pass the gradient on the closed
    interval, as ``torch.clamp`` does."""
    if ACT == 0:
        s = _sigmoid(g)
        silu = g * s
        a = silu * u
        dg = u * s * (1.0 + g * (1.0 - s))
        du = silu
    elif ACT == 1:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        s = _sigmoid(gc)
        silu = gc * s
        a = silu * uc
        dg = (uc * s * (1.0 + gc * (1.0 - s))) * (g <= limit).to(tl.float32)
        du = silu * ((u >= -limit) & (u <= limit)).to(tl.float32)
    elif ACT == 2:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        t = alpha * gc
        s = _sigmoid(t)
        glu = gc * s
        a = (uc + 1.0) * glu
        # Where alpha * gc overflows the sigmoid is flat: its term is 0, not inf * 0.
        ts = tl.where(tl.abs(t) < float("inf"), t * (1.0 - s), 0.0)
        dg = ((uc + 1.0) * s * (1.0 + ts)) * (g <= limit).to(tl.float32)
        du = glu * ((u >= -limit) & (u <= limit)).to(tl.float32)
    else:
        # With s = sigmoid(2 z) = (1 + tanh z) / 2 and sm = sigmoid(-2 z) = 1 - s:
        # 0.5 (1 + t) = s and 1 - t^2 = 4 s sm, both free of cancellation.
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        s = _sigmoid(2.0 * z)
        sm = _sigmoid(-2.0 * z)
        gelu = g * s
        a = gelu * u
        dgelu = s + 2.0 * g * s * sm * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
        dg = u * dgelu
        du = gelu
    return a, dg, du


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _load_pair(g_ptr, u_ptr, rows, c0, rmask, I, s_gr, s_gc, s_ur, s_uc,
               PAIRED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = c0 + tl.arange(0, BLOCK_C)
    if PAIRED:
        # One contiguous tile of interleaved pairs (g0 u0 g1 u1 ...), split in registers.
        pcols = 2 * c0 + tl.arange(0, 2 * BLOCK_C)
        m = rmask[:, None] & (pcols < 2 * I)[None, :]
        x = tl.load(g_ptr + rows[:, None] * s_gr + pcols[None, :], mask=m, other=0.0)
        x = tl.reshape(x.to(tl.float32), (BLOCK_R, BLOCK_C, 2))
        g, u = tl.split(x)
    else:
        m = rmask[:, None] & (cols < I)[None, :]
        g = tl.load(g_ptr + rows[:, None] * s_gr + cols[None, :] * s_gc, mask=m, other=0.0)
        u = tl.load(u_ptr + rows[:, None] * s_ur + cols[None, :] * s_uc, mask=m, other=0.0)
        g = g.to(tl.float32)
        u = u.to(tl.float32)
    return g, u


@triton.jit
def _fwd_chunk(g_ptr, u_ptr, w, rows, c0, rmask, I, s_gr, s_gc, s_ur, s_uc, alpha, limit,
               ACT: tl.constexpr, HAS_W: tl.constexpr, PAIRED: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``act(g, u) [* w]`` in float32 on columns ``[c0, c0 + BLOCK_C)``; masked lanes
    read zeros."""
    g, u = _load_pair(g_ptr, u_ptr, rows, c0, rmask, I, s_gr, s_gc, s_ur, s_uc,
                      PAIRED, BLOCK_R, BLOCK_C)
    a = _act_fwd_math(g, u, alpha, limit, ACT)
    if HAS_W:
        a = a * w[:, None]
    return a


@triton.jit
def _act_fwd_kernel(g_ptr, u_ptr, w_ptr, h_ptr, s_ptr, N, I,
                    s_gr, s_gc, s_ur, s_uc, s_w, s_hr,
                    alpha, limit,
                    ACT: tl.constexpr, HAS_W: tl.constexpr, PAIRED: tl.constexpr,
                    FP8: tl.constexpr, ONE_CHUNK: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr):
    """``h = act(g, u) [* w]`` in gate's dtype; with ``FP8``, ``quantize_rows(h)`` instead:
    e4m3 bytes at ``h_ptr`` and row scales at ``s_ptr``, in two passes (the row amax of the
    rounded ``h``, then the same ``h`` again, scaled and rounded to e4m3), or with
    ``ONE_CHUNK`` (``I <= BLOCK_C``) in one, the row kept in registers."""
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    rmask = rows < N
    if HAS_W:
        w = tl.load(w_ptr + rows * s_w, mask=rmask, other=0.0).to(tl.float32)
    else:
        w = tl.zeros((BLOCK_R,), dtype=tl.float32)  # not read
    if FP8 and ONE_CHUNK:
        cols = tl.arange(0, BLOCK_C)
        m = rmask[:, None] & (cols < I)[None, :]
        a = _fwd_chunk(g_ptr, u_ptr, w, rows, 0, rmask, I, s_gr, s_gc, s_ur, s_uc,
                       alpha, limit, ACT, HAS_W, PAIRED, BLOCK_R, BLOCK_C)
        a = tl.where(m, a.to(g_ptr.dtype.element_ty).to(tl.float32), 0.0)
        scale, inv, bad = _pow2_scale(_abs_max(tl.zeros((BLOCK_R, BLOCK_C), tl.float32), a))
        tl.store(s_ptr + rows, scale, mask=rmask)
        tl.store(h_ptr + rows[:, None] * s_hr + cols[None, :],
                 _e4m3_bytes(a * inv[:, None], bad[:, None]), mask=m)
    elif FP8:
        acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
        for c0 in range(0, I, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            m = rmask[:, None] & (cols < I)[None, :]
            a = _fwd_chunk(g_ptr, u_ptr, w, rows, c0, rmask, I, s_gr, s_gc, s_ur, s_uc,
                           alpha, limit, ACT, HAS_W, PAIRED, BLOCK_R, BLOCK_C)
            a = a.to(g_ptr.dtype.element_ty).to(tl.float32)
            acc = _abs_max(acc, tl.where(m, a, 0.0))
        scale, inv, bad = _pow2_scale(acc)
        tl.store(s_ptr + rows, scale, mask=rmask)
        for c0 in range(0, I, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            m = rmask[:, None] & (cols < I)[None, :]
            a = _fwd_chunk(g_ptr, u_ptr, w, rows, c0, rmask, I, s_gr, s_gc, s_ur, s_uc,
                           alpha, limit, ACT, HAS_W, PAIRED, BLOCK_R, BLOCK_C)
            a = a.to(g_ptr.dtype.element_ty).to(tl.float32)
            tl.store(h_ptr + rows[:, None] * s_hr + cols[None, :],
                     _e4m3_bytes(a * inv[:, None], bad[:, None]), mask=m)
    else:
        for c0 in range(0, I, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            a = _fwd_chunk(g_ptr, u_ptr, w, rows, c0, rmask, I, s_gr, s_gc, s_ur, s_uc,
                           alpha, limit, ACT, HAS_W, PAIRED, BLOCK_R, BLOCK_C)
            m = rmask[:, None] & (cols < I)[None, :]
            tl.store(h_ptr + rows[:, None] * s_hr + cols[None, :],
                     a.to(h_ptr.dtype.element_ty), mask=m)


@triton.jit
def _bwd_chunk(g_ptr, u_ptr, w, dh_ptr, rows, c0, rmask, I,
               s_gr, s_gc, s_ur, s_uc, s_dhr, s_dhc, alpha, limit,
               ACT: tl.constexpr, HAS_W: tl.constexpr, NEED_DW: tl.constexpr,
               PAIRED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``(dg, du, this chunk's part of d_weights)`` in float32 on columns ``[c0, c0 +
    BLOCK_C)`` (the last is 0 unless ``HAS_W`` and ``NEED_DW``)."""
    cols = c0 + tl.arange(0, BLOCK_C)
    m = rmask[:, None] & (cols < I)[None, :]
    g, u = _load_pair(g_ptr, u_ptr, rows, c0, rmask, I, s_gr, s_gc, s_ur, s_uc,
                      PAIRED, BLOCK_R, BLOCK_C)
    dh = tl.load(dh_ptr + rows[:, None] * s_dhr + cols[None, :] * s_dhc, mask=m, other=0.0)
    dh = dh.to(tl.float32)
    a, da_dg, da_du = _act_bwd_math(g, u, alpha, limit, ACT)
    dw = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if HAS_W:
        if NEED_DW:
            dw = tl.sum(dh * a, axis=1)
        dh = dh * w[:, None]
    return dh * da_dg, dh * da_du, dw


@triton.jit
def _store_pair(dg_ptr, du_ptr, dg, du, rows, c0, rmask, I, s_dgr, s_dur,
                NEED_DG: tl.constexpr, NEED_DU: tl.constexpr, PAIRED_OUT: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``dg``/``du`` into their rows (``PAIRED_OUT``: interleaved pairs at ``dg_ptr``), cast
    to the pointers' dtype."""
    if PAIRED_OUT:
        pcols = 2 * c0 + tl.arange(0, 2 * BLOCK_C)
        pm = rmask[:, None] & (pcols < 2 * I)[None, :]
        x = tl.reshape(tl.join(dg, du), (BLOCK_R, 2 * BLOCK_C))
        tl.store(dg_ptr + rows[:, None] * s_dgr + pcols[None, :],
                 x.to(dg_ptr.dtype.element_ty), mask=pm)
    else:
        cols = c0 + tl.arange(0, BLOCK_C)
        m = rmask[:, None] & (cols < I)[None, :]
        if NEED_DG:
            tl.store(dg_ptr + rows[:, None] * s_dgr + cols[None, :],
                     dg.to(dg_ptr.dtype.element_ty), mask=m)
        if NEED_DU:
            tl.store(du_ptr + rows[:, None] * s_dur + cols[None, :],
                     du.to(du_ptr.dtype.element_ty), mask=m)


@triton.jit
def _store_fp8_pair(q_ptr, dg, du, inv, bad, rows, c0, rmask, I, s_qr,
                    PAIRED_OUT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The e4m3 bytes of ``dg``/``du`` (float32, rounded to the gradient's dtype already)
    scaled by ``inv`` into the packed rows at ``q_ptr``."""
    dg = dg * inv[:, None]
    du = du * inv[:, None]
    if PAIRED_OUT:
        pcols = 2 * c0 + tl.arange(0, 2 * BLOCK_C)
        pm = rmask[:, None] & (pcols < 2 * I)[None, :]
        x = tl.reshape(tl.join(dg, du), (BLOCK_R, 2 * BLOCK_C))
        tl.store(q_ptr + rows[:, None] * s_qr + pcols[None, :], _e4m3_bytes(x, bad[:, None]),
                 mask=pm)
    else:
        cols = c0 + tl.arange(0, BLOCK_C)
        m = rmask[:, None] & (cols < I)[None, :]
        q_rows = q_ptr + rows[:, None] * s_qr
        tl.store(q_rows + cols[None, :], _e4m3_bytes(dg, bad[:, None]), mask=m)
        tl.store(q_rows + I + cols[None, :], _e4m3_bytes(du, bad[:, None]), mask=m)


@triton.jit
def _act_bwd_kernel(g_ptr, u_ptr, w_ptr, dh_ptr, dg_ptr, du_ptr, dw_ptr, q_ptr, s_ptr, N, I,
                    s_gr, s_gc, s_ur, s_uc, s_w, s_dhr, s_dhc, s_dgr, s_dur, s_qr,
                    alpha, limit,
                    ACT: tl.constexpr, HAS_W: tl.constexpr, NEED_DG: tl.constexpr,
                    NEED_DU: tl.constexpr, NEED_DW: tl.constexpr, PAIRED: tl.constexpr,
                    PAIRED_OUT: tl.constexpr, FP8: tl.constexpr, REREAD: tl.constexpr,
                    ONE_CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``dg``, ``du`` (or their interleaved pairs) and ``d_weights``; with ``FP8`` (both
    gradients wanted) also ``quantize_rows`` of the packed gradient row as stored: e4m3
    bytes at ``q_ptr`` (same packing; the halves' ``du`` at column ``I``) and scales at
    ``s_ptr``, by a second pass that recomputes the gradients, or with ``REREAD`` reads
    back the ones this program stored (from L2, after a barrier: other threads of the
    program wrote them); with ``ONE_CHUNK`` (``I <= BLOCK_C``) in one pass, the gradients
    kept in registers."""
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    rmask = rows < N
    if HAS_W:
        w = tl.load(w_ptr + rows * s_w, mask=rmask, other=0.0).to(tl.float32)
    else:
        w = tl.zeros((BLOCK_R,), dtype=tl.float32)  # not read
    if FP8 and ONE_CHUNK:
        cols = tl.arange(0, BLOCK_C)
        m = rmask[:, None] & (cols < I)[None, :]
        dg, du, dw = _bwd_chunk(g_ptr, u_ptr, w, dh_ptr, rows, 0, rmask, I, s_gr, s_gc,
                                s_ur, s_uc, s_dhr, s_dhc, alpha, limit, ACT, HAS_W, NEED_DW,
                                PAIRED, BLOCK_R, BLOCK_C)
        if NEED_DW:
            tl.store(dw_ptr + rows, dw.to(dw_ptr.dtype.element_ty), mask=rmask)
        _store_pair(dg_ptr, du_ptr, dg, du, rows, 0, rmask, I, s_dgr, s_dur, NEED_DG,
                    NEED_DU, PAIRED_OUT, BLOCK_R, BLOCK_C)
        dg = tl.where(m, dg.to(dg_ptr.dtype.element_ty).to(tl.float32), 0.0)
        du = tl.where(m, du.to(dg_ptr.dtype.element_ty).to(tl.float32), 0.0)
        acc = _abs_max(_abs_max(tl.zeros((BLOCK_R, BLOCK_C), tl.float32), dg), du)
        scale, inv, bad = _pow2_scale(acc)
        tl.store(s_ptr + rows, scale, mask=rmask)
        _store_fp8_pair(q_ptr, dg, du, inv, bad, rows, 0, rmask, I, s_qr, PAIRED_OUT,
                        BLOCK_R, BLOCK_C)
    else:
        dw_acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)  # FP8: |d_gate_up| row maxima
        for c0 in range(0, I, BLOCK_C):
            dg, du, dw = _bwd_chunk(g_ptr, u_ptr, w, dh_ptr, rows, c0, rmask, I, s_gr, s_gc,
                                    s_ur, s_uc, s_dhr, s_dhc, alpha, limit, ACT, HAS_W, NEED_DW,
                                    PAIRED, BLOCK_R, BLOCK_C)
            if NEED_DW:
                dw_acc += dw
            _store_pair(dg_ptr, du_ptr, dg, du, rows, c0, rmask, I, s_dgr, s_dur, NEED_DG,
                        NEED_DU, PAIRED_OUT, BLOCK_R, BLOCK_C)
            if FP8:
                cols = c0 + tl.arange(0, BLOCK_C)
                m = rmask[:, None] & (cols < I)[None, :]
                dg = dg.to(dg_ptr.dtype.element_ty).to(tl.float32)
                du = du.to(dg_ptr.dtype.element_ty).to(tl.float32)
                acc = _abs_max(_abs_max(acc, tl.where(m, dg, 0.0)), tl.where(m, du, 0.0))
        if NEED_DW:  # implies HAS_W
            tl.store(dw_ptr + rows, dw_acc.to(dw_ptr.dtype.element_ty), mask=rmask)
        if FP8:
            scale, inv, bad = _pow2_scale(acc)
            tl.store(s_ptr + rows, scale, mask=rmask)
            if REREAD:
                tl.debug_barrier()
            for c0 in range(0, I, BLOCK_C):
                if REREAD:
                    cols = c0 + tl.arange(0, BLOCK_C)
                    m = rmask[:, None] & (cols < I)[None, :]
                    if PAIRED_OUT:
                        pcols = 2 * c0 + tl.arange(0, 2 * BLOCK_C)
                        pm = rmask[:, None] & (pcols < 2 * I)[None, :]
                        x = tl.load(dg_ptr + rows[:, None] * s_dgr + pcols[None, :], mask=pm,
                                    other=0.0)
                        dg, du = tl.split(tl.reshape(x, (BLOCK_R, BLOCK_C, 2)))
                    else:
                        dg = tl.load(dg_ptr + rows[:, None] * s_dgr + cols[None, :], mask=m,
                                     other=0.0)
                        du = tl.load(du_ptr + rows[:, None] * s_dur + cols[None, :], mask=m,
                                     other=0.0)
                else:
                    dg, du, _ = _bwd_chunk(g_ptr, u_ptr, w, dh_ptr, rows, c0, rmask, I, s_gr,
                                           s_gc, s_ur, s_uc, s_dhr, s_dhc, alpha, limit, ACT,
                                           HAS_W, False, PAIRED, BLOCK_R, BLOCK_C)
                dg = dg.to(dg_ptr.dtype.element_ty).to(tl.float32)
                du = du.to(dg_ptr.dtype.element_ty).to(tl.float32)
                _store_fp8_pair(q_ptr, dg, du, inv, bad, rows, c0, rmask, I, s_qr, PAIRED_OUT,
                                BLOCK_R, BLOCK_C)


# ----------------------------------------------------------------------------- launch config

# (BLOCK_R, BLOCK_C, num_warps): 0.5K-8K elements per column step; a short list keeps the
# first-call tuning (one compile per config and key) to seconds. The 128-column tiles serve
# the interleaved (GPT-OSS) backward with a routing weight, whose pair split, join and
# per-row reduction ran at 66-75% of copy bandwidth on wider tiles and at 84-85% on these
# (bench/RESULTS.md, activation kernels).
_CONFIGS = [
    triton.Config({"BLOCK_R": r, "BLOCK_C": c}, num_warps=nw)
    for r, c, nw in ((1, 1024, 4), (2, 1024, 4), (4, 1024, 8), (2, 512, 4), (4, 512, 4),
                     (8, 512, 8), (4, 256, 4), (16, 256, 8), (4, 128, 4), (8, 128, 8))
]


def _prune(configs, named_args, **kwargs):
    """Drop column blocks much wider than the row (all-masked lanes); keep at least one."""
    width = named_args["I"] if "I" in named_args else named_args["H"]
    width = next_pow2(max(int(width), 1))
    kept = [c for c in configs if c.kwargs["BLOCK_C"] <= max(width, 256)]
    return kept or configs[:1]


_KEYS_FWD = ["I", "ACT", "HAS_W", "PAIRED", "FP8"]
_KEYS_BWD = ["I", "ACT", "HAS_W", "NEED_DG", "NEED_DU", "NEED_DW", "PAIRED", "PAIRED_OUT",
             "FP8", "REREAD"]
_act_fwd_tuned = triton.autotune(_CONFIGS, key=_KEYS_FWD,
                                 prune_configs_by={"early_config_prune": _prune})(_act_fwd_kernel)
_act_bwd_tuned = triton.autotune(_CONFIGS, key=_KEYS_BWD,
                                 prune_configs_by={"early_config_prune": _prune})(_act_bwd_kernel)


def heuristic_blocks(width: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_C, num_warps)`` without autotuning (interpreter / MOE_FN_AUTOTUNE=0)."""
    if interpreting():
        # The interpreter runs one Python step per program: few, wide programs; a narrow
        # column block so small test widths still exercise the column loop and its masks.
        return 16, 32, 4
    block_c = min(max(next_pow2(max(width, 1)), 128), 1024)
    block_r = max(1, 4096 // block_c)
    return block_r, block_c, 8


# The FP8 variants keep a whole row in registers up to this width (one pass instead of two:
# at I = 768 the two-pass forward ran at 35% of copy bandwidth, the bf16 one at 72%).
ONE_CHUNK_MAX = 2048


def one_chunk_blocks(width: int):
    """``(BLOCK_R, BLOCK_C, num_warps)`` of the FP8 variants' one-pass launch, or None
    where a row is wider than ``ONE_CHUNK_MAX`` (the interpreter: wider than its 32-column
    blocks)."""
    if interpreting():
        return (16, 32, 4) if width <= 32 else None
    block_c = max(next_pow2(max(width, 1)), 128)
    if block_c > ONE_CHUNK_MAX:
        return None
    return max(1, 4096 // block_c), block_c, 8


def _launch(kernel, tuned, n_rows: int, width: int, *args, **meta):
    if "FP8" in meta:  # the activation kernels (row weighting shares this launcher)
        blocks = one_chunk_blocks(width) if meta["FP8"] else None
        if blocks is not None:
            block_r, block_c, nw = blocks
            launch(kernel, (cdiv(n_rows, block_r),), *args, **meta, ONE_CHUNK=True,
                   BLOCK_R=block_r, BLOCK_C=block_c, num_warps=nw)
            return
        meta["ONE_CHUNK"] = False
    if _autotune_enabled():
        launch(tuned, lambda m: (cdiv(n_rows, m["BLOCK_R"]),), *args,
               tune_key=(width,), **meta)
        return
    block_r, block_c, nw = heuristic_blocks(width)
    launch(kernel, (cdiv(n_rows, block_r),), *args, **meta, BLOCK_R=block_r,
           BLOCK_C=block_c, num_warps=nw)


# ----------------------------------------------------------------------------- launchers


def _check_kernel_dtype(t: torch.Tensor, name: str) -> None:
    if t.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name}: the Triton kernels take float16/bfloat16/float32, got {t.dtype}")


def _w_args(weights, ref):
    if weights is None:
        return ref, 0  # never read (HAS_W=False)
    return weights, weights.stride(0)


def _operands(g, u, paired_src):
    """Base pointers and (row, column) strides of gate and up: the views themselves, or
    for the paired path the interleaved source both are read from in one tile."""
    if paired_src is None:
        g, u = int32_columns(g), int32_columns(u)
        return g, u, (*g.stride(), *u.stride())
    return paired_src, paired_src, (paired_src.stride(0), 1, paired_src.stride(0), 1)


def _fwd(g, u, weights, act_id, alpha, limit, *, paired_src=None, fp8=False):
    """``h (N, I)`` in gate's dtype, or with ``fp8`` its ``Fp8Rows``."""
    n, i = g.shape
    if fp8:
        q = torch.empty((n, i), dtype=FP8_DTYPE, device=g.device)
        scale = torch.empty((n,), dtype=torch.float32, device=g.device)
        h, out = q.view(torch.uint8), Fp8Rows(q, scale)
        if i == 0:  # rows of nothing: the scale of a row of zeros
            scale.copy_(pow2_scale(scale.new_zeros(n)))
    else:
        h = torch.empty((n, i), dtype=g.dtype, device=g.device)
        scale, out = h, h
    if n == 0 or i == 0:
        return out
    w, s_w = _w_args(weights, g)
    gp, up, (s_gr, s_gc, s_ur, s_uc) = _operands(g, u, paired_src)
    _launch(_act_fwd_kernel, _act_fwd_tuned, n, i,
            gp, up, w, h, scale, n, i, s_gr, s_gc, s_ur, s_uc, s_w, h.stride(0),
            float(alpha), float(limit),
            ACT=int(act_id), HAS_W=weights is not None, PAIRED=paired_src is not None,
            FP8=bool(fp8))
    return out


def _bwd(g, u, weights, dh, act_id, alpha, limit, *, dg, du, need_dw, paired_src=None,
         paired_out=None, fp8=None, reread=False):
    """Writes ``dg``/``du`` (views or None) or ``paired_out``, and with ``fp8`` (the
    ``Fp8Rows`` of the packed gradient, both gradients written) their quantised rows, from
    recomputed gradients or (``reread``) the stored ones; returns ``d_weights`` or None."""
    n, i = g.shape
    has_w = weights is not None
    need_dw = bool(need_dw and has_w)
    dw = torch.empty((n,), dtype=weights.dtype, device=g.device) if need_dw else None
    if i == 0 and need_dw:
        dw.zero_()
    if fp8 is not None and i == 0:
        fp8.scale.copy_(pow2_scale(fp8.scale.new_zeros(n)))
    if n == 0 or i == 0 or not (dg is not None or du is not None or paired_out is not None
                                or need_dw):
        return dw
    w, s_w = _w_args(weights, g)
    gp, up, (s_gr, s_gc, s_ur, s_uc) = _operands(g, u, paired_src)
    dh = int32_columns(dh)
    out0 = paired_out if paired_out is not None else (dg if dg is not None else g)
    out1 = du if du is not None else g
    s_dgr = out0.stride(0)
    s_dur = out1.stride(0)
    if dg is not None or paired_out is not None:
        assert out0.stride(-1) == 1
    if du is not None:
        assert du.stride(-1) == 1
    if fp8 is not None:
        assert paired_out is not None or (dg is not None and du is not None)
        q, scale = fp8.q.view(torch.uint8), fp8.scale
        assert q.stride(-1) == 1
    else:
        q, scale = g, g
    _launch(_act_bwd_kernel, _act_bwd_tuned, n, i,
            gp, up, w, dh, out0, out1, dw if dw is not None else g, q, scale, n, i,
            s_gr, s_gc, s_ur, s_uc, s_w, dh.stride(0), dh.stride(1), s_dgr, s_dur, q.stride(0),
            float(alpha), float(limit),
            ACT=int(act_id), HAS_W=has_w, NEED_DG=dg is not None, NEED_DU=du is not None,
            NEED_DW=need_dw, PAIRED=paired_src is not None, PAIRED_OUT=paired_out is not None,
            FP8=fp8 is not None, REREAD=bool(reread and fp8 is not None))
    return dw


def launch_swiglu_fwd(gate, up, weights, act_id: int, alpha: float, limit: float):
    """Triton ``act(gate, up) [* weights]`` on any device (CPU needs TRITON_INTERPRET=1)."""
    _check_kernel_dtype(gate, "gate")
    return _fwd(gate, up, weights, act_id, alpha, limit)


def launch_swiglu_bwd(gate, up, weights, dh, act_id: int, alpha: float, limit: float,
                      needs=(True, True, True)):
    """Returns ``(d_gate | None, d_up | None, d_weights | None)``."""
    _check_kernel_dtype(gate, "gate")
    n, i = gate.shape
    dg = torch.empty((n, i), dtype=gate.dtype, device=gate.device) if needs[0] else None
    du = torch.empty((n, i), dtype=up.dtype, device=up.device) if needs[1] else None
    dw = _bwd(gate, up, weights, dh, act_id, alpha, limit, dg=dg, du=du, need_dw=needs[2])
    return dg, du, dw


def _packed_views(gate_up, layout_id):
    """``(g, u, paired_src)``: views of the halves and, for unit-stride interleaved input,
    the packed tensor itself for the vectorised pair load."""
    g, u = split_packed(gate_up, layout_id)
    paired = layout_id == LAYOUT_ID["interleaved"] and gate_up.stride(-1) == 1
    return g, u, (gate_up if paired else None)


def launch_swiglu_packed_fwd(gate_up, weights, act_id: int, alpha: float, limit: float,
                             layout_id: int):
    _check_kernel_dtype(gate_up, "gate_up")
    g, u, src = _packed_views(gate_up, layout_id)
    return _fwd(g, u, weights, act_id, alpha, limit, paired_src=src)


def launch_swiglu_packed_bwd(gate_up, weights, dh, act_id: int, alpha: float, limit: float,
                             layout_id: int, needs=(True, True)):
    """Returns ``(d_gate_up | None, d_weights | None)``; ``d_gate_up`` contiguous, same layout."""
    _check_kernel_dtype(gate_up, "gate_up")
    g, u, src = _packed_views(gate_up, layout_id)
    n, two_i = gate_up.shape
    dgu = torch.empty((n, two_i), dtype=gate_up.dtype, device=gate_up.device) if needs[0] \
        else None
    dg = du = paired_out = None
    if dgu is not None:
        if layout_id == LAYOUT_ID["interleaved"]:
            paired_out = dgu
        else:
            dg, du = split_packed(dgu, layout_id)
    dw = _bwd(g, u, weights, dh, act_id, alpha, limit, dg=dg, du=du, need_dw=needs[1],
              paired_src=src, paired_out=paired_out)
    return dgu, dw


# Whether the FP8 backward's second pass reads the stored d_gate_up back instead of
# recomputing it (bench/fp8_kernels_check.py times both).
REREAD_DEFAULT = False


def launch_swiglu_packed_fwd_fp8(gate_up, weights, act_id: int, alpha: float, limit: float,
                                 layout_id: int):
    """``quantize_rows`` of ``launch_swiglu_packed_fwd``'s ``h``, fused: ``Fp8Rows(q (N,
    I), scale (N,))``, the same bits as quantising that ``h``."""
    _check_kernel_dtype(gate_up, "gate_up")
    g, u, src = _packed_views(gate_up, layout_id)
    return _fwd(g, u, weights, act_id, alpha, limit, paired_src=src, fp8=True)


def launch_swiglu_packed_bwd_fp8(gate_up, weights, dh, act_id: int, alpha: float,
                                 limit: float, layout_id: int, need_weights: bool = True, *,
                                 reread: bool = REREAD_DEFAULT):
    """``(d_gate_up, quantize_rows(d_gate_up), d_weights | None)`` of
    ``launch_swiglu_packed_bwd`` in one kernel: the FP8 rows (same packing as ``d_gate_up``)
    are the same bits as quantising the ``d_gate_up`` it returns. The second pass
    recomputes the gradients, or with ``reread`` reads back the stored ones (less math,
    more L2 reads: the benchmark says which is faster)."""
    _check_kernel_dtype(gate_up, "gate_up")
    g, u, src = _packed_views(gate_up, layout_id)
    n, two_i = gate_up.shape
    dgu = torch.empty((n, two_i), dtype=gate_up.dtype, device=gate_up.device)
    rows = Fp8Rows(torch.empty((n, two_i), dtype=FP8_DTYPE, device=gate_up.device),
                   torch.empty((n,), dtype=torch.float32, device=gate_up.device))
    dg = du = paired_out = None
    if layout_id == LAYOUT_ID["interleaved"]:
        paired_out = dgu
    else:
        dg, du = split_packed(dgu, layout_id)
    dw = _bwd(g, u, weights, dh, act_id, alpha, limit, dg=dg, du=du, need_dw=need_weights,
              paired_src=src, paired_out=paired_out, fp8=rows, reread=reread)
    return dgu, rows, dw
