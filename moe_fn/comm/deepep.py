"""The ``deepep`` exchange over DeepEP's v1 ``deep_ep.Buffer`` (intranode NVLink).

DeepEP sends each token once to every rank that owns one of its experts; the receiver
expands tokens into (token, k) rows grouped by local expert (``handle.token_of_row``). The
combine sums each received token's rows on the expert side (``handle.row_of_slot``) and
DeepEP sends one partial per (token, rank) home, where it adds them
(``Summation.EXPERTS``): routing weights can enter that per-token sum, and the combine's
backward (a cached dispatch of the output gradient) can be gathered into the weighting's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import kernels
from ..records import DeepEPHandle, RoutePlan
from .base import (
    Exchange,
    Gathered,
    Pending,
    Summation,
    check_cached_tokens,
    check_combine_weights,
    refuse_encode,
)
from .collectives import gather_stamps

_HOW_TO_GET = (
    "comm_backend='deepep' needs DeepEP's v1 Buffer API (import deep_ep). The PyPI package "
    "'deep-ep' is an incomplete snapshot and cannot be built: build DeepEP from its source "
    "(github.com/deepseek-ai/DeepEP, tag v1.2.1; without NVSHMEM it builds intranode-only) "
    "with `pip install --no-build-isolation .` in its checkout, or use comm_backend='all_to_all'"
)


def import_deep_ep():
    try:
        import deep_ep
    except ImportError as e:
        raise ImportError(_HOW_TO_GET) from e
    if not hasattr(deep_ep, "Buffer"):
        raise ImportError(_HOW_TO_GET)
    return deep_ep


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


def _device() -> torch.device:
    # DeepEP's Buffer lives on the CUDA device current when it is made.
    return (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))


class DeepEPExchange(Exchange):
    backend = "deepep"
    summation = Summation.EXPERTS

    def __init__(self, *, num_experts: int, resources, group=None, hidden_size: int,
                 num_sms: int = 20):
        import_deep_ep()  # before anything else: the error says how to get it
        group = group if group is not None else dist.group.WORLD
        ep = dist.get_world_size(group)
        super().__init__(num_experts=num_experts, ep_size=ep, rank=dist.get_rank(group),
                         group=group, resources=resources)
        self.hidden_size, self.num_sms = hidden_size, num_sms
        self._bind()

    def _bind(self) -> None:
        """DeepEP's module, configs and buffer: made at construction and again when the
        exchange is copied or loaded (none of them pickles; the buffer is the group's)."""
        self._deep_ep = import_deep_ep()
        ep = self.ep_size
        self._deep_ep.Buffer.set_num_sms(self.num_sms)
        # Cached dispatch and combine must run with the SM count of the original dispatch.
        self.dispatch_config = self._deep_ep.Buffer.get_dispatch_config(ep)
        self.combine_config = self._deep_ep.Buffer.get_combine_config(ep)
        self.num_nvl_bytes = max(c.get_nvl_buffer_size_hint(self.hidden_size * 2, ep)
                                 for c in (self.dispatch_config, self.combine_config))
        # Made (or grown: a collective) now, while every rank builds (or loads) its layers,
        # not at a first move that other layers' handles might outlive.
        self._buffer_on(_device())

    def __getstate__(self):
        state = super().__getstate__()
        for key in ("_deep_ep", "dispatch_config", "combine_config"):
            del state[key]
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._bind()

    def _buffer_on(self, device):
        return self.resources_on(device).deepep_buffer(self._deep_ep, self.num_nvl_bytes)

    @property
    def buffer(self):
        """The group's DeepEP ``Buffer`` (looked up at every move: after a release the next
        move makes a new one)."""
        return self._buffer_on(_device())

    @staticmethod
    def _check_rows(name, x):
        if x.dtype != torch.bfloat16 or not x.is_cuda:
            raise TypeError(f"DeepEP carries bf16 CUDA rows; {name} is {x.dtype} on {x.device}: "
                            "run the layer in bfloat16 (under torch.autocast: dtype="
                            "torch.bfloat16) or use comm_backend='all_to_all'")

    @staticmethod
    def _per_slot(row_values, table):
        """``(R, k)``: each received token's slot value from ``row_values (N,)`` through
        ``table = handle.row_of_slot``, zero where the slot's expert lives elsewhere."""
        if row_values.numel() == 0:  # no rows here: every slot is elsewhere
            return row_values.new_zeros(table.shape)
        return torch.where(table >= 0, row_values.reshape(-1)[table.clamp(min=0)], 0)

    def layout(self, plan: RoutePlan, *, stamp=None, agree=None):
        self.counters["layout"] += 1
        if stamp is not None:
            # DeepEP's layout is local and its dispatch's notify is internal: the stamps
            # need a small collective of their own, before anything DeepEP runs.
            stamps = gather_stamps(stamp, self.ep_size, self.group)
            if agree is not None:
                agree(stamps.tolist())
        per_rank, _, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(
            plan.topk_idx, self.num_experts)
        return plan, per_rank, per_expert, in_rank

    def _expand(self, recv_idx, recv_counts):
        """Received (token, slot) pairs to rows grouped by local expert (DeepEP marks slots
        whose expert lives elsewhere with -1)."""
        n = sum(recv_counts)
        offs = torch.tensor(recv_counts, dtype=torch.int64).cumsum(0).to(torch.int32)
        token, slot, row_of_slot = expand_received(recv_idx.to(torch.int64),
                                                   self.num_local_experts, n)
        return token, slot, offs.to(recv_idx.device), n, row_of_slot

    def dispatch(self, x, weights, layout, *, cached: bool = False,
                 encode=None):
        refuse_encode(self, encode)
        self._check_rows("x", x)
        x = x.contiguous()
        if cached:
            handle: DeepEPHandle = layout
            check_cached_tokens(x, handle)
            self.counters["cached_dispatch"] += 1
            recv_x, *_ = self.buffer.dispatch(x, handle=handle.deepep_handle,
                                              config=self.dispatch_config)
            row_w = None
            if weights is not None:
                # A cached dispatch carries no weights; the route (and so the received
                # weights' values) is the original dispatch's.
                row_w = handle.recv_weights[handle.token_of_row, handle.slot_of_row]
        else:
            plan, per_rank, per_expert, in_rank = layout
            self.counters["dispatch"] += 1
            # DeepEP's expansion needs weights: ones stand in when none are sent.
            sent = (torch.ones(plan.topk_idx.shape, device=x.device) if weights is None
                    else weights.detach().to(torch.float32))
            recv_x, recv_idx, recv_w, recv_counts, dh, _ = self.buffer.dispatch(
                x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=plan.topk_idx,
                topk_weights=sent.contiguous(), config=self.dispatch_config)
            token, slot, offs, n, row_of_slot = self._expand(recv_idx, recv_counts)
            handle = DeepEPHandle(plan=plan, deepep_handle=dh, token_of_row=token,
                                  slot_of_row=slot, num_recv_tokens=recv_x.shape[0],
                                  local_offs=offs, num_rows=n, recv_weights=recv_w,
                                  row_of_slot=row_of_slot)
            row_w = recv_w[token, slot] if weights is not None else None
        if recv_x.shape[0] != handle.num_recv_tokens:
            raise RuntimeError(f"DeepEP returned {recv_x.shape[0]} rows but the handle expects "
                               f"{handle.num_recv_tokens}: a DeepEP build whose dispatch output "
                               "differs from v1.2.1's (see the README on building DeepEP)")
        return recv_x.index_select(0, handle.token_of_row), row_w, handle

    def dispatch_backward(self, handle: DeepEPHandle, d_rows, d_row_weights, *,
                          async_op: bool = False) -> Pending:
        """Row gradients summed per received token, sent home by DeepEP's combine, which
        reduces the routing-weight gradients the same way. With ``async_op`` DeepEP's own
        ``async_finish`` on its communication stream, as its maintainers advise (DeepEP
        issue #131): wrapping its calls in a stream of ours serialised them with the GEMMs
        in our measurements."""
        self.counters["dispatch_backward"] += 1
        d_recv = kernels.masked_gather_sum(d_rows, handle.row_of_slot)  # per received token
        d_recv_w = None
        if d_row_weights is not None:
            d_recv_w = self._per_slot(d_row_weights.float(), handle.row_of_slot)
        dx, d_w, event = self.buffer.combine(d_recv, handle.deepep_handle, topk_weights=d_recv_w,
                                             config=self.combine_config, async_finish=async_op)

        def finish():
            if async_op:
                event.current_stream_wait()
            return dx, d_w

        pending = Pending(finish)
        if not async_op:
            pending.wait()
        return pending

    # ---- combine: the expert side's per-token sums, DeepEP's combine home ----------------
    def combine(self, rows, handle: DeepEPHandle, *, weights=None, keep: bool = True):
        """Each received token's rows summed here (with ``weights``, one per expert row,
        applied inside that sum: no weighted rows are written), DeepEP's combine adding the
        partials at home. Nothing is saved for the backward."""
        self.counters["combine"] += 1
        check_combine_weights(self, weights, rows, handle)
        partials = kernels.masked_gather_sum(rows, handle.row_of_slot, weights)
        self._check_rows("rows", partials)
        out, _, _ = self.buffer.combine(partials, handle.deepep_handle,
                                        config=self.combine_config)
        return out, None

    def _tokens_to_experts(self, d_out, handle: DeepEPHandle):
        # d_out has the layer output's dtype (autograd casts every gradient, a root one too,
        # to its tensor's): the bf16 the forward's dispatch checked.
        self.counters["combine_backward"] += 1
        d_recv, *_ = self.buffer.dispatch(d_out.contiguous(), handle=handle.deepep_handle,
                                          config=self.dispatch_config)
        return d_recv

    # d_rows[i] = d_out[home token of row i]: a cached dispatch of the output gradient.
    def combine_backward(self, handle: DeepEPHandle, d_out, *, weights=None, saved=None):
        if weights is not None:
            raise ValueError("DeepEP sums on the expert side: the backward of its weighted "
                             "combine is combine_backward_gathered followed by the row "
                             "weighting's backward")
        received = self._tokens_to_experts(d_out, handle)
        return received.index_select(0, handle.token_of_row), None

    def combine_backward_gathered(self, handle: DeepEPHandle, d_out) -> Gathered:
        """The received output gradient per token, each expert row reading its token's:
        the expansion left to the consumer (one pass with the weighting's backward)."""
        return Gathered(self._tokens_to_experts(d_out, handle), handle.token_of_row)
