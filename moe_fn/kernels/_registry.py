"""The kernels as torch custom ops (namespace ``moe_fn``), each with a fake.

Every op runs the Triton kernel for CUDA tensors of a kernel dtype (float16, bfloat16,
float32) and the pure pair for everything else (CPU, float64), so the ops are usable and
``opcheck``-able everywhere. Custom ops cannot return ``None``: a gradient that was not
asked for (``need_*`` False, or ``d_weights`` without weights) comes back as an empty
tensor and the Python wrappers in ``moe_fn.kernels`` turn it into ``None``. No autograd is
registered here: autograd lives in the shells (``moe_fn.autograd``).

(No ``from __future__ import annotations`` here: ``custom_op`` reads the annotations as
the op schema.)
"""

import torch

from ..pure import activations as _pa
from ..pure import dispatch as _pd
from ..pure import fp8 as _pf
from ..pure import row_weight as _pr

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# The ops' plain Python bodies by op name. Eager callers use these directly: going through
# the dispatcher costs tens of microseconds of host time per call, which a layer forward
# (launch-bound at training sizes) pays on its critical path. Compiled code uses the ops.
EAGER = {}


def _custom_op(name: str):
    def register(fn):
        EAGER[name] = fn
        return torch.library.custom_op(f"moe_fn::{name}", mutates_args=())(fn)
    return register


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op with input ``t`` runs the Triton kernel (CUDA, non-float64)."""
    return t.is_cuda and t.dtype in KERNEL_DTYPES


def _empty(ref: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty((0,), dtype=ref.dtype if dtype is None else dtype, device=ref.device)


def _fresh(t: torch.Tensor | None, ref: torch.Tensor, dtype=None) -> torch.Tensor:
    return _empty(ref, dtype) if t is None else t.contiguous()


def _check_dh(dh: torch.Tensor, shape) -> None:
    if not isinstance(dh, torch.Tensor) or tuple(dh.shape) != tuple(shape):
        got = tuple(dh.shape) if isinstance(dh, torch.Tensor) else type(dh).__name__
        raise ValueError(f"the incoming gradient must have shape {tuple(shape)}, got {got}")


def _dw_dtype(weights, ref):
    return ref.dtype if weights is None else weights.dtype


# ----------------------------------------------------------------------------- swiglu


@_custom_op("swiglu_fwd")
def swiglu_fwd_op(gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor | None,
                  act_id: int, alpha: float, limit: float) -> torch.Tensor:
    _pa.check_swiglu_args(gate, up, weights)
    if use_triton(gate):
        from . import activation

        return activation.launch_swiglu_fwd(gate, up, weights, act_id, alpha, limit)
    h, _ = _pa.swiglu_fwd(gate, up, weights, act_id=act_id, alpha=alpha, limit=limit)
    return h.contiguous()


@swiglu_fwd_op.register_fake
def _(gate, up, weights, act_id, alpha, limit):
    _pa.check_swiglu_args(gate, up, weights)
    return gate.new_empty(gate.shape)


@_custom_op("swiglu_bwd")
def swiglu_bwd_op(gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor | None,
                  dh: torch.Tensor, act_id: int, alpha: float, limit: float,
                  need_gate: bool, need_up: bool, need_weights: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _pa.check_swiglu_args(gate, up, weights)
    _check_dh(dh, gate.shape)
    needs = (need_gate, need_up, need_weights)
    if use_triton(gate):
        from . import activation

        dg, du, dw = activation.launch_swiglu_bwd(gate, up, weights, dh, act_id, alpha, limit,
                                                  needs)
    else:
        res = _pa.SwigluRes(gate, up, weights, act_id, alpha, limit)
        dg, du, dw = _pa.swiglu_bwd(res, dh, needs=needs)
    return (_fresh(dg, gate), _fresh(du, up),
            _fresh(dw if need_weights else None, gate, _dw_dtype(weights, gate)))


@swiglu_bwd_op.register_fake
def _(gate, up, weights, dh, act_id, alpha, limit, need_gate, need_up, need_weights):
    _pa.check_swiglu_args(gate, up, weights)
    _check_dh(dh, gate.shape)
    dg = gate.new_empty(gate.shape) if need_gate else _empty(gate)
    du = up.new_empty(up.shape) if need_up else _empty(up)
    if weights is not None and need_weights:
        dw = weights.new_empty(weights.shape)
    else:
        dw = _empty(gate, _dw_dtype(weights, gate))
    return dg, du, dw


@_custom_op("swiglu_packed_fwd")
def swiglu_packed_fwd_op(gate_up: torch.Tensor, weights: torch.Tensor | None, act_id: int,
                         alpha: float, limit: float, layout_id: int) -> torch.Tensor:
    _pa.check_swiglu_packed_args(gate_up, weights)
    if use_triton(gate_up):
        from . import activation

        return activation.launch_swiglu_packed_fwd(gate_up, weights, act_id, alpha, limit,
                                                   layout_id)
    h, _ = _pa.swiglu_packed_fwd(gate_up, weights, act_id=act_id, alpha=alpha, limit=limit,
                                 layout_id=layout_id)
    return h.contiguous()


@swiglu_packed_fwd_op.register_fake
def _(gate_up, weights, act_id, alpha, limit, layout_id):
    _pa.check_swiglu_packed_args(gate_up, weights)
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@_custom_op("swiglu_packed_bwd")
def swiglu_packed_bwd_op(gate_up: torch.Tensor, weights: torch.Tensor | None,
                         dh: torch.Tensor, act_id: int, alpha: float, limit: float,
                         layout_id: int, need_gate_up: bool, need_weights: bool
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    _pa.check_swiglu_packed_args(gate_up, weights)
    _check_dh(dh, (gate_up.shape[0], gate_up.shape[1] // 2))
    needs = (need_gate_up, need_weights)
    if use_triton(gate_up):
        from . import activation

        dgu, dw = activation.launch_swiglu_packed_bwd(gate_up, weights, dh, act_id, alpha,
                                                      limit, layout_id, needs)
    else:
        res = _pa.SwigluPackedRes(gate_up, weights, act_id, alpha, limit, layout_id)
        dgu, dw = _pa.swiglu_packed_bwd(res, dh, needs=needs)
    return (_fresh(dgu, gate_up),
            _fresh(dw if need_weights else None, gate_up, _dw_dtype(weights, gate_up)))


@swiglu_packed_bwd_op.register_fake
def _(gate_up, weights, dh, act_id, alpha, limit, layout_id, need_gate_up, need_weights):
    _pa.check_swiglu_packed_args(gate_up, weights)
    _check_dh(dh, (gate_up.shape[0], gate_up.shape[1] // 2))
    dgu = gate_up.new_empty(gate_up.shape) if need_gate_up else _empty(gate_up)
    if weights is not None and need_weights:
        dw = weights.new_empty(weights.shape)
    else:
        dw = _empty(gate_up, _dw_dtype(weights, gate_up))
    return dgu, dw


# ----------------------------------------------------------------------------- row weighting


@_custom_op("row_weight_fwd")
def row_weight_fwd_op(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    _pr.check_row_weight_args(rows, weights)
    if use_triton(rows):
        from . import row_weight

        return row_weight.launch_row_weight_fwd(rows, weights)
    out, _ = _pr.row_weight_fwd(rows, weights)
    return out.contiguous()


@row_weight_fwd_op.register_fake
def _(rows, weights):
    _pr.check_row_weight_args(rows, weights)
    return rows.new_empty(rows.shape)


@_custom_op("row_weight_bwd")
def row_weight_bwd_op(rows: torch.Tensor, weights: torch.Tensor, d_out: torch.Tensor,
                      need_rows: bool, need_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    _pr.check_row_weight_args(rows, weights)
    _check_dh(d_out, rows.shape)
    needs = (need_rows, need_weights)
    if use_triton(rows):
        from . import row_weight

        dx, dw = row_weight.launch_row_weight_bwd(rows, weights, d_out, needs)
    else:
        dx, dw = _pr.row_weight_bwd(_pr.RowWeightRes(rows, weights), d_out, needs=needs)
    return _fresh(dx, rows), _fresh(dw, weights)


@row_weight_bwd_op.register_fake
def _(rows, weights, d_out, need_rows, need_weights):
    _pr.check_row_weight_args(rows, weights)
    _check_dh(d_out, rows.shape)
    dx = rows.new_empty(rows.shape) if need_rows else _empty(rows)
    dw = weights.new_empty(weights.shape) if need_weights else _empty(weights)
    return dx, dw


# ----------------------------------------------------------------------------- gather_sum


@_custom_op("gather_sum")
def gather_sum_op(rows: torch.Tensor, index: torch.Tensor, top_k: int) -> torch.Tensor:
    if index.dim() != 1 or index.numel() % top_k:
        raise ValueError(f"index must be 1-D with a multiple of top_k={top_k} entries, got "
                         f"shape {tuple(index.shape)}")
    if use_triton(rows):
        from . import gather_sum

        return gather_sum.launch_gather_sum(rows, index, top_k)
    out, _ = _pd.gather_sum_fwd(rows, index, top_k)
    return out.contiguous()


@gather_sum_op.register_fake
def _(rows, index, top_k):
    return rows.new_empty((index.shape[0] // top_k, rows.shape[1]))


@_custom_op("weighted_gather_sum")
def weighted_gather_sum_op(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                           top_k: int) -> torch.Tensor:
    if index.dim() != 1 or index.numel() % top_k or weights.shape != index.shape:
        raise ValueError(f"index and weights must be 1-D with one entry per routed row (a "
                         f"multiple of top_k={top_k}), got {tuple(index.shape)} and "
                         f"{tuple(weights.shape)}")
    if use_triton(rows):
        from . import gather_sum

        return gather_sum.launch_gather_sum(rows, index, top_k, weights)
    out, _ = _pd.weighted_gather_sum_fwd(rows, index, weights, top_k)
    return out.contiguous()


@weighted_gather_sum_op.register_fake
def _(rows, index, weights, top_k):
    return rows.new_empty((index.shape[0] // top_k, rows.shape[1]))


# ----------------------------------------------------------------------------- FP8 rows


@_custom_op("quantize_rows")
def quantize_rows_op(x: torch.Tensor, index: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    _pf.check_quantize_args(x, index)
    if use_triton(x):
        from . import fp8

        q, scale = fp8.launch_quantize_rows(x, index)
    else:
        q, scale = _pf.quantize_rows(x, index)
    return q.contiguous(), scale


@quantize_rows_op.register_fake
def _(x, index):
    _pf.check_quantize_args(x, index, values=False)
    n = x.shape[0] if index is None else index.shape[0]
    return x.new_empty((n, x.shape[1]), dtype=_pf.FP8_DTYPE), x.new_empty((n,),
                                                                           dtype=torch.float32)


@_custom_op("quantize_rows_packed")
def quantize_rows_packed_op(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    _pf.check_quantize_args(x, index, packed=True)
    if use_triton(x):
        from . import fp8

        return fp8.launch_quantize_rows_packed(x, index)
    return _pf.quantize_rows_packed(x, index)


@quantize_rows_packed_op.register_fake
def _(x, index):
    _pf.check_quantize_args(x, index, packed=True, values=False)
    n = x.shape[0] if index is None else index.shape[0]
    return x.new_empty((n, x.shape[1] + _pf.PACK_TAIL), dtype=torch.uint8)


@_custom_op("quantize_rows_t")
def quantize_rows_t_op(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _pf.check_quantize_t_args(w)
    if use_triton(w):
        from . import fp8

        q, scale = fp8.launch_quantize_rows_t(w)
    else:
        q, scale = _pf.quantize_rows_t(w)
    return q.contiguous(), scale.contiguous()


@quantize_rows_t_op.register_fake
def _(w):
    _pf.check_quantize_t_args(w)
    e, n, k = w.shape
    return w.new_empty((e, k, n), dtype=_pf.FP8_DTYPE), w.new_empty((e, k),
                                                                      dtype=torch.float32)


def _check_dequantize_args(q_bytes, scale, dtype) -> _pf.Fp8Rows:
    """The op takes the e4m3 rows as their bytes (uint8): ``opcheck``'s schema test
    compares inputs with ``allclose``, which has no float8 kernel on CPU."""
    if not isinstance(q_bytes, torch.Tensor) or q_bytes.dtype != torch.uint8:
        got = q_bytes.dtype if isinstance(q_bytes, torch.Tensor) else type(q_bytes).__name__
        raise TypeError(f"dequantize_rows takes the e4m3 rows as uint8 bytes (rows.q.view("
                        f"torch.uint8)), got {got}")
    rows = _pf.Fp8Rows(q_bytes.view(_pf.FP8_DTYPE), scale)
    _pf.check_fp8_rows(rows)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dequantize_rows: dtype must be a floating torch.dtype, got {dtype!r}")
    return rows


@_custom_op("dequantize_rows")
def dequantize_rows_op(q_bytes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                       ) -> torch.Tensor:
    rows = _check_dequantize_args(q_bytes, scale, dtype)
    if use_triton(scale) and dtype in KERNEL_DTYPES:  # scale: float32 on q's device
        from . import fp8

        return fp8.launch_dequantize_rows(rows, dtype)
    return _pf.dequantize_rows(rows, dtype).contiguous()


@dequantize_rows_op.register_fake
def _(q_bytes, scale, dtype):
    _check_dequantize_args(q_bytes, scale, dtype)
    return q_bytes.new_empty(q_bytes.shape, dtype=dtype)


@_custom_op("swiglu_packed_fwd_fp8")
def swiglu_packed_fwd_fp8_op(gate_up: torch.Tensor, weights: torch.Tensor | None, act_id: int,
                             alpha: float, limit: float, layout_id: int
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    _pa.check_swiglu_packed_args(gate_up, weights)
    _pf.check_fp8_source("gate_up", gate_up)
    if use_triton(gate_up):
        from . import activation

        q, scale = activation.launch_swiglu_packed_fwd_fp8(gate_up, weights, act_id, alpha,
                                                           limit, layout_id)
    else:
        (q, scale), _ = _pf.swiglu_packed_fwd_fp8(gate_up, weights, act_id=act_id, alpha=alpha,
                                                  limit=limit, layout_id=layout_id)
    return q.contiguous(), scale


@swiglu_packed_fwd_fp8_op.register_fake
def _(gate_up, weights, act_id, alpha, limit, layout_id):
    _pa.check_swiglu_packed_args(gate_up, weights)
    _pf.check_fp8_source("gate_up", gate_up)
    n, i = gate_up.shape[0], gate_up.shape[1] // 2
    return (gate_up.new_empty((n, i), dtype=_pf.FP8_DTYPE),
            gate_up.new_empty((n,), dtype=torch.float32))


@_custom_op("swiglu_packed_bwd_fp8")
def swiglu_packed_bwd_fp8_op(gate_up: torch.Tensor, weights: torch.Tensor | None,
                             dh: torch.Tensor, act_id: int, alpha: float, limit: float,
                             layout_id: int, need_weights: bool
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _pa.check_swiglu_packed_args(gate_up, weights)
    _pf.check_fp8_source("gate_up", gate_up)
    _check_dh(dh, (gate_up.shape[0], gate_up.shape[1] // 2))
    if use_triton(gate_up):
        from . import activation

        dgu, (q, scale), dw = activation.launch_swiglu_packed_bwd_fp8(
            gate_up, weights, dh, act_id, alpha, limit, layout_id, need_weights)
    else:
        res = _pa.SwigluPackedRes(gate_up, weights, act_id, alpha, limit, layout_id)
        dgu, (q, scale), dw = _pf.swiglu_packed_bwd_fp8(res, dh, needs=(True, need_weights))
    return (dgu.contiguous(), q.contiguous(), scale,
            _fresh(dw if need_weights else None, gate_up, _dw_dtype(weights, gate_up)))


@swiglu_packed_bwd_fp8_op.register_fake
def _(gate_up, weights, dh, act_id, alpha, limit, layout_id, need_weights):
    _pa.check_swiglu_packed_args(gate_up, weights)
    _pf.check_fp8_source("gate_up", gate_up)
    _check_dh(dh, (gate_up.shape[0], gate_up.shape[1] // 2))
    if weights is not None and need_weights:
        dw = weights.new_empty(weights.shape)
    else:
        dw = _empty(gate_up, _dw_dtype(weights, gate_up))
    return (gate_up.new_empty(gate_up.shape), gate_up.new_empty(gate_up.shape,
                                                                dtype=_pf.FP8_DTYPE),
            gate_up.new_empty((gate_up.shape[0],), dtype=torch.float32), dw)
