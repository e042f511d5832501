"""The row ``all_to_all`` with its transfers on the GPU's copy engines
(``all_to_all_transport="copy_engine"``).

The moves are the collective row all_to_all's (``moe_fn.comm.sorted_rows``): the same
send gathers, placements and sums, and the same results bit for bit. Only the transfer
differs. Each rank's send gather writes its rows into its region of symmetric memory
(``moe_fn.comm.peer_memory``), in parts with a device barrier after each, and every
receiver pulls its rows out of each peer's region with ``copy_``, which CUDA runs on a
copy engine (DMA over NVLink) rather than on SMs, a part as soon as its barrier has
passed: so one part's gather overlaps the previous part's transfer, and (towards the
experts) one part's placement the next part's. The transfer needs no SMs withheld from
the GEMMs beside it: the overlapped backward hid 72-73% of its combine at
``comm_num_sm=4``, where the collective hides 55-58% at best (``bench/RESULTS.md``,
issue 5). A receiver finds its rows in a peer's region from every rank's rank-to-rank
row counts, which the layout reads in its one host sync (``RowPulls``). On CPUs (gloo)
the gathering stand-in of peer memory runs the same offsets and parts, so CPU tests
check them.
"""

from __future__ import annotations

import math

import torch

from .base import Pending, SendRows
from .peer_memory import peer_memory
from .sorted_rows import AllToAllExchange


def part_bounds(n: int, parts: int) -> list:
    """``[lo, hi)`` of ``parts`` near-equal parts of ``n`` rows (none when ``n`` is 0)."""
    if n == 0:
        return []
    step = -(-n // parts)
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def pull_schedule(recv_splits, offsets, sender_parts, ranges) -> list:
    """The pulls of one move, in the order to issue them: ``(round, lo, hi, peer, start,
    range)``, where rows ``[lo, hi)`` of the receive buffer (rank order) are rows
    ``[start, start + hi - lo)`` of the peer's region, all inside the peer's part
    ``sender_parts[peer][round]`` (published at that round's barrier), and inside
    ``ranges[range]`` (the receiver's landing parts)."""
    pieces = []
    at = 0
    for s, m in enumerate(recv_splits):
        if m:
            shift = offsets[s] - at  # receive-buffer row + shift = row of s's region
            for r, (rlo, rhi) in enumerate(ranges):
                a, b = max(rlo, at), min(rhi, at + m)
                for q, (plo, phi) in enumerate(sender_parts[s]):
                    lo, hi = max(a, plo - shift), min(b, phi - shift)
                    if lo < hi:
                        pieces.append((q, lo, hi, s, lo + shift, r))
        at += m
    pieces.sort(key=lambda p: (p[0], p[1]))
    return pieces


class _Landing(Pending):
    """Pulls queued on ``side`` in parts ``[(lo, hi, event)]`` (events None where the pulls
    ran at once): ``wait()`` joins all of them to the stream current at the wait, as NCCL's
    work.wait() does; ``SortedRowsExchange._landed`` joins them part by part."""

    def __init__(self, parts, side=None):
        super().__init__(lambda: None if side is None else
                         torch.cuda.current_stream(side.device).wait_stream(side))
        self.parts = parts


class CopyEngineRowsExchange(AllToAllExchange):
    """One row per (token, expert), moved by copy-engine pulls from peer memory (see the
    module).

    A move is cut into up to ``pull_parts`` parts of at least ``min_part_bytes`` on both
    sides. Each rank writes its rows into its region part by part, with a barrier after
    each (a round), and receivers pull a peer's part once its round is published, so the
    send gather of one part overlaps the transfer of the one before. The received rows land
    in parts of their own, each with an event, so that the moves towards the experts place
    one part while the next is in flight (``_landed``)."""

    pulls = True
    pull_parts = 2
    min_part_bytes = 16 << 20

    def _parts(self, n: int, row_bytes: int) -> list:
        parts = max(1, min(self.pull_parts, n * row_bytes // max(self.min_part_bytes, 1)))
        return part_bounds(n, parts)

    def _schedule(self, recv_splits, pulls, row_bytes):
        """``(the receiver's landing ranges, every rank's send parts, pull_schedule)`` of a
        move, kept per (layout, row width): a route's moves reuse them."""
        cache = self.__dict__.setdefault("_schedules", {})
        key = (pulls, row_bytes)  # RowPulls compares by identity
        got = cache.get(key)
        if got is None:
            if len(cache) >= 64:
                cache.clear()
            ranges = self._parts(sum(recv_splits), row_bytes)
            sender_parts = [self._parts(t, row_bytes) for t in pulls.totals]
            got = cache[key] = (ranges, sender_parts,
                                pull_schedule(recv_splits, pulls.offsets, sender_parts,
                                              ranges))
        return got

    def _exchange(self, rows, send_splits, recv_splits, *, async_op=False, out=None,
                  pulls=None):
        if pulls is None:
            raise RuntimeError("the copy-engine transport moves rows with a layout's "
                               "RowPulls: this handle has none (made by another exchange?)")
        me = self.rank
        if isinstance(rows, SendRows):  # gathered straight into this rank's region
            num_rows, width, dtype, device, write = rows
        else:
            send = rows.contiguous()
            num_rows, dtype, device = send.shape[0], send.dtype, send.device
            width = math.prod(send.shape[1:])
            send = send.reshape(num_rows, width)

            def write(region, lo, hi):
                region[lo:hi].copy_(send[lo:hi])
        if num_rows != pulls.totals[me]:
            raise RuntimeError(f"the copy-engine transport was given {num_rows} rows to send "
                               f"where the layout's RowPulls say {pulls.totals[me]}")
        ranges, sender_parts, schedule = self._schedule(recv_splits, pulls,
                                                        width * dtype.itemsize)
        region, publish = peer_memory(self.group, device).open_region(
            width, dtype, pulls.max_rows, device=device)
        mine = sender_parts[me]
        rounds = max(1, *(len(p) for p in sender_parts))  # the same on every rank
        if out is None:
            out = torch.empty((sum(recv_splits), width), dtype=dtype, device=device)
        got = out.view(out.shape[0], width)

        def pull(lo, hi, s, start):
            got[lo:hi].copy_(peer_rows[s][start:start + hi - lo])
        if not (async_op and out.is_cuda):
            for lo, hi in mine:
                write(region, lo, hi)
            peer_rows = publish()
            for _ in range(rounds - 1):  # as many barriers as every other rank
                publish()
            for _, lo, hi, s, start, _ in schedule:
                pull(lo, hi, s, start)
            return out, _Landing([(lo, hi, None) for lo, hi in ranges])
        # Pulls on a stream of their own, so that the next round's writes and what the
        # caller queues next (the own rows' placement, the landed parts' placements) run
        # beside them. set_stream rather than the stream context: fewer host microseconds
        # before the transfer starts.
        main = torch.cuda.current_stream(device)
        if getattr(self, "_pull_stream", None) is None:
            self._pull_stream = torch.cuda.Stream(device)
        side = self._pull_stream
        last = {r: i for i, (*_, r) in enumerate(schedule)}  # each range's last pull
        landed = [None] * len(ranges)
        i = 0
        for q in range(rounds):
            if q < len(mine):
                write(region, *mine[q])
            peer_rows = publish()
            side.wait_event(main.record_event())
            torch.cuda.set_stream(side)
            try:
                while i < len(schedule) and schedule[i][0] == q:
                    _, lo, hi, s, start, r = schedule[i]
                    pull(lo, hi, s, start)
                    if last[r] == i:
                        landed[r] = side.record_event()
                    i += 1
            finally:
                torch.cuda.set_stream(main)
        out.record_stream(side)
        return out, _Landing([(lo, hi, ev) for (lo, hi), ev in zip(ranges, landed)], side)

    def _landed(self, buf, work):
        parts = getattr(work, "parts", None)
        if parts is None:
            return super()._landed(buf, work)
        return self._land_parts(buf, work, parts)

    @staticmethod
    def _land_parts(buf, work, parts):
        stream = torch.cuda.current_stream(buf.device) if buf.is_cuda else None
        for lo, hi, event in parts:
            if event is not None:
                stream.wait_event(event)
            yield lo, hi
        work.wait()
