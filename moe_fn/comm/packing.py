"""Packed rows: expert rows and per-row values (routing weights, their gradients) in one
collective, each packed row ``[row | the values' bytes | padding]``."""

from __future__ import annotations

import torch

from .. import kernels
from ..pure.dispatch import row_bytes


# The tail is a multiple of 16 bytes, and the values arrive bit for bit, whatever the two
# dtypes (unpacking copies them out, so an odd row width never leaves them misaligned).
def _slots(rows: torch.Tensor, values: torch.Tensor) -> int:
    return -(-row_bytes(values) // 16) * 16 // rows.element_size()


def packed_width(rows: torch.Tensor, values: torch.Tensor) -> int:
    """``H + slots``: the width of packed rows for ``rows (N, H)`` and ``values (M, C)``."""
    return rows.shape[1] + _slots(rows, values)


def new_packed(rows: torch.Tensor, n: int, values: torch.Tensor) -> torch.Tensor:
    """An ``(n, H + slots)`` buffer of the rows' dtype for rows and ``values (M, C)``."""
    return rows.new_empty((n, packed_width(rows, values)))


def value_bytes(packed: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The packed values' raw bytes in place: a row-strided ``(n, C * element size)`` uint8
    view of ``packed``, for ``values (M, C)`` the template."""
    start = (packed.shape[1] - _slots(packed, values)) * packed.element_size()
    return packed.view(torch.uint8)[:, start:start + row_bytes(values)]


def pack_rows(rows, index, values, values_index, out):
    """``out[i] = [rows[index[i]] | values[values_index[i]] | padding]`` in one pass on
    CUDA. With ``rows`` None only the values are written (the caller wrote the row part);
    with ``values_index`` None they are taken in order."""
    if out.shape[0] == 0:
        return out
    if values.shape[0] == 0:  # (empty tensors may not view as bytes): rows only
        if rows is not None:
            kernels.gather_rows(rows, index, out=out[:, :rows.shape[1]])
        return out
    tail = (out.shape[1] - _slots(out, values)) * out.element_size()
    return kernels.pack_rows(rows, index, values, values_index, out, tail)


def unpack_rows(packed, values_like, index=None):
    """``pack_rows`` undone: ``(row part, a row-strided view; the values (n, C))``, with
    ``values_like`` the packed values' template (their dtype and width); given ``index``,
    the values of rows ``index`` (one gather straight from the packed bytes)."""
    h = packed.shape[1] - _slots(packed, values_like)
    if (packed.shape[0] if index is None else index.numel()) == 0:
        return packed[:, :h], values_like.new_empty((0, values_like.shape[1]))
    raw = value_bytes(packed, values_like)
    # A copy either way: a contiguous slice (one row) may start at an offset the values'
    # dtype cannot view from (an odd row width).
    raw = (raw.clone(memory_format=torch.contiguous_format) if index is None
           else raw.index_select(0, index))
    return packed[:, :h], raw.view(values_like.dtype)
