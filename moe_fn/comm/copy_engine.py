"""The row ``all_to_all`` with its transfers on the GPU's copy engines
(``all_to_all_transport="copy_engine"``).

The moves are the collective row all_to_all's (``moe_fn.comm.sorted_rows``): the same
send gathers, placements and sums, and the same results bit for bit. Only the transfer
differs. Each rank's send gather writes its rows into its region of symmetric memory
(``moe_fn.comm.peer_memory``; one device barrier publishes them), and every receiver
pulls its rows out of each peer's region with one ``copy_`` per peer, which CUDA runs on
a copy engine (DMA over NVLink) rather than on SMs. So the transfer needs no SMs withheld
from the GEMMs beside it: the overlapped backward hid 72-73% of its combine at
``comm_num_sm=4``, where the collective hides 55-58% at best; alone, the moves take about
as long as the collective's (``bench/RESULTS.md``, issue 5). A receiver finds its rows in
a peer's region from every rank's rank-to-rank row counts, which the layout reads in its
one host sync (``RowPulls``). On CPUs (gloo) the gathering stand-in of peer memory runs
the same offsets, so CPU tests check them.
"""

from __future__ import annotations

import math

import torch

from .base import Pending, SendRows
from .peer_memory import peer_memory
from .sorted_rows import AllToAllExchange


class CopyEngineRowsExchange(AllToAllExchange):
    """One row per (token, expert), moved by copy-engine pulls from peer memory (see the
    module)."""

    pulls = True

    def _exchange(self, rows, send_splits, recv_splits, *, async_op=False, out=None,
                  pulls=None):
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
            rows = rows.contiguous()
            width = math.prod(rows.shape[1:])
            view = peers.expose(rows.reshape(rows.shape[0], width), None, pulls.max_rows, 0)
        if out is None:
            out = torch.empty((sum(recv_splits), width), dtype=rows.dtype, device=rows.device)
        got = out.view(out.shape[0], width)

        def pull():
            at = 0
            for s, n in enumerate(recv_splits):
                if n:
                    start = pulls.offsets[s]
                    got[at:at + n].copy_(view.rows[s][start:start + n])
                at += n
        if not (async_op and out.is_cuda):
            pull()
            return out, None
        # On a stream of its own, so that what the caller queues next (the own rows'
        # placement) runs beside the pulls.
        main = torch.cuda.current_stream(out.device)
        if getattr(self, "_pull_stream", None) is None:
            self._pull_stream = torch.cuda.Stream(out.device)
        side = self._pull_stream
        side.wait_stream(main)
        with torch.cuda.stream(side):
            pull()
        out.record_stream(side)
        # As NCCL's work.wait(): the stream current at the wait waits for the pulls.
        return out, Pending(lambda: torch.cuda.current_stream(out.device).wait_stream(side))
