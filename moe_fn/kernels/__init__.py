"""Triton kernels registered as torch custom ops, with the signatures of ``moe_fn.pure``.

The activation and row-weighting functions here are drop-in replacements for the pure
pairs of the same names (same arguments, same ``Res`` NamedTuples, same outputs), so a
shell may call either module. They call the ``torch.ops.moe_fn.*`` custom ops (see
``_registry``): CUDA tensors of float16/bfloat16/float32 run the Triton kernels,
everything else the pure pair. The combine's sums are twins of ``moe_fn.pure.dispatch``'s
with what the exchanges need added: ``masked_gather_sum`` writes into ``out=`` (a view of
an exchange's buffer) where the pure one takes ``out_dtype=``, and
``weighted_gather_sum_bwd`` splits its row gradients at ``split`` (``hi_out=``), returning
three values.

Ops: ``swiglu_fwd``, ``swiglu_bwd``, ``swiglu_packed_fwd``, ``swiglu_packed_bwd``,
``row_weight_fwd``, ``row_weight_bwd``, ``gather_sum``, ``weighted_gather_sum``, and the FP8
rows of ``moe_fn.pure.fp8`` (same bits as the pure functions): ``quantize_rows`` and
``quantize_rows_packed`` (rows read through an index or not: the FP8 dispatch's gather and
quantisation in one pass), ``quantize_rows_t`` (expert weights transposed and quantised in
one pass), ``dequantize_rows``, and the packed activation with its
quantisation fused in, ``swiglu_packed_fwd_fp8`` (the FP8 rows of ``swiglu_packed_fwd``'s
output) and ``swiglu_packed_bwd_fp8`` (``d_gate_up`` and its FP8 rows in one kernel).
``router_fwd`` and ``router_linear_fwd`` (the router's linear and its routing in one launch)
are plain functions (no custom op): their Triton kernel runs in eager mode only. The
explicit Triton launchers (any device; CPU under ``TRITON_INTERPRET=1``) are
``moe_fn.kernels.activation.launch_*``, ``moe_fn.kernels.fp8.launch_*`` and
``moe_fn.kernels.row_weight.launch_*``.
``layout`` and ``layout_with_tokens`` are plain functions too: two or three Triton launches
for CUDA ``topk_idx`` in eager mode (``moe_fn.kernels.dispatch_layout.launch_layout``), the
pure ``layout`` elsewhere; so are the exchanges' layout halves around their host sync,
``peer_home_side`` / ``peer_receiver_side`` (``symm_mem``) and ``rows_home_side`` /
``rows_receiver_side`` (the collective row all_to_all), in ``moe_fn.kernels.peer_layout``.
"""

from __future__ import annotations

import sys

import torch

from ..pure import dispatch as _pure_dispatch
from ..pure import fp8 as _pure_fp8
from ..pure import peer_layout as _pure_peer_layout
from ..pure import router as _pure_router
from ..pure import row_weight as _pure_row_weight
from ..pure.activations import SwigluPackedRes, SwigluRes
from ..pure.fp8 import Fp8Rows
from ..pure.row_weight import RowWeightRes
from . import _registry
from ._registry import use_triton
from .dispatch_layout import launch_layout as _launch_layout
from .router import groups_supported, launch_router_fwd, launch_router_linear_fwd, linear_supported

__all__ = [
    "Fp8Rows",
    "dequantize_rows",
    "quantize_rows",
    "quantize_rows_packed",
    "quantize_rows_t",
    "swiglu_packed_bwd_fp8",
    "swiglu_packed_fwd_fp8",
    "gather_row_weight_bwd",
    "gather_sum_fwd",
    "gather_sum_own",
    "masked_gather_sum",
    "pack_rows",
    "copy_rows",
    "layout",
    "peer_home_side",
    "peer_receiver_side",
    "rows_home_side",
    "rows_receiver_side",
    "layout_with_tokens",
    "weighted_gather_sum_bwd",
    "weighted_gather_sum_fwd",
    "RowWeightRes",
    "SwigluPackedRes",
    "SwigluRes",
    "row_weight_bwd",
    "row_weight_fwd",
    "router_fwd",
    "router_linear_fwd",
    "router_linear_supported",
    "swiglu_bwd",
    "swiglu_fwd",
    "swiglu_packed_bwd",
    "swiglu_packed_fwd",
    "use_triton",
]

_ops = torch.ops.moe_fn


def _op(name: str):
    """The op's body in eager mode (no dispatcher hop), the registered op under compile."""
    if torch.compiler.is_compiling():
        return getattr(_ops, name)
    return _registry.EAGER[name]


def swiglu_fwd(gate, up, weights=None, *, act_id: int, alpha: float, limit: float):
    """``h = act(gate, up) [* weights]``; gate, up ``(N, I)``, weights ``(N,)``."""
    h = _op("swiglu_fwd")(gate, up, weights, act_id, alpha, limit)
    return h, SwigluRes(gate, up, weights, act_id, alpha, limit)


# h = act(g, u) * w:  dg = dh * w * da/dg,  du = dh * w * da/du,  dw = sum_j dh * act(g, u).
def swiglu_bwd(res: SwigluRes, dh, *, needs=(True, True, True)):
    """Returns ``(d_gate, d_up, d_weights)``; ``d_weights`` is None without weights."""
    dg, du, dw = _op("swiglu_bwd")(res.gate, res.up, res.weights, dh, res.act_id, res.alpha,
                                 res.limit, bool(needs[0]), bool(needs[1]), bool(needs[2]))
    return (dg if needs[0] else None, du if needs[1] else None,
            dw if (needs[2] and res.weights is not None) else None)


def swiglu_packed_fwd(gate_up, weights=None, *, act_id: int, alpha: float, limit: float,
                      layout_id: int):
    """``h = act(gate, up) [* weights]`` reading both halves of ``gate_up (N, 2I)`` in place."""
    h = _op("swiglu_packed_fwd")(gate_up, weights, act_id, alpha, limit, layout_id)
    return h, SwigluPackedRes(gate_up, weights, act_id, alpha, limit, layout_id)


def swiglu_packed_bwd(res: SwigluPackedRes, dh, *, needs=(True, True)):
    """Returns ``(d_gate_up, d_weights)``, ``d_gate_up`` packed in the input's layout."""
    dgu, dw = _op("swiglu_packed_bwd")(res.gate_up, res.weights, dh, res.act_id, res.alpha,
                                     res.limit, res.layout_id, bool(needs[0]), bool(needs[1]))
    return (dgu if needs[0] else None,
            dw if (needs[1] and res.weights is not None) else None)


def quantize_rows(x: torch.Tensor, index: torch.Tensor | None = None) -> Fp8Rows:
    """``moe_fn.pure.fp8.quantize_rows``: ``x (T, D)`` float16/bfloat16/float32, rows
    ``x[index]`` when given, into ``Fp8Rows(q (n, D) e4m3, scale (n,) float32)`` in one
    Triton pass for CUDA tensors."""
    q, scale = _op("quantize_rows")(x, index)
    return Fp8Rows(q, scale)


def quantize_rows_packed(x: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """``moe_fn.pure.fp8.quantize_rows_packed``: ``(n, D + 16)`` uint8 rows (e4m3 bytes,
    the float32 scale, 12 zero bytes); ``D % 16 == 0``."""
    return _op("quantize_rows_packed")(x, index)


def quantize_rows_t(w: torch.Tensor) -> Fp8Rows:
    """``moe_fn.pure.fp8.quantize_rows_t``: ``w (E, N, K)`` transposed and quantised per row
    of ``w[e].T`` in one pass, ``Fp8Rows(q (E, K, N), scale (E, K))``."""
    q, scale = _op("quantize_rows_t")(w)
    return Fp8Rows(q, scale)


def dequantize_rows(rows: Fp8Rows, dtype: torch.dtype) -> torch.Tensor:
    """``moe_fn.pure.fp8.dequantize_rows``: ``q * scale`` in ``dtype``; ``rows.q`` may be a
    row-strided view (of packed rows)."""
    _pure_fp8.check_fp8_rows(rows)
    return _op("dequantize_rows")(rows.q.view(torch.uint8), rows.scale, dtype)


def swiglu_packed_fwd_fp8(gate_up, weights=None, *, act_id: int, alpha: float, limit: float,
                          layout_id: int):
    """``(quantize_rows(h), res)`` of ``swiglu_packed_fwd`` in one kernel: the FP8 rows
    are the same bits as quantising the ``h`` that ``swiglu_packed_fwd`` returns."""
    q, scale = _op("swiglu_packed_fwd_fp8")(gate_up, weights, act_id, alpha, limit, layout_id)
    return Fp8Rows(q, scale), SwigluPackedRes(gate_up, weights, act_id, alpha, limit, layout_id)


# The derivative is swiglu_packed_bwd's; the FP8 rows are those of its d_gate_up.
def swiglu_packed_bwd_fp8(res, dh, *, needs=(True, True)):
    """``(d_gate_up, quantize_rows(d_gate_up), d_weights)`` of ``swiglu_packed_bwd`` in
    one kernel; ``d_weights`` is None without weights or ``needs[1]``."""
    _pure_fp8.check_fp8_bwd_needs(needs)
    dgu, q, scale, dw = _op("swiglu_packed_bwd_fp8")(res.gate_up, res.weights, dh, res.act_id,
                                                     res.alpha, res.limit, res.layout_id,
                                                     bool(needs[1]))
    return dgu, Fp8Rows(q, scale), (dw if (needs[1] and res.weights is not None) else None)


def row_weight_fwd(rows, weights):
    """``out = rows * weights[:, None]``."""
    out = _op("row_weight_fwd")(rows, weights)
    return out, RowWeightRes(rows, weights)


# d_rows = d_out * w;  d_w = sum_j d_out * rows.
def row_weight_bwd(res: RowWeightRes, d_out, *, needs=(True, True)):
    d_rows, d_w = _op("row_weight_bwd")(res.rows, res.weights, d_out, bool(needs[0]),
                                      bool(needs[1]))
    return (d_rows if needs[0] else None), (d_w if needs[1] else None)


def gather_sum_fwd(rows, index, top_k: int):
    """``out[t] = sum_j rows[index[t*k + j]]`` in one pass (the fused combine)."""
    out = _op("gather_sum")(rows, index, int(top_k))
    return out, _pure_dispatch.GatherSumRes(index, rows.shape[0], int(top_k))


def router_fwd(logits, bias=None, *, top_k: int, score_func: str = "softmax",
               norm_topk_prob: bool = False, n_group: int = 1, topk_group: int = 1,
               group_score: str = "top2_sum", routed_scaling_factor: float = 1.0,
               topk_idx=None):
    """``moe_fn.pure.router.router_fwd`` with its forward fused into one Triton launch.

    The kernel runs for CUDA float16/bfloat16/float32 logits without a replayed
    ``topk_idx`` (and, with expert groups, a power-of-two expert count), in eager mode;
    everything else returns the pure function. No custom op: under ``torch.compile`` the
    pure code is traced (Inductor fuses it itself).
    """
    pure = _pure_router
    if (topk_idx is not None or torch.compiler.is_compiling()
            or not isinstance(logits, torch.Tensor) or not use_triton(logits)
            or logits.dim() != 2 or not groups_supported(logits.shape[1], n_group)):
        return pure.router_fwd(logits, bias, top_k=top_k, score_func=score_func,
                               norm_topk_prob=norm_topk_prob, n_group=n_group,
                               topk_group=topk_group, group_score=group_score,
                               routed_scaling_factor=routed_scaling_factor, topk_idx=topk_idx)
    # The pure function's checks, so both paths raise the same errors.
    pure.check_router_args(logits, bias)
    num_experts = logits.shape[1]
    pure.router_validate(num_experts, top_k=top_k, score_func=score_func,
                         norm_topk_prob=norm_topk_prob, n_group=n_group,
                         topk_group=topk_group, group_score=group_score,
                         routed_scaling_factor=routed_scaling_factor)
    score_id = pure.SCORE_ID[score_func]
    idx, w, scores, raw = launch_router_fwd(
        logits, bias, top_k=top_k, score_id=score_id, norm=norm_topk_prob,
        scale=routed_scaling_factor, n_group=n_group, topk_group=topk_group,
        top2_sum=group_score == "top2_sum")
    res = pure.RouterRes(scores, idx, raw, num_experts, score_id, int(norm_topk_prob),
                         float(routed_scaling_factor), logits.dtype)
    return (idx, w), res


def router_linear_supported(h, weight, lin_bias, n_group: int) -> bool:
    """Whether ``router_linear_fwd`` runs the linear inside the router kernel: CUDA 16-bit
    floats of one dtype, unit column strides, 16 to 128 experts, eager mode (see
    ``moe_fn.kernels.router.linear_supported``)."""
    return (isinstance(h, torch.Tensor) and h.is_cuda and not torch.compiler.is_compiling()
            and linear_supported(h, weight, lin_bias, n_group))


def router_linear_fwd(h, weight, lin_bias=None, bias=None, *, top_k: int,
                      score_func: str = "softmax", norm_topk_prob: bool = False,
                      n_group: int = 1, topk_group: int = 1, group_score: str = "top2_sum",
                      routed_scaling_factor: float = 1.0, topk_idx=None):
    """``moe_fn.pure.router.router_linear_fwd``: where ``router_linear_supported``, the
    linear and the routing in one Triton launch (the Python wrappers of an eager layer's
    router cost its forward more host time than their kernels take), else ``F.linear`` and
    ``router_fwd`` (its kernel where it runs). The fused logits are accumulated in float32
    and rounded once, as cuBLAS does, but in another summation order, so they can differ
    from ``F.linear``'s in the last bit."""
    pure = _pure_router
    if not router_linear_supported(h, weight, lin_bias, n_group):
        return pure.router_linear_fwd(h, weight, lin_bias, bias, top_k=top_k,
                                      score_func=score_func, norm_topk_prob=norm_topk_prob,
                                      n_group=n_group, topk_group=topk_group,
                                      group_score=group_score,
                                      routed_scaling_factor=routed_scaling_factor,
                                      topk_idx=topk_idx, route_impl=sys.modules[__name__])
    num_experts = weight.shape[0]
    pure.router_validate(num_experts, top_k=top_k, score_func=score_func,
                         norm_topk_prob=norm_topk_prob, n_group=n_group,
                         topk_group=topk_group, group_score=group_score,
                         routed_scaling_factor=routed_scaling_factor)
    if bias is not None:
        pure.check_router_bias(bias, h, num_experts)
    if topk_idx is not None:
        pure.check_replayed_route(topk_idx, h.shape[0], top_k)
    score_id = pure.SCORE_ID[score_func]
    logits, idx, w, scores, raw = launch_router_linear_fwd(
        h, weight, lin_bias, bias, top_k=top_k, score_id=score_id, norm=norm_topk_prob,
        scale=routed_scaling_factor, n_group=n_group, topk_group=topk_group,
        top2_sum=group_score == "top2_sum", topk_idx=topk_idx)
    res = pure.RouterRes(scores, idx, raw, num_experts, score_id, int(norm_topk_prob),
                         float(routed_scaling_factor), h.dtype)
    return logits, (idx, w), pure.RouterLinearRes(h, weight, lin_bias is not None, res)


def weighted_gather_sum_fwd(rows, index, weights, top_k: int):
    """``out[t] = sum_j weights[t*k + j] * rows[index[t*k + j]]`` in one pass."""
    out = _op("weighted_gather_sum")(rows, index, weights, int(top_k))
    return out, _pure_dispatch.WeightedGatherSumRes(rows, index, weights, int(top_k))


def gather_sum_own(rows, index, top_k: int, weights=None, *, own, own_index, values=None,
                   own_values=None, values_out=None):
    """``moe_fn.pure.dispatch.gather_sum_own`` (the combine's sum reading the rank's own
    rows where they are, and the entries' values gathered alongside) in one pass on CUDA in
    eager mode. Not an op: the exchanges that call it run eagerly."""
    kw = dict(own=own, own_index=own_index, values=values, own_values=own_values,
              values_out=values_out)
    if use_triton(rows) and not torch.compiler.is_compiling():
        from .gather_sum import launch_gather_sum

        return launch_gather_sum(rows, index, int(top_k), weights, **kw)
    return _pure_dispatch.gather_sum_own(rows, index, int(top_k), weights, **kw)


def weighted_gather_sum_bwd(d_out, rows, pos_to_row, weights, top_k: int, *,
                            split: int | None = None, hi_out=None, hi_index=None,
                            lo_out=None):
    """The weighted combine's backward in one pass (see
    ``moe_fn.pure.dispatch.weighted_gather_sum_bwd``), its row gradients split at ``split``:
    returns ``(lo (split, H), hi, d_weights)``, ``lo`` written into ``lo_out`` when given
    (e.g. where a transport sends from), ``hi`` being the rows from ``split`` on
    (``(P - split, H)``) or ``hi_out`` when given, which receives them in order or, given
    ``hi_index``, at the rows it names. Not an op: the exchanges that call it run
    eagerly."""
    if use_triton(rows) and not torch.compiler.is_compiling():
        from .gather_sum import launch_weighted_gather_sum_bwd

        return launch_weighted_gather_sum_bwd(d_out, rows, pos_to_row, weights, top_k,
                                              split=split, hi_out=hi_out, hi_index=hi_index,
                                              lo_out=lo_out)
    d_rows, d_w = _pure_dispatch.weighted_gather_sum_bwd(d_out, rows, pos_to_row, weights,
                                                         top_k)
    return (*_pure_dispatch.split_rows(d_rows, split, hi_out, hi_index, lo_out), d_w)


def _use_layout_kernel(topk_idx) -> bool:
    return (isinstance(topk_idx, torch.Tensor) and topk_idx.is_cuda
            and not torch.compiler.is_compiling())


def layout(topk_idx, num_experts: int):
    """``moe_fn.pure.dispatch.layout`` (same outputs, bit for bit) in two or three Triton
    launches for CUDA tensors in eager mode; the pure function elsewhere. No custom op: under
    ``torch.compile`` the pure code is traced."""
    if not _use_layout_kernel(topk_idx):
        return _pure_dispatch.layout(topk_idx, num_experts)
    _pure_dispatch.check_layout_args(topk_idx, num_experts)
    return _launch_layout(topk_idx, num_experts)[:4]


def layout_with_tokens(topk_idx, num_experts: int):
    """``layout``'s 4-tuple plus ``token_of_sorted = perm // k`` (int64), which the kernel
    writes for free."""
    if not _use_layout_kernel(topk_idx):
        counts, offs, perm, inv_perm = _pure_dispatch.layout(topk_idx, num_experts)
        tokens = torch.div(perm, topk_idx.shape[1], rounding_mode="floor")
        return counts, offs, perm, inv_perm, tokens
    _pure_dispatch.check_layout_args(topk_idx, num_experts)
    return _launch_layout(topk_idx, num_experts)


def peer_home_side(c, offs, counts, topk_idx, inv_perm, rank: int, top_k: int):
    """``moe_fn.pure.peer_layout.peer_home_side`` (same outputs) in two Triton launches for
    CUDA counts in eager mode, the pure function elsewhere."""
    if not _use_layout_kernel(c):
        return _pure_peer_layout.peer_home_side(c, offs, counts, topk_idx, inv_perm, rank,
                                                top_k)
    from .peer_layout import launch_peer_home_side
    return launch_peer_home_side(c, offs, counts, topk_idx, inv_perm, rank, top_k)


def peer_receiver_side(c, recv_flat, rank: int, top_k: int, max_tokens: int, tables=None):
    """``moe_fn.pure.peer_layout.peer_receiver_side``; one Triton launch given the
    ``tables`` of the kernels' ``peer_home_side``."""
    if tables is None or not _use_layout_kernel(c):
        return _pure_peer_layout.peer_receiver_side(c, recv_flat, rank, top_k, max_tokens)
    from .peer_layout import launch_peer_receiver_side
    return launch_peer_receiver_side(c, recv_flat, rank, top_k, max_tokens, tables)


def rows_home_side(c, offs, counts, perm, token_of_sorted, rank: int, top_k: int):
    """``moe_fn.pure.peer_layout.rows_home_side`` (same outputs) in two Triton launches for
    CUDA counts in eager mode, the pure function elsewhere."""
    if not _use_layout_kernel(c):
        return _pure_peer_layout.rows_home_side(c, offs, counts, perm, token_of_sorted, rank,
                                                top_k)
    from .peer_layout import launch_rows_home_side
    return launch_rows_home_side(c, offs, counts, perm, token_of_sorted, rank, top_k)


def rows_receiver_side(c, num_rows: int, rank: int, recv_start: int, own_rows: int,
                       tables=None):
    """``moe_fn.pure.peer_layout.rows_receiver_side``; one Triton launch given the
    ``tables`` of the kernels' ``rows_home_side``."""
    if tables is None or not _use_layout_kernel(c):
        return _pure_peer_layout.rows_receiver_side(c, num_rows, rank, recv_start, own_rows)
    from .peer_layout import launch_rows_receiver_side
    return launch_rows_receiver_side(c, num_rows, rank, recv_start, own_rows, tables)


def gather_row_weight_bwd(src, index, rows, weights, *, own=None, own_tokens=None):
    """``moe_fn.pure.row_weight.gather_row_weight_bwd`` in one pass on CUDA in eager mode.
    Not an op: the exchanges that call it run eagerly."""
    if use_triton(rows) and not torch.compiler.is_compiling():
        from .gather_sum import launch_gather_row_weight_bwd

        return launch_gather_row_weight_bwd(src, index, rows, weights, own=own,
                                            own_tokens=own_tokens)
    return _pure_row_weight.gather_row_weight_bwd(src, index, rows, weights, own=own,
                                                  own_tokens=own_tokens)


def gather_rows(src, index, *, out=None):
    """``out[i] = src[index[i]]`` in one pass. Row-strided views (the row part of packed
    rows) are read and written as they are, by Triton on CUDA in eager mode; a contiguous
    ``src`` without ``out`` takes ``index_select`` (PyTorch's vectorised gather), as does
    everything elsewhere. Not an op: the exchanges that call it run eagerly."""
    strided = out is not None or not src.is_contiguous()
    if strided and use_triton(src) and not torch.compiler.is_compiling():
        from .gather_sum import launch_gather_rows

        return launch_gather_rows(src, index, out)
    rows = src.index_select(0, index)
    return rows if out is None else out.copy_(rows)


def copy_rows(src, index, out, out_index=None, *, values=None, values_index=None,
              values_out=None, num_programs=None):
    """``moe_fn.pure.dispatch.copy_rows`` in one pass on CUDA in eager mode (values too),
    where ``num_programs`` caps the Triton grid, so that a copy queued beside a collective
    leaves the collective's kernel SMs to start on. Not an op: the exchanges that call it
    run eagerly."""
    kw = dict(values=values, values_index=values_index, values_out=values_out)
    if use_triton(out) and not torch.compiler.is_compiling():
        from .gather_sum import launch_copy_rows

        return launch_copy_rows(src, index, out, out_index, num_programs=num_programs, **kw)
    return _pure_dispatch.copy_rows(src, index, out, out_index, **kw)


def pack_rows(rows, index, values, values_index, out, tail: int):
    """Packed rows ``out (n, W)``: ``out[i, :H] = rows[index[i]]`` (unless ``rows`` is
    None) and the raw bytes of ``values[values_index[i]]`` (``values[i]`` without an
    index) at byte ``tail`` of row i. One Triton pass on CUDA in eager mode, else a gather
    and a byte copy. Not an op: the exchanges that call it run eagerly."""
    if use_triton(out) and not torch.compiler.is_compiling():
        from .gather_sum import launch_pack_rows

        return launch_pack_rows(rows, index, values, values_index, out, tail)
    if rows is not None:
        gather_rows(rows, index, out=out[:, :rows.shape[1]])
    raw = _pure_dispatch.value_rows_bytes(values)
    out.view(torch.uint8)[:, tail:tail + raw.shape[1]].copy_(
        raw if values_index is None else raw.index_select(0, values_index))
    return out


def masked_gather_sum(rows, table, weights=None, *, out=None):
    """``moe_fn.pure.dispatch.masked_gather_sum`` in one Triton pass on CUDA (eager), into
    ``out`` (which may be a row-strided view) when given; the pure function elsewhere. Not
    an op: the exchanges that call it run eagerly."""
    if use_triton(rows) and not torch.compiler.is_compiling():
        from .gather_sum import launch_masked_gather_sum

        return launch_masked_gather_sum(rows, table, weights, out=out)
    result = _pure_dispatch.masked_gather_sum(rows, table, weights)
    return result if out is None else out.copy_(result)
