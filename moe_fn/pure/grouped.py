"""Grouped linear over experts: ``y[rows of e] = x[rows of e] @ weight[e]^T``.

``weight (E, out, in)`` is Hugging Face's layout; ``offs (E,)`` int32 holds cumulative row
ends (``torch._grouped_mm``'s convention): the rows of expert ``e`` are
``offs[e-1]:offs[e]`` (``0:offs[0]`` for the first). Callers guarantee
``offs[-1] == N`` (checked at the public API): ``_grouped_mm`` leaves rows past
``offs[-1]`` unwritten.

Float32/bfloat16/float16 operands whose strides meet ``_grouped_mm``'s 16-byte rule run
one grouped GEMM. Anything else (float64, widths that are not a multiple of 16 bytes)
runs a per-expert loop over ``offs.tolist()``: a documented host sync, the reference path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class GroupedLinearRes(NamedTuple):
    x: torch.Tensor  # (N, in)
    weight: torch.Tensor  # (E, out, in)
    offs: torch.Tensor  # (E,) int32, cumulative row ends, offs[-1] == N


def _operand_ok(t: torch.Tensor) -> bool:
    """``_grouped_mm``'s layout rule for one operand: one of the two innermost dims unit-
    stride, the other's stride a multiple of 16 bytes, the start 16-byte aligned."""
    if t.dtype not in GROUPED_MM_DTYPES:
        return False
    align = 16 // t.element_size()
    # Dynamo cannot read storage_offset() inside an autograd.Function; while compiling the
    # start is taken as aligned. The only views moe_fn makes are the gate/up weight halves,
    # starting I*H or H elements in: aligned whenever x's row stride H passes this check,
    # which every compiled (fullgraph, so grouped) forward needs anyway.
    if not torch.compiler.is_compiling() and t.storage_offset() % align:
        return False
    sm, sn = t.stride(-2), t.stride(-1)
    m, n = t.shape[-2], t.shape[-1]
    # Row-major is tried first, as _grouped_mm does: a (k, 1) column view must pass it.
    if sn == 1 and sm >= max(1, n):
        return sm % align == 0
    if sm == 1 and sn >= max(1, m):
        return sn % align == 0
    return False


def grouped_mm_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm(a, b, offs=...)`` accepts these operands.

    While torch.compile traces, only bfloat16: torch 2.13's fake (meta) ``_grouped_mm``
    accepts nothing else, so other dtypes take the loop (a graph break).
    """
    if torch.compiler.is_compiling() and a.dtype != torch.bfloat16:
        return False
    return a.dtype == b.dtype and _operand_ok(a) and _operand_ok(b)


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()  # host sync: reference path only
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


def grouped_linear_fwd(x, weight, offs):
    """``y (N, out)``: the rows of expert ``e`` times ``weight[e]^T``; x ``(N, in)``."""
    wt = weight.transpose(-2, -1)
    if grouped_mm_ok(x, wt):
        y = torch._grouped_mm(x, wt, offs=offs)
    else:
        parts = [x[s:e] @ weight[g].transpose(0, 1) for g, (s, e) in enumerate(_bounds(offs))]
        y = torch.cat(parts, dim=0) if parts else x.new_zeros(x.shape[0], weight.shape[1])
    return y, GroupedLinearRes(x, weight, offs)


# dx[rows of e] = dy[rows of e] @ W_e.
def grouped_linear_dx(dy, weight, offs):
    """Input gradient ``dx (N, in)`` from ``dy (N, out)``."""
    dy = dy.contiguous()
    if grouped_mm_ok(dy, weight):
        return torch._grouped_mm(dy, weight, offs=offs)
    parts = [dy[s:e] @ weight[g] for g, (s, e) in enumerate(_bounds(offs))]
    return torch.cat(parts, dim=0) if parts else dy.new_zeros(dy.shape[0], weight.shape[2])


# dW_e = dy[rows of e]^T @ x[rows of e]  (zeros for an expert with no rows).
def grouped_linear_dw(x, dy, offs):
    """Weight gradient ``(E, out, in)``; callable on its own (deferred dW)."""
    dy = dy.contiguous()
    x = x.contiguous()
    dyt = dy.transpose(0, 1)
    num_experts = offs.shape[0]
    if num_experts > 0 and grouped_mm_ok(dyt, x):
        dw = torch._grouped_mm(dyt, x, offs=offs)
        if dw.is_cuda and torch.cuda.get_device_capability(dw.device)[0] >= 10:
            # pytorch#172439: on Blackwell, empty groups' weight gradients come back non-zero
            # (Hopper and the CPU write zeros, which tests check).
            dw = zero_empty_groups(dw, offs)
        return dw
    parts = [dyt[:, s:e] @ x[s:e] for s, e in _bounds(offs)]
    if not parts:
        return x.new_zeros(0, dy.shape[1], x.shape[1])
    return torch.stack(parts, dim=0)


def zero_empty_groups(dw, offs):
    """``dw (E, out, in)`` with the experts that own no rows set to zero (no host sync)."""
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    return dw.masked_fill((counts == 0)[:, None, None], 0)


def grouped_linear_bwd(res: GroupedLinearRes, dy, *, needs=(True, True)):
    """Returns ``(dx, d_weight)``; None where ``needs`` says it is not wanted."""
    dx = grouped_linear_dx(dy, res.weight, res.offs) if needs[0] else None
    dw = grouped_linear_dw(res.x, dy, res.offs) if needs[1] else None
    return dx, dw
