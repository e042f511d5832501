"""What a token-once exchange (DeepEP) does besides its transport: a token crosses to
a rank once and is expanded there into its expert rows (``handle.token_of_row``); the
combine sums each received token's rows on the expert side (``handle.row_of_slot``) and
sends one partial per (token, rank) home. So the routing weights can be folded into that
per-token sum, and the combine's backward into the weighting's backward.

Subclasses provide the two transports: ``_partials_home(partials, handle) -> out (T, H)``
and ``_tokens_to_experts(d_out, handle) -> received rows (T_recv, H)``.
"""

from __future__ import annotations

import torch

from .. import kernels
from .base import Exchange


class TokenRowsExchange(Exchange):
    folds_row_weights = True

    def _partials_home(self, partials, handle):
        raise NotImplementedError

    def _tokens_to_experts(self, d_out, handle):
        raise NotImplementedError

    @staticmethod
    def _per_slot(row_values, table):
        """``(R, k)``: each received token's slot value from ``row_values (N,)`` through
        ``table = handle.row_of_slot``, zero where the slot's expert lives elsewhere."""
        if row_values.numel() == 0:  # no rows here: every slot is elsewhere
            return row_values.new_zeros(table.shape)
        return torch.where(table >= 0, row_values.reshape(-1)[table.clamp(min=0)], 0)

    def combine_fwd(self, rows, handle):
        self.counters["combine"] += 1
        partials = kernels.masked_gather_sum(rows, handle.row_of_slot)
        return self._partials_home(partials, handle), handle

    def combine_row_weighted_fwd(self, rows, row_weights, handle):
        """The combine of ``rows * row_weights`` with the weighting folded into the
        per-token sum: no weighted rows are written."""
        self.counters["combine"] += 1
        partials = kernels.masked_gather_sum(rows, handle.row_of_slot, row_weights)
        return self._partials_home(partials, handle)

    # d_rows[i] = d_out[home token of row i]: a cached dispatch of the output gradient.
    def combine_bwd(self, handle, d_out):
        self.counters["combine_backward"] += 1
        return self._tokens_to_experts(d_out, handle).index_select(0, handle.token_of_row)

    def combine_bwd_weighted_rows(self, handle, d_out, rows, row_weights, *, fused: bool):
        """With ``fused``, the expansion of the received gradient into rows and the
        weighting's backward are one pass."""
        if not fused:
            return super().combine_bwd_weighted_rows(handle, d_out, rows, row_weights,
                                                     fused=False)
        self.counters["combine_backward"] += 1
        received = self._tokens_to_experts(d_out, handle)
        return kernels.gather_row_weight_bwd(received, handle.token_of_row, rows, row_weights)
