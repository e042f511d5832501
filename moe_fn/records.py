"""Immutable records that carry routing and exchange state across recompute.

Built in eager code (attrs' frozen ``__init__`` does not trace under fullgraph compile)
and only read afterwards. ``eq=False`` keeps identity semantics: two plans are the same
plan only if they are the same object, which is what replay checks.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen(kw_only=True, eq=False)
class RoutePlan:
    """Which experts each token chose and the expert-sorted order of its rows.

    ``topk_idx``: (T, k) int64 global expert ids in [0, num_experts).
    ``counts``: (E,) int64 rows per global expert, summing to T*k.
    ``perm``: (T*k,) int64, a stable sort of the flattened rows ``t*k + j`` by expert:
    ``perm[i]`` is the flattened row at sorted position ``i``.
    ``inv_perm``: (T*k,) int64 inverse of ``perm``.
    """

    topk_idx: torch.Tensor
    counts: torch.Tensor
    perm: torch.Tensor
    inv_perm: torch.Tensor
    num_experts: int
    top_k: int

    @property
    def num_tokens(self) -> int:
        return self.topk_idx.shape[0]

    @property
    def token_of_sorted(self) -> torch.Tensor:
        """(T*k,) int64 token of each expert-sorted row."""
        return self.perm // self.top_k


@attrs.frozen(kw_only=True, eq=False)
class SortedRowsHandle:
    """Layout of one dispatch over the ``local`` or ``all_to_all`` exchange.

    ``plan``: the route this layout was computed for.
    ``send_splits`` / ``recv_splits``: rows sent to / received from each rank (host ints;
    the expert-sorted rows for rank d are contiguous because rank d owns experts
    [d*E_local, (d+1)*E_local)).
    ``local_order``: (N,) int64; the received rows arrive grouped by source rank, then
    expert; ``received[local_order]`` groups them by local expert.
    ``local_inv``: (N,) int64 inverse of ``local_order``.
    ``local_offs``: (E_local,) int32 cumulative row ends per local expert (ends at N).
    ``num_rows``: N, rows this rank computes.
    """

    plan: RoutePlan
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    local_order: torch.Tensor | None
    local_inv: torch.Tensor | None
    local_offs: torch.Tensor
    num_rows: int


@attrs.frozen(kw_only=True, eq=False)
class DeepEPHandle:
    """Layout of one dispatch over DeepEP.

    ``plan``: the route. ``deepep_handle``: the tuple DeepEP's dispatch returned (reused by
    cached dispatch and combine; never recomputed). ``token_of_row`` / ``slot_of_row``:
    (N,) int64, for each expert row (grouped by local expert) the received token it comes
    from and its top-k slot. ``num_recv_tokens``: tokens received. ``local_offs``:
    (E_local,) int32 row ends per local expert. ``num_rows``: N. ``recv_weights``:
    (num_recv_tokens, k) float32 routing weights as received (a cached dispatch carries
    none, so a replay reads them here). ``row_of_slot``: (num_recv_tokens, k) int64, the
    expert row of each received (token, slot), -1 where that slot's expert is elsewhere.
    """

    plan: RoutePlan
    deepep_handle: tuple
    token_of_row: torch.Tensor
    slot_of_row: torch.Tensor
    num_recv_tokens: int
    local_offs: torch.Tensor
    num_rows: int
    recv_weights: torch.Tensor
    row_of_slot: torch.Tensor
