"""A CPU stand-in for DeepEP's v1 ``deep_ep.Buffer`` (intranode normal mode) over gloo, so
that the CPU tests run ``comm_backend="deepep"``'s own logic: its layouts, the received
tokens' expansion into expert rows, cached dispatches, the combine's per-token sums, the
dispatch's backward (a combine with routing-weight gradients) and the combine's (a cached
dispatch).

It keeps the semantics moe_fn relies on, as ``../shared/reference/DEEPEP.md`` states them
for v1.2.1: each token goes once to every rank owning one of its experts; received rows are
grouped by source rank, in token order within one; ``recv_topk_idx`` holds local expert ids
and -1 for experts elsewhere (their weights 0); ``num_recv_tokens_per_expert_list`` is a
host list; a cached dispatch takes no ``topk_idx``/``topk_weights`` and returns
``(recv_x, None, None, None, None, event)``; ``combine`` sums without weights, reducing
``topk_weights`` the same way; cached dispatches and combines must use the original
dispatch's SM count. It moves rows with ``all_to_all_single`` and accepts any float dtype
(DeepEP itself carries bf16 only; the exchange checks that on CUDA), which lets the tests
compare in float64. ``install()`` makes ``import deep_ep`` find it in this process.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.distributed as dist

INTRANODE_RANKS = (2, 4, 8)


class Config:
    def __init__(self, num_sms=20, nvl_send=6, nvl_recv=256, rdma_send=6, rdma_recv=256):
        assert nvl_send < nvl_recv
        self.num_sms = num_sms

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return ((hidden_bytes * num_ranks * 1024) // 128 + 1) * 128


class EventOverlap:
    def current_stream_wait(self) -> None:
        pass


class _Handle:
    """What the real handle lets a cached dispatch and a combine reuse: which tokens went
    where, how many arrived from whom, the SM count."""

    def __init__(self, in_rank, send_counts, recv_counts, num_sms):
        self.in_rank, self.send_counts, self.recv_counts = in_rank, send_counts, recv_counts
        self.num_sms = num_sms


class Buffer:
    num_sms = 20

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 explicitly_destroy=False, **_):
        assert num_nvl_bytes % 128 == 0 and num_rdma_bytes == 0 and not low_latency_mode
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        assert self.group_size in INTRANODE_RANKS
        self.num_nvl_bytes = num_nvl_bytes
        self.explicitly_destroy = explicitly_destroy
        self.destroyed = False

    def destroy(self) -> None:
        """Collective in DeepEP (a barrier over the NVLink buffers); only for a buffer made
        with ``explicitly_destroy=True``, once."""
        assert self.explicitly_destroy, "destroy() needs explicitly_destroy=True"
        assert not self.destroyed, "destroyed twice"
        dist.barrier(group=self.group)
        self.destroyed = True

    def _live(self):
        assert not self.destroyed, "a destroyed Buffer was used"

    @staticmethod
    def set_num_sms(n: int) -> None:
        assert n % 2 == 0, "num_sms must be even"
        Buffer.num_sms = n

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        assert num_ranks in INTRANODE_RANKS
        return Config(Buffer.num_sms, {2: 24, 4: 6, 8: 6}[num_ranks], 256)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        assert num_ranks in INTRANODE_RANKS
        return Config(Buffer.num_sms, {2: 10, 4: 9, 8: 4}[num_ranks], 256)

    # ---- layout ----------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None,
                            async_finish=False, allocate_on_comm_stream=False):
        self._live()
        assert topk_idx.dtype == torch.int64 and topk_idx.dim() == 2
        assert num_experts % self.group_size == 0
        local = num_experts // self.group_size
        valid = topk_idx >= 0
        owner = torch.where(valid, topk_idx // local, -1)
        in_rank = torch.stack([(owner == r).any(1) for r in range(self.group_size)], 1)
        per_rank = in_rank.sum(0).to(torch.int32)
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        return per_rank, None, per_expert, in_rank, EventOverlap()

    # ---- moves -----------------------------------------------------------------------------
    def _send(self, rows, send_counts, recv_counts):
        out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts,
                               group=self.group)
        return out

    def _check_rows(self, x):
        self._live()
        assert x.is_contiguous() and x.is_floating_point(), "x must be contiguous floats"
        assert (x.shape[1] * x.element_size()) % 16 == 0, "rows must be 16-byte multiples"

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None,
                 previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        self._check_rows(x)
        assert config is not None and config.num_sms % 2 == 0
        if allocate_on_comm_stream:
            assert previous_event is not None and async_finish
        r_count = self.group_size
        if handle is not None:  # cached: the original layout, no routing
            assert topk_idx is None and topk_weights is None
            assert config.num_sms == handle.num_sms, "cached dispatch needs the original SMs"
            assert x.shape[0] == handle.in_rank.shape[0], "cached dispatch needs the same N"
            send = torch.cat([x[handle.in_rank[:, r]] for r in range(r_count)])
            recv_x = self._send(send, handle.send_counts, handle.recv_counts)
            return recv_x, None, None, None, None, EventOverlap()
        assert topk_weights is not None and topk_weights.dtype == torch.float32
        n, k = topk_idx.shape
        num_experts = num_tokens_per_expert.numel()
        local = num_experts // r_count
        in_rank = is_token_in_rank
        send_counts = [int(c) for c in in_rank.sum(0)]
        assert send_counts == [int(c) for c in num_tokens_per_rank]
        rows, idx, wts = [], [], []
        for r in range(r_count):
            tokens = in_rank[:, r]
            t_idx = topk_idx[tokens]
            here = (t_idx >= r * local) & (t_idx < (r + 1) * local)
            rows.append(x[tokens])
            idx.append(torch.where(here, t_idx - r * local, -1))
            wts.append(torch.where(here, topk_weights[tokens], 0.0))
        counts = torch.tensor(send_counts, dtype=torch.int64)
        recv_counts_t = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts_t, counts, group=self.group)
        recv_counts = [int(c) for c in recv_counts_t]
        recv_x = self._send(torch.cat(rows), send_counts, recv_counts)
        recv_idx = self._send(torch.cat(idx), send_counts, recv_counts)
        recv_w = self._send(torch.cat(wts), send_counts, recv_counts)
        per_expert = torch.bincount(recv_idx[recv_idx >= 0], minlength=local).tolist()
        if expert_alignment > 1:
            per_expert = [-(-c // expert_alignment) * expert_alignment for c in per_expert]
        handle = _Handle(in_rank, send_counts, recv_counts, config.num_sms)
        return recv_x, recv_idx, recv_w, per_expert, handle, EventOverlap()

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        self._check_rows(x)
        assert bias is None
        assert config is not None and config.num_sms == handle.num_sms, \
            "combine needs the original dispatch's SMs"
        assert x.shape[0] == sum(handle.recv_counts), "combine takes the received rows"
        back = self._send(x, handle.recv_counts, handle.send_counts)
        w_back = (None if topk_weights is None else
                  self._send(topk_weights.float(), handle.recv_counts, handle.send_counts))
        n = handle.in_rank.shape[0]
        acc_dtype = torch.promote_types(x.dtype, torch.float32)  # DeepEP sums in float32
        out = torch.zeros((n, x.shape[1]), dtype=acc_dtype)
        w_out = None if w_back is None else torch.zeros((n, w_back.shape[1]))
        start = 0
        for r, count in enumerate(handle.send_counts):
            tokens = handle.in_rank[:, r].nonzero().squeeze(1)
            out.index_add_(0, tokens, back[start:start + count].to(acc_dtype))
            if w_out is not None:
                w_out.index_add_(0, tokens, w_back[start:start + count])
            start += count
        return out.to(x.dtype), w_out, EventOverlap()


def install() -> None:
    """``import deep_ep`` finds this module in the calling process, and the deepep exchange
    takes CPU rows of any float dtype (on CUDA it keeps requiring DeepEP's bf16)."""
    from moe_fn.comm import deepep

    module = types.ModuleType("deep_ep")
    module.Buffer, module.Config, module.EventOverlap = Buffer, Config, EventOverlap
    sys.modules["deep_ep"] = module
    real_check = deepep.DeepEPExchange._check_rows

    def check_rows(name, x):
        if x.is_cuda or not x.is_floating_point():
            real_check(name, x)
    deepep.DeepEPExchange._check_rows = staticmethod(check_rows)
