"""The Exchange protocol, its counters, pending results and the SM carveout."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .. import kernels
from ..pure.dispatch import row_bytes
from ..pure.row_weight import RowWeightRes

COUNTER_KEYS = ("layout", "dispatch", "cached_dispatch", "combine", "combine_skipped",
                "dispatch_backward", "combine_backward")


def sm_count(device) -> int:
    """The CUDA device's streaming multiprocessors."""
    return torch.cuda.get_device_properties(device).multi_processor_count


class Pending:
    """A result whose communication may still be in flight: ``wait()`` finishes it once."""

    def __init__(self, finish: Callable[[], Any]):
        self._finish = finish
        self._done = False
        self._value = None

    def wait(self):
        if not self._done:
            self._value = self._finish()
            self._done = True
            self._finish = None
        return self._value


class Exchange:
    """Moves expert rows between the ranks of an expert-parallel group.

    Rank r owns the contiguous global experts ``[r*E_local, (r+1)*E_local)``. Methods:

    - ``layout(plan) -> layout``: what the dispatch needs to know before it runs.
    - ``dispatch_fwd(x, weights, layout, *, cached) -> (rows, row_weights, handle)``: token
      rows ``x (T, H)`` and routing weights ``(T, k)`` to expert rows ``(N, H)`` grouped by
      local expert (``handle.local_offs``), each with its routing weight. The handle is
      what later moves of the same route reuse. ``cached=True`` replays a dispatch with the
      handle it returned (no layout exchange, no host sync).
    - ``dispatch_bwd(handle, d_rows, d_row_weights, *, async_op) -> (dx, d_weights)`` (or a
      ``Pending`` when ``async_op``): row gradients back to their tokens, summed over k.
    - ``combine_fwd(rows, handle) -> (out, handle)``: expert rows back to their tokens, summed
      over k (weights are applied on the expert side, so the sum is unweighted).
    - ``combine_bwd(handle, d_out) -> d_rows``: a cached dispatch of the output gradient.

    Exchanges whose rows come home one by one (``home_weighting = True``: local and
    all_to_all) also offer ``combine_weighted_fwd(rows, weights, handle, *, keep=True) ->
    (out, saved)`` (``saved`` None with ``keep=False``, when no backward will run) and
    ``combine_weighted_bwd(handle, d_out, weights, saved) -> (d_rows, d_weights)``: the
    routing weights applied at home inside the sum, so they never travel to the experts and
    the expert-side weighting pass disappears (MoELayer uses them with
    ``combine_impl="fused"``, where the weighted sum is one kernel). DeepEP sums on the
    expert side, so its weights must be applied before its combine.

    ``counters`` counts each of these so tests and users can see what ran.
    """

    backend: str = "?"
    home_weighting: bool = False
    # The combine can fold expert-side row weights into its per-token sum
    # (``combine_row_weighted_fwd``; see ``moe_fn.comm.tokens``).
    folds_row_weights: bool = False
    # ... and weights them in float32 there, with the float32 routing weights the dispatch
    # delivered, as a home-weighted sum would: then the fused combine folds them in too.
    folds_row_weights_exactly: bool = False
    # Where an overlapped backward combine runs its gathers (``start_dispatch_bwd``).
    combine_on_side_stream: bool = True

    def __init__(self, *, num_experts: int, ep_size: int = 1, rank: int = 0, group=None):
        if num_experts % ep_size:
            raise ValueError(f"ep_size ({ep_size}) must divide num_experts ({num_experts})")
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.rank = rank
        self.group = group
        self.num_local_experts = num_experts // ep_size
        self.counters: Counter = Counter({k: 0 for k in COUNTER_KEYS})

    def start_dispatch_bwd(self, handle, d_rows, d_row_weights) -> Pending:
        """Start the dispatch backward (the combine of dX) so that it overlaps what the
        caller runs next; ``wait()`` on the result returns ``(dx, d_weights)``.

        With ``combine_on_side_stream`` (CUDA) the whole combine (gathers, exchange,
        per-token sums) runs on a side stream, so only the SMs the caller leaves free (the
        GEMMs' carveout) serve it. Otherwise the gathers before the transfer run at once
        on the caller's stream with the whole GPU, the transfer runs asynchronously
        (NCCL's own stream) beside what the caller runs next, and the sums after it run
        in ``wait()``.
        """
        if not d_rows.is_cuda or not self.combine_on_side_stream:
            return self.dispatch_bwd(handle, d_rows, d_row_weights, async_op=True)
        main, side = self._side_stream_after(d_rows.device, d_rows, d_row_weights)
        with torch.cuda.stream(side):
            dx, d_w = self.dispatch_bwd(handle, d_rows, d_row_weights)
        return self._joined(main, side, dx, d_w)

    def _side_stream_after(self, device, *inputs):
        """``(main, side)``: this exchange's side stream, ordered after the work queued on
        the current stream so far, with ``inputs`` (``None`` skipped) recorded as used by
        it so that their memory outlives its reads."""
        main = torch.cuda.current_stream(device)
        side = stream_of(self, "_side_streams", main.device)
        side.wait_stream(main)
        for t in inputs:
            if t is not None:
                t.record_stream(side)
        return main, side

    @staticmethod
    def _joined(main, side, *outputs, then=None) -> Pending:
        """A ``Pending`` whose ``wait()`` orders ``main`` after ``side`` and hands it the
        side stream's ``outputs`` (``then(*outputs)`` when given)."""
        def finish():
            main.wait_stream(side)
            for t in outputs:
                if t is not None:
                    t.record_stream(main)
            return then(*outputs) if then is not None else outputs
        return Pending(finish)

    def combine_bwd_weighted_rows(self, handle, d_out, rows, row_weights, *, fused: bool):
        """A combine's backward followed by the backward of the expert-side weighting that
        preceded it (``rows * row_weights`` was combined): ``(d_rows, d_row_weights)``.
        ``fused`` picks the Triton weighting kernel; exchanges may fuse more."""
        d_rows = self.combine_bwd(handle, d_out)
        if fused:
            return kernels.row_weight_bwd(RowWeightRes(rows, row_weights), d_rows)
        # What autograd computes for the eager weighting ``rows * w.to(rows.dtype)[:, None]``
        # (MoELayer._weight_rows), in the rows' dtype: the same gradients as without the
        # skip, and no float32 passes over (N, H) tensors.
        w = row_weights.to(rows.dtype)[:, None]
        return d_rows * w, (d_rows * rows).sum(-1).to(row_weights.dtype)

    def reset_counters(self) -> None:
        for k in COUNTER_KEYS:
            self.counters[k] = 0


# torch 2.13 renamed all_gather_into_tensor (and deprecates the old name); 2.11 lacks it.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class SendRows(NamedTuple):
    """Rows to send, not yet written: ``write(out)`` fills ``out (num_rows, width)``, so that
    a transport can have them written where it sends from (``materialize()`` otherwise)."""

    num_rows: int
    width: int
    dtype: torch.dtype
    device: torch.device
    write: Callable[[torch.Tensor], Any]

    def empty(self) -> torch.Tensor:
        """An unwritten tensor of the rows' shape."""
        return torch.empty((self.num_rows, self.width), dtype=self.dtype, device=self.device)

    def materialize(self) -> torch.Tensor:
        out = self.empty()
        self.write(out)
        return out


class AllToAllTransport:
    """``torch.distributed.all_to_all_single`` with split sizes (NCCL on GPUs, gloo on
    CPUs): the transport of the all_to_all exchange; it and ``symm_mem`` also gather every
    rank's counts here."""

    backend = "all_to_all"

    @staticmethod
    def _group_size_and_rank(group) -> tuple[int, int]:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("comm_backend='all_to_all' needs torch.distributed initialised "
                               "(dist.init_process_group) before the layer is built")
        return dist.get_world_size(group), dist.get_rank(group)

    def _gather_counts(self, plan) -> torch.Tensor:
        """``(ep, E)``: every rank's per-expert row counts (``plan.counts``), one collective
        without a host sync."""
        c = plan.counts.new_empty(self.ep_size * plan.counts.numel())
        _all_gather(c, plan.counts.contiguous(), group=self.group)
        return c.view(self.ep_size, -1)

    def _exchange(self, rows, send_splits, recv_splits, *, async_op=False, room=0):
        n = sum(recv_splits)
        if isinstance(rows, SendRows):
            send = rows.empty()
            buf = send.new_empty((n + room, rows.width))
            rows.write(send)
            rows = send
        else:
            if room:
                raise ValueError("room behind the received rows needs SendRows")
            rows = rows.contiguous()
            buf = rows.new_empty((n, *rows.shape[1:]))
        work = dist.all_to_all_single(buf[:n], rows, list(recv_splits), list(send_splits),
                                      group=self.group, async_op=async_op)
        return buf, work


# Rows and per-row values (routing weights, their gradients) in one collective: each packed
# row is [row | the values' bytes | padding], the tail a multiple of 16 bytes, and the values
# arrive bit for bit, whatever the two dtypes (unpacking copies them out, so an odd row
# width never leaves them misaligned).
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


def expand_received(local_idx: torch.Tensor, num_local_experts: int, num_rows: int):
    """Received tokens' (T_recv, k) local expert ids (-1 where an expert lives elsewhere)
    to expert rows: ``(token_of_row, slot_of_row, row_of_slot)``, rows grouped by local
    expert and, within one, in (token, slot) order; ``row_of_slot`` is -1 off this rank.
    ``num_rows`` (host int) is the number of ids >= 0.

    A stable sort of the ids with "elsewhere" last: the dispatch layout (Triton on CUDA)."""
    k = local_idx.shape[1]
    key = torch.where(local_idx < 0, num_local_experts, local_idx)
    # The layout writes each sorted entry's token (perm // k) as it goes.
    _, _, perm, inv_perm, tokens = kernels.layout_with_tokens(key, num_local_experts + 1)
    row_of_slot = torch.where(inv_perm < num_rows, inv_perm, -1).reshape(local_idx.shape)
    return tokens[:num_rows], perm[:num_rows] % k, row_of_slot


def stream_of(owner, attr: str, device: torch.device) -> torch.cuda.Stream:
    """``owner``'s own stream on ``device``, made at its first use there (a layer moved to
    another GPU gets one on that GPU; a stream of the old one would not order its work)."""
    streams = owner.__dict__.setdefault(attr, {})
    stream = streams.get(device.index)
    if stream is None:
        stream = streams[device.index] = torch.cuda.Stream(device)
    return stream


@contextlib.contextmanager
def sm_carveout(num_sms: int | None):
    """Withhold ``num_sms`` SMs from cuBLAS GEMMs inside the block (for overlapped comms).

    Always restores the previous value, exceptions included. ``None`` or 0 does nothing.
    """
    if not num_sms:
        yield
        return
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    getter = getattr(torch._C, "_get_sm_carveout_experimental", None)
    if setter is None or getter is None:
        raise RuntimeError("this torch build has no SM carveout API "
                           "(torch._C._set_sm_carveout_experimental); upgrade torch")
    previous = getter()
    setter(int(num_sms))
    try:
        yield
    finally:
        setter(previous)


def check_cached_tokens(x, handle) -> None:
    """A cached dispatch moves the tokens its handle was made for: the same count."""
    if x.shape[0] != handle.plan.num_tokens:
        raise ValueError(f"a cached dispatch must move the {handle.plan.num_tokens} tokens its "
                         f"handle was made for, got {x.shape[0]}: make a fresh layout "
                         "(exchange.layout) for other tokens")
