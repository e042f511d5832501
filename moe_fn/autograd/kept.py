"""The recompute of a MoE layer that kept its activations (``recompute_in_checkpoint=False``)
inside a reentrant checkpoint."""

from __future__ import annotations

import torch

from ._common import refuse_double_backward


class ReplayKept(torch.autograd.Function):
    """Returns the forward's outputs without running the layer; its backward runs the graph
    the forward built from ``kept.x_leaf`` (parameter gradients accumulate there, as in any
    backward) and hands the leaf's gradient on as the input's. ``anchor``: an empty tensor
    that requires grad whenever the kept graph does, so that this node's backward runs
    (and the layer's parameters get their gradients) even when ``x`` does not require grad."""

    @staticmethod
    def forward(ctx, x, anchor, kept):
        ctx.kept = kept
        # New tensors: the kept ones belong to the forward's graph.
        return kept.out.detach().clone(), kept.logits.detach().clone()

    @staticmethod
    def backward(ctx, d_out, d_logits):
        refuse_double_backward("ReplayKept")
        kept, ctx.kept = ctx.kept, None  # one backward; frees the kept graph after it
        if kept is None:
            raise RuntimeError("moe_fn: a kept MoE layer's backward ran twice; a second "
                               "backward through one checkpoint is not supported")
        outs, grads = [], []
        for t, g in ((kept.out, d_out), (kept.logits, d_logits)):
            if g is not None and t.requires_grad:
                outs.append(t)
                grads.append(g)
        if outs:
            torch.autograd.backward(outs, grads)
        return kept.x_leaf.grad, None, None
