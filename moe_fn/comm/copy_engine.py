"""The row ``all_to_all`` with its transfers on the GPU's copy engines
(``all_to_all_transport="copy_engine"``).

The moves are the collective row all_to_all's (``moe_fn.comm.sorted_rows``): the same
send gathers, placements and sums, and the same results bit for bit. Only the transfer
differs. Each rank's send gather writes its rows into its region of symmetric memory
(``moe_fn.comm.peer_memory``; one device barrier publishes them), and every receiver
pulls its rows out of each peer's region with ``copy_``, which CUDA runs on a copy engine
(DMA over NVLink) rather than on SMs: the moves towards the experts in parts with an event
each, so that one part is placed while the next is in flight, the moves home whole. The
transfer needs no SMs withheld from the GEMMs beside it: the overlapped backward hid
70-75% of its combine at ``comm_num_sm=4``, where the collective hides 52-59% at best;
alone, with work queued ahead, its moves reach 87-97% of a raw ``all_to_all_single``'s
throughput over the same rows, the collective's 70-78% (``bench/RESULTS.md``, issues 3
and 5). A receiver finds
its rows in a peer's region from every rank's rank-to-rank row counts, which the layout
reads in its one host sync (``RowPulls``). On CPUs (gloo) the gathering stand-in of peer
memory runs the same offsets and parts, so CPU tests check them.
"""

from __future__ import annotations

import math

import torch

from .base import Pending, SendRows, stream_of
from .peer_memory import peer_memory
from .sorted_rows import AllToAllExchange


class _Landing(Pending):
    """Pulls queued on ``side`` in parts ``[(lo, hi, event)]`` (events None where the pulls
    ran at once): ``wait()`` joins all of them to the stream current at the wait, as NCCL's
    work.wait() does; ``CopyEngineRowsExchange._landed`` joins them part by part."""

    def __init__(self, parts, side=None):
        super().__init__(lambda: None if side is None else
                         torch.cuda.current_stream(side.device).wait_stream(side))
        self.parts = parts


class CopyEngineRowsExchange(AllToAllExchange):
    """One row per (token, expert), moved by copy-engine pulls from peer memory (see the
    module).

    The moves towards the experts, which place their received rows where they belong, have
    them pulled in up to ``pull_parts`` parts of about ``min_part_bytes`` or more (parts of
    ``ceil(rows / parts)`` rows), each with its own event, so that one part is placed while
    the next is in flight (``_landed``); the moves home, which sum them once all have
    arrived, pull them whole."""

    pulls = True
    pull_parts = 2
    min_part_bytes = 16 << 20

    def _parts(self, n: int, row_bytes: int) -> list:
        parts = max(1, min(self.pull_parts, n * row_bytes // max(self.min_part_bytes, 1)))
        step = -(-n // parts) if n else 0
        return [(lo, min(n, lo + step)) for lo in range(0, n, step)] if n else []

    def _exchange(self, rows, send_splits, recv_splits, *, async_op=False, room=0,
                  pulls=None, in_parts=False):
        if pulls is None:
            raise RuntimeError("the copy-engine transport moves rows with a layout's "
                               "RowPulls: this handle has none (made by another exchange?)")
        peers = peer_memory(self.group, rows.device)
        if isinstance(rows, SendRows):  # gathered straight into this rank's region
            width = rows.width
            view = peers.expose_written(lambda region: rows.write(region[:rows.num_rows]),
                                        width, rows.dtype, pulls.max_rows, None, 0,
                                        device=rows.device)
        else:
            if room:
                raise ValueError("room behind the received rows needs SendRows")
            rows = rows.contiguous()
            width = math.prod(rows.shape[1:])
            view = peers.expose(rows.reshape(rows.shape[0], width), None, pulls.max_rows, 0)
        n = sum(recv_splits)
        out = torch.empty((n + room, width), dtype=rows.dtype, device=rows.device)
        ranges = (self._parts(n, width * rows.dtype.itemsize) if in_parts
                  else [(0, n)] if n else [])

        def pull(lo, hi):
            # The part [lo, hi) of the rows received in rank order, from each peer it spans.
            at = 0
            for s, m in enumerate(recv_splits):
                a, b = max(lo, at), min(hi, at + m)
                if a < b:
                    start = pulls.offsets[s] - at
                    out[a:b].copy_(view.rows[s][start + a:start + b])
                at += m
        if not (async_op and out.is_cuda):
            for lo, hi in ranges:
                pull(lo, hi)
            return out, _Landing([(lo, hi, None) for lo, hi in ranges])
        # On a stream of its own, so that what the caller queues next (the own rows'
        # placement, the landed parts' placements) runs beside the pulls.
        main = torch.cuda.current_stream(out.device)
        side = stream_of(self, "_pull_streams", main.device)
        side.wait_stream(main)
        parts = []
        # set_stream rather than the stream context: fewer host microseconds before the
        # transfer starts. It also makes the stream's device current: restored after.
        device = torch.cuda.current_device()
        torch.cuda.set_stream(side)
        try:
            for lo, hi in ranges:
                pull(lo, hi)
                parts.append((lo, hi, side.record_event()))
        finally:
            torch.cuda.set_stream(main)
            if device != main.device_index:
                torch.cuda.set_device(device)
        out.record_stream(side)
        return out, _Landing(parts, side)

    def _landed(self, buf, work: _Landing):
        # ``work`` is this transport's: every move returns a _Landing.
        stream = torch.cuda.current_stream(buf.device) if buf.is_cuda else None
        try:
            for lo, hi, event in work.parts:
                if event is not None:
                    stream.wait_event(event)
                yield lo, hi
        finally:  # every pull joined, even if a placement raised (the next move's half)
            work.wait()
