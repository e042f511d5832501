"""The ``deepep`` exchange over DeepEP's v1 ``deep_ep.Buffer`` (intranode NVLink).

DeepEP sends each token once to every rank that owns one of its experts; the receiver
expands tokens into (token, k) rows grouped by local expert. DeepEP's combine sums
without weights, so the routing weights are applied on the expert side before it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import kernels
from ..records import DeepEPHandle, RoutePlan
from .base import Pending, check_cached_tokens, expand_received
from .tokens import TokenRowsExchange

_HOW_TO_GET = (
    "comm_backend='deepep' needs DeepEP's v1 Buffer API (import deep_ep). The PyPI package "
    "'deep-ep' is an incomplete snapshot and cannot be built: build DeepEP from its source "
    "(github.com/deepseek-ai/DeepEP, tag v1.2.1; without NVSHMEM it builds intranode-only) "
    "with `pip install --no-build-isolation .` in its checkout, or use comm_backend='all_to_all'"
)

_buffers: dict = {}


def import_deep_ep():
    try:
        import deep_ep
    except ImportError as e:
        raise ImportError(_HOW_TO_GET) from e
    if not hasattr(deep_ep, "Buffer"):
        raise ImportError(_HOW_TO_GET)
    return deep_ep


def _buffer(deep_ep, group, hidden_bytes: int, configs):
    """One NVLink buffer per group, sized for the largest hidden size asked for so far."""
    ep = dist.get_world_size(group)
    need = max(c.get_nvl_buffer_size_hint(hidden_bytes, ep) for c in configs)
    # Keyed by the group object, held here: a group created after another was destroyed
    # (at the same address) gets its own buffer.
    key = id(group)
    entry = _buffers.get(key)
    buf = entry[1] if entry is not None and entry[0] is group else None
    if buf is None or buf.num_nvl_bytes < need:
        buf = deep_ep.Buffer(group, num_nvl_bytes=need, num_rdma_bytes=0)
        _buffers[key] = (group, buf)
    return buf


class DeepEPExchange(TokenRowsExchange):
    backend = "deepep"
    # The overlapped backward combine uses DeepEP's own async_finish on its communication
    # stream, as its maintainers advise (DeepEP issue #131): wrapping its calls in a stream
    # of ours serialised them with the GEMMs in our measurements.
    combine_on_side_stream = False

    def __init__(self, *, num_experts: int, group=None, hidden_size: int, num_sms: int = 20):
        deep_ep = import_deep_ep()
        group = group if group is not None else dist.group.WORLD
        ep = dist.get_world_size(group)
        super().__init__(num_experts=num_experts, ep_size=ep, rank=dist.get_rank(group),
                         group=group)
        deep_ep.Buffer.set_num_sms(num_sms)
        # Cached dispatch and combine must run with the SM count of the original dispatch.
        self.dispatch_config = deep_ep.Buffer.get_dispatch_config(ep)
        self.combine_config = deep_ep.Buffer.get_combine_config(ep)
        self.buffer = _buffer(deep_ep, group, hidden_size * 2,
                              (self.dispatch_config, self.combine_config))

    @staticmethod
    def _check_rows(name, x):
        if x.dtype != torch.bfloat16 or not x.is_cuda:
            raise TypeError(f"DeepEP carries bf16 CUDA rows; {name} is {x.dtype} on {x.device}: "
                            "run the layer in bfloat16 (under torch.autocast: dtype="
                            "torch.bfloat16) or use comm_backend='all_to_all'")

    def layout(self, plan: RoutePlan):
        self.counters["layout"] += 1
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

    def dispatch_fwd(self, x, weights, layout, *, cached: bool = False):
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

    def dispatch_bwd(self, handle: DeepEPHandle, d_rows, d_row_weights, *,
                     async_op: bool = False):
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
        return pending if async_op else pending.wait()

    # ---- the combine's transports (the combine itself: TokenRowsExchange) ----------------
    def _partials_home(self, partials, handle: DeepEPHandle):
        self._check_rows("rows", partials)
        out, _, _ = self.buffer.combine(partials, handle.deepep_handle,
                                        config=self.combine_config)
        return out

    def _tokens_to_experts(self, d_out, handle: DeepEPHandle):
        # d_out has the layer output's dtype (autograd casts every gradient, a root one too,
        # to its tensor's): the bf16 the forward's dispatch checked.
        d_recv, *_ = self.buffer.dispatch(d_out.contiguous(),
                                          handle=handle.deepep_handle,
                                          config=self.dispatch_config)
        return d_recv
