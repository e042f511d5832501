"""The row ``all_to_all`` with its transfers on the GPU's copy engines
(``all_to_all_transport="copy_engine"``).

The moves are the collective row all_to_all's (``moe_fn.comm.sorted_rows``): the same
send gathers, placements and sums. Only the transfer differs. Each rank exposes its send
rows in symmetric memory (``moe_fn.comm.peer_memory``: a copy and one device barrier), and
every receiver pulls its rows out of each peer's buffer with one ``copy_`` per peer,
which CUDA runs on a copy engine (DMA over NVLink) rather than on SMs. Beside a GEMM that
keeps every SM such a pull was 70-90% hidden where NCCL's kernels were 39-44%, and alone
it moved the rows ~25% faster (``bench/RESULTS.md``, issue 5). A receiver finds its rows
in a peer's buffer from every rank's rank-to-rank row counts, which the layout reads in
its one host sync (``RowPulls``). On CPUs (gloo) the gathering stand-in of peer memory
runs the same offsets, so CPU tests check them.
"""

from __future__ import annotations

import torch

from .base import Pending
from .peer_memory import peer_memory
from .sorted_rows import AllToAllExchange


class CopyEngineRowsExchange(AllToAllExchange):
    """One row per (token, expert), moved by copy-engine pulls from peer memory (see the
    module)."""

    pulls = True

    def _exchange(self, rows, send_splits, recv_splits, *, async_op=False, out=None,
                  pulls=None):
        if pulls is None:
            raise AssertionError("the copy-engine transport moves rows with a layout's "
                                 "RowPulls")
        rows = rows.contiguous()
        if out is None:
            out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
        width = 1  # rows (n, ...) as (n, width)
        for d in rows.shape[1:]:
            width *= d
        sent = rows.reshape(rows.shape[0], width)
        view = peer_memory(self.group, rows.device).expose(sent, None, pulls.max_rows, 0)
        got = out.view(out.shape[0], width)

        def pull():
            at = 0
            for s, n in enumerate(recv_splits):
                if n:
                    start = pulls.offsets[s]
                    got[at:at + n].copy_(view.rows[s][start:start + n])
                at += n
        if not (async_op and rows.is_cuda):
            pull()
            return out, None
        # On a stream of its own, so that what the caller queues next (the own rows'
        # placement) runs beside the pulls.
        main = torch.cuda.current_stream(rows.device)
        if getattr(self, "_pull_stream", None) is None:
            self._pull_stream = torch.cuda.Stream(rows.device)
        side = self._pull_stream
        side.wait_stream(main)
        with torch.cuda.stream(side):
            pull()
        out.record_stream(side)
        return out, Pending(lambda: main.wait_stream(side))
