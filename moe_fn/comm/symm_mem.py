"""The ``symm_mem`` exchange: the experts get one row per (token, expert), as over the
all_to_all, but no row is sent: each rank publishes what it has in torch symmetric memory,
which every rank of the host reads over NVLink (``moe_fn.comm.peer_memory``), and the
reader pulls what it needs. CUDA ranks of one host; on CPUs (gloo) a gathering stand-in of
the memory runs the same index logic.

Over ``all_to_all_single`` a move costs three passes over the rows (the sender's gather
into destination order, the collective's copies, the receiver's gather into expert
order). Here the dispatch publishes the token rows as they are and each rank reads every
token it needs once, writing it to all of its expert-major rows; the combine sums each
token's rows on the rank that computed them (float32 partials, routing weights folded in,
written straight into the published buffer) and the token's home reads one partial per
such rank and adds them. The layout gathers every rank's per-expert counts (one small
collective and one host sync, as the collective row all_to_all's layout does) and sends
each rank the flattened (token, k) indices of the rows it computes, in one small
all_to_all of ints; its index math runs as three Triton launches on CUDA
(``moe_fn.kernels.peer_layout``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import kernels
from ..pure.activations import compute_dtype
from ..records import RoutePlan, SymmMemHandle
from .base import (
    Exchange,
    Pending,
    Summation,
    check_cached_tokens,
    check_combine_weights,
    joined,
    refuse_encode,
    side_stream_after,
)
from .collectives import gather_counts, group_and_size
from .peer_memory import pull_partials, pull_rows, write_slot_sums


class SymmMemExchange(Exchange):
    """Expert rows, one per (token, expert), moved by pulls from peer memory: tokens read
    once per rank on the way to the experts, per-token partial sums on the way home (see
    the module)."""

    backend = "symm_mem"
    # The expert side sums each token's rows before the token's home reads them; routing
    # weights enter those float32 sums (``combine(weights=row_weights)``), delivered with
    # the rows by the dispatch.
    summation = Summation.EXPERTS
    # Moves of token rows to the experts read each token once per rank, however many of
    # its rows this rank computes (False: once per row, the plain pull; benchmarks compare).
    read_tokens_once = True

    def __init__(self, *, num_experts: int, resources, group=None, num_sms: int | None = None):
        group, ep, rank = group_and_size(group, self.backend)
        super().__init__(num_experts=num_experts, ep_size=ep, rank=rank, group=group,
                         resources=resources)
        # Programs of the overlapped backward combine's pulls (``dispatch_backward``): the
        # SMs the weight-gradient GEMMs leave free. Every other pull uses the whole GPU.
        self.num_sms = num_sms

    def _mem(self, device):
        # Looked up every move (a dict lookup), not kept: after a release the next move
        # builds a new buffer and the old one can be freed.
        return self.resources_on(device).peer_memory()

    # ---- layout ------------------------------------------------------------------------
    def layout(self, plan: RoutePlan, *, stamp=None, agree=None) -> SymmMemHandle:
        self.counters["layout"] += 1
        ep, me, k = self.ep_size, self.rank, plan.top_k
        # (ep, E): rows each rank sends to each expert (and every rank's stamp).
        c = gather_counts(plan, ep, self.group, stamp)
        if stamp is not None:
            c, stamps = c
        home = kernels.peer_home_side(c, plan.offs, plan.counts, plan.topk_idx, plan.inv_perm,
                                      me, k)
        # One host sync: the index exchange's split sizes and the exposed sizes.
        sizes = home.sizes.tolist()
        if agree is not None:
            agree(stamps.tolist())
        recv_splits, send_splits = sizes[:ep], sizes[ep:2 * ep]
        max_tokens, max_rows = sizes[2 * ep:]
        n = sum(recv_splits)
        # Each received row's flattened (token, k) index at its source, in (source, expert)
        # order: the sources' sorted rows for this rank's experts, as an all_to_all of ints.
        recv_flat = plan.perm.new_empty(n)
        dist.all_to_all_single(recv_flat, plan.perm, recv_splits, send_splits,
                               group=self.group)
        rec = kernels.peer_receiver_side(c, recv_flat, me, k, max_tokens, home.tables)
        return SymmMemHandle(
            plan=plan, src_rank=rec.src_rank, src_flat=rec.src_flat,
            token_slots=rec.token_slots, home_rank=home.home_rank, home_pos=home.home_pos,
            local_offs=home.local_offs, num_rows=n, max_tokens=max_tokens, max_rows=max_rows)

    # ---- token rows -> expert rows -------------------------------------------------------
    def _to_experts(self, token_rows, values, h: SymmMemHandle):
        k = h.plan.top_k
        view = self._mem(token_rows.device).expose(token_rows, values, h.max_tokens,
                                                   h.max_tokens * k)
        return pull_rows(view, h.src_rank, h.src_flat, row_div=k,
                         token_slots=h.token_slots if self.read_tokens_once else None)

    # ---- expert rows -> home, summed over k ----------------------------------------------
    def _expose_partials(self, rows, values, h: SymmMemHandle, row_weights=None):
        """Each token's rows summed where they are computed (float32 partials for half
        types, one per (source, token), written straight into the exposed buffer), with
        ``values`` (one per expert row) exposed beside them."""
        acc = compute_dtype(rows.dtype)

        def write(region):
            write_slot_sums(region, rows, h.token_slots, h.plan.top_k, row_weights)
        return self._mem(rows.device).expose_written(
            write, rows.shape[1], acc, self.ep_size * h.max_tokens, values, h.max_rows,
            rows.device)

    @staticmethod
    def _pull_home(view, h: SymmMemHandle, out_dtype, num_programs=None):
        """Each token's partials pulled from the ranks holding its rows and added; with
        values, each (token, k) row's value."""
        return pull_partials(view, h.home_rank, h.home_pos, h.max_tokens, h.plan.top_k,
                             out_dtype, num_programs=num_programs)

    def _to_home(self, rows, values, h: SymmMemHandle, row_weights=None):
        return self._pull_home(self._expose_partials(rows, values, h, row_weights), h,
                               rows.dtype)

    def dispatch(self, x, weights, handle: SymmMemHandle, *, cached: bool = False,
                 encode=None):
        refuse_encode(self, encode)
        if cached:
            check_cached_tokens(x, handle)
        self.counters["cached_dispatch" if cached else "dispatch"] += 1
        rows, row_w = self._to_experts(x, None if weights is None else weights.reshape(-1),
                                       handle)
        return rows, row_w, handle

    def dispatch_backward(self, handle: SymmMemHandle, d_rows, d_row_weights, *,
                          async_op: bool = False) -> Pending:
        """Row gradients summed per token where they are, then pulled home. With
        ``async_op`` on CUDA (the overlapped backward) both run on a side stream beside what
        the caller queues next: the sums with the whole grid, the pulls over NVLink on
        ``num_sms`` programs; ``wait()`` joins them. (The sums on the
        few SMs the weight-gradient GEMMs leave free slowed those GEMMs by more than they
        hid, and the sums on the caller's stream ran before the GEMMs, unhidden:
        bench/RESULTS.md.) On the CPU the sums run at once and the pulls in ``wait()``.
        Wait for the result before the group's next move on the shared buffer (as
        ``Dispatch.backward`` does): until then the later moves' barriers, on the caller's
        stream, are not ordered after these pulls, and the move after next would overwrite
        the half they read."""
        self.counters["dispatch_backward"] += 1
        plan = handle.plan

        def shaped(dx, d_w):
            return dx, None if d_w is None else d_w.reshape(plan.num_tokens, plan.top_k)
        if async_op and d_rows.is_cuda:
            main, side = side_stream_after(self.resources_on(d_rows.device), d_rows,
                                           d_row_weights)
            with torch.cuda.stream(side):
                view = self._expose_partials(d_rows, d_row_weights, handle)
                dx, d_w = self._pull_home(view, handle, d_rows.dtype, self.num_sms)
            return joined(main, side, dx, d_w, then=shaped)
        view = self._expose_partials(d_rows, d_row_weights, handle)
        pending = Pending(lambda: shaped(*self._pull_home(view, handle, d_rows.dtype)))
        if not async_op:
            pending.wait()
        return pending

    def combine(self, rows, handle: SymmMemHandle, *, weights=None, keep: bool = True):
        """Each token's rows summed where they are, then pulled home; with ``weights``
        (one per expert row) the weights are applied inside the expert side's float32
        per-token sums: no weighted rows are written. Nothing is saved for the backward."""
        self.counters["combine"] += 1
        check_combine_weights(self, weights, rows, handle)
        return self._to_home(rows, None, handle, weights)[0], None

    def combine_backward(self, handle: SymmMemHandle, d_out, *, weights=None, saved=None):
        if weights is not None:
            raise ValueError("the symm_mem exchange sums on the expert side: the backward "
                             "of its weighted combine is combine_backward_gathered followed "
                             "by the row weighting's backward")
        self.counters["combine_backward"] += 1
        return self._to_experts(d_out, None, handle)[0], None
