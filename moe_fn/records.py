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
    ``offs``: (E,) int32 cumulative row ends per global expert (``cumsum(counts)``).
    ``token_of_sorted``: (T*k,) int64 token of each expert-sorted row (``perm // top_k``).
    """

    topk_idx: torch.Tensor
    counts: torch.Tensor
    perm: torch.Tensor
    inv_perm: torch.Tensor
    offs: torch.Tensor
    token_of_sorted: torch.Tensor
    num_experts: int
    top_k: int

    @property
    def num_tokens(self) -> int:
        return self.topk_idx.shape[0]


@attrs.frozen(kw_only=True, eq=False)
class SortedRowsHandle:
    """Layout of one dispatch over the ``local`` or ``all_to_all`` exchange.

    ``plan``: the route. Rank d owns experts [d*E_local, (d+1)*E_local), so the
    expert-sorted rows for rank d are contiguous; this rank's own slice never enters the
    collective.
    ``send_splits`` / ``recv_splits``: rows sent to / received from each rank (host ints),
    0 for this rank itself.
    ``remote_tokens`` (n_send,) / ``self_tokens`` (n_own,) int64: the token of each sent
    row and of each own row, in sorted order.
    ``self_dst`` (n_own,) / ``recv_dst`` (n_recv,) int64: the expert-major position of each
    own row and of each received row; ``self_dst`` None on one rank (sorted order is then
    expert order).
    ``expert_src`` (N,) int64: for each expert-major row, its position in [received rows,
    in arrival order; own rows]; None on one rank.
    ``home_order`` (T*k,) int64: for each flattened (token, k) row, its position in
    [rows returned from other ranks, in sorted order; own rows]; None on one rank.
    ``local_offs`` (E_local,) int32: cumulative row ends per local expert (ends at N).
    ``num_rows``: N, rows this rank computes.
    ``flat``: the same layout for inputs with one row per (token, k) (routing weights):
    its ``remote_tokens``/``self_tokens`` index flattened rows; None inside ``flat``.
    """

    plan: RoutePlan
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    remote_tokens: torch.Tensor | None
    self_tokens: torch.Tensor
    self_dst: torch.Tensor | None
    recv_dst: torch.Tensor | None
    expert_src: torch.Tensor | None
    home_order: torch.Tensor | None
    local_offs: torch.Tensor
    num_rows: int
    flat: SortedRowsHandle | None


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


@attrs.frozen(kw_only=True, eq=False)
class SymmMemHandle:
    """Layout of one dispatch over the ``symm_mem`` exchange: rows pulled straight from the
    rank that holds them.

    ``plan``: the route. For each expert-major row this rank computes (``num_rows`` N,
    grouped by local expert, then by source rank, then in the source's sorted order):
    ``src_rank`` (N,) int32, the rank it comes from, and ``src_flat`` (N,) int64, its
    flattened (token, k) index there. ``token_slots`` (ep * max_tokens * k,) int32: at
    ``(s * max_tokens + t) * k + j`` the position of row (t, j) of rank s, -1 where this
    rank does not compute it (a token's rows side by side: the dispatch reads each token
    once, the combine sums each token's rows here). For each of this rank's flattened
    (token, k) rows: ``home_rank`` (T*k,) int32, the rank that computes it, and
    ``home_pos`` (T*k,) int64, its expert-major position there. ``local_offs`` (E_local,)
    int32: row ends per local expert. ``max_tokens`` / ``max_rows``: the most tokens /
    expert rows of any rank (host ints every rank agrees on: the sizes of what each rank
    exposes).
    """

    plan: RoutePlan
    src_rank: torch.Tensor
    src_flat: torch.Tensor
    token_slots: torch.Tensor
    home_rank: torch.Tensor
    home_pos: torch.Tensor
    local_offs: torch.Tensor
    num_rows: int
    max_tokens: int
    max_rows: int


@attrs.frozen(kw_only=True, eq=False)
class BalanceTerms:
    """What a layer's balancing losses fixed in its forward, which their gradient (and a
    checkpoint's recompute) reuses: never counted or all-reduced again.

    ``score_func``: the router's, which picks the probabilities the losses balance.
    ``switch`` / ``sequence``: ``(coefficient, W)`` of the Switch/GShard loss (``W (1, E)``
    float32, from the counts of the whole scope) and of the sequence-level loss (``W (B,
    E)``, one row per sequence), or None where off (see ``moe_fn.pure.balance``).
    ``z``: the z-loss's coefficient (0: off).
    ``extra``: further terms (``moe_fn.hf``: transformers' own loss), each with
    ``grad(logits) -> d_logits``, evaluated in the backward.
    """

    score_func: str
    switch: tuple | None = None
    sequence: tuple | None = None
    z: float = 0.0
    extra: tuple = ()
