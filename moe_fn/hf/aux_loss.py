"""transformers' own load-balancing loss, trained under reentrant checkpointing.

With ``output_router_logits`` and ``labels``, an HF MoE model adds ``router_aux_loss_coef *
load_balancing_loss_func(router_logits, E, k, attention_mask)`` to its loss. That function
pools every layer's captured logits ``z_l (T, E)``: with ``p = softmax(z)`` in the logits'
dtype, the (masked) counts ``C_e`` of each token's top-k by ``p`` and the row count ``R``
(masked tokens times layers), ``aux = E sum_e (C_e / R) (sum_{l,t} m_t p_lte / R)``.

A reentrant checkpoint runs its forward without autograd, so the logits it captures carry
no gradient and that loss trains nothing (in transformers' own model too). A converted
model computes the loss's gradient itself instead, exactly:

- its forward pre-hook reads what the model's forward will do (``labels``,
  ``attention_mask``, ``output_router_logits``, the coefficient, E and k as the model
  reads them) and opens an ``AuxLossForward``; each converted block adds its logits to it
  (in the forward, never in a recompute), and the forward hook closes it: by the time
  any backward runs the model-wide counts are known;
- each block inside a reentrant checkpoint hands its MoELayer an ``AuxLossTerm``, which the
  layer's replay entry keeps for the recompute and whose gradient ``d coef*aux / d z_l =
  coef E m_t C / R^2`` through the softmax the layer adds in its own backward, with the
  operations (and float32 rounding) of autograd through transformers' function.

Outside reentrant checkpoints the captured logits carry their gradient and transformers'
autograd trains the loss; the counts are still pooled from every block, so a model whose
decoder layers mix the modes is exact too. The gradient assumes the model's ``loss`` is
backpropagated as it is; ``moe_fn.balance.set_loss_scale`` gives the factor otherwise.
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["AuxLossForward", "AuxLossHooks", "AuxLossTerm", "computes_hf_aux_loss"]


def computes_hf_aux_loss(model) -> bool:
    """Whether ``model``'s forward calls transformers' ``load_balancing_loss_func``."""
    fn = inspect.unwrap(type(model).forward)
    code = getattr(fn, "__code__", None)
    return code is not None and "load_balancing_loss_func" in code.co_names


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


class AuxLossForward:
    """One model forward whose loss includes transformers' load-balancing loss: its
    coefficient, E, k, attention mask and the logits of every block (model-wide counts,
    computed at the first backward that needs them)."""

    def __init__(self, *, coef: float, num_experts: int, top_k: int, attention_mask):
        self.coef, self.num_experts, self.top_k = coef, num_experts, top_k
        self.attention_mask = attention_mask
        self.logits: list[torch.Tensor] = []
        self.closed = False
        self._weights = None

    def add(self, logits: torch.Tensor) -> None:
        """One block's router logits ``(T, E)``, as transformers captures them."""
        if self.closed:
            raise RuntimeError("a converted block ran after the model's forward returned, "
                               "outside it: call the converted model, not its blocks")
        self.logits.append(logits.detach())

    def mask(self, device) -> torch.Tensor | None:
        m = self.attention_mask
        return None if m is None else m.reshape(-1).to(device=device, dtype=torch.float32)

    def weights(self) -> torch.Tensor:
        """``(E,)`` float32: ``d(coef * aux) / d(sum_t m_t p_te)`` for every layer, as
        autograd through transformers' function computes it (same operations, same
        order)."""
        if not self.closed:
            raise RuntimeError("transformers' load-balancing loss: a backward reached a "
                               "converted block before the model's forward returned; its "
                               "counts pool every layer's, which are known only then")
        if self._weights is None:
            e, k = self.num_experts, self.top_k
            dev = self.logits[0].device
            counts = torch.zeros(e, dtype=torch.float32, device=dev)
            rows = 0.0
            mask = self.mask(dev)
            for z in self.logits:
                _, chosen = torch.topk(torch.softmax(z, dim=-1), k, dim=-1)
                if mask is None:
                    # As transformers' histc: no host sync, exact integer counts.
                    flat = chosen.reshape(-1)
                    counts = counts + torch.zeros(e, dtype=torch.float32, device=dev).scatter_add(
                        0, flat, torch.ones(flat.shape, dtype=torch.float32, device=dev))
                    rows = rows + z.shape[0]
                else:
                    if mask.shape[0] != z.shape[0]:
                        raise ValueError(
                            f"attention_mask has {mask.shape[0]} entries but a layer routed "
                            f"{z.shape[0]} tokens: transformers' load-balancing loss needs a "
                            "(batch, sequence) mask of the input's tokens")
                    counts = counts + torch.zeros(e, dtype=torch.float32, device=dev).scatter_add(
                        0, chosen.reshape(-1), mask.repeat_interleave(k))
                    rows = rows + mask.sum()
            # aux = E * sum(C/R * P/R): backward from coef * aux, as autograd runs it.
            g = torch.ones((), dtype=torch.float32, device=dev) * self.coef * e
            self._weights = (g * (counts / rows)) / rows
        return self._weights


class AuxLossTerm:
    """One block's share of transformers' loss, for its MoELayer's backward."""

    def __init__(self, forward: AuxLossForward):
        self.forward = forward

    def grad(self, logits: torch.Tensor) -> torch.Tensor:
        w = self.forward.weights()
        mask = self.forward.mask(logits.device)
        g = w.expand(logits.shape) if mask is None else w * mask[:, None]
        p = torch.softmax(logits, dim=-1)
        return torch._softmax_backward_data(g.to(logits.dtype), p, -1, logits.dtype)


class AuxLossHooks:
    """The model-level forward hooks of a converted model whose forward computes
    transformers' loss; ``current`` is the open ``AuxLossForward`` (None between
    forwards, or when this forward's loss has no balancing term to train)."""

    def __init__(self):
        self.current: AuxLossForward | None = None

    def pre_hook(self, model, args, kwargs):
        self.current = None
        if not torch.is_grad_enabled():
            return None
        try:
            sig = inspect.signature(model.forward)
            bound = dict(sig.bind_partial(*args, **kwargs).arguments)
        except TypeError:  # the model's own call will say what is wrong
            return None
        # Arguments the forward takes only through **kwargs (Qwen3-VL-MoE's
        # output_router_logits in transformers 5.17) count as passed.
        for p in sig.parameters.values():
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                bound = {**bound.pop(p.name, {}), **bound}
        text = _text_config(model.config)
        wants = bound.get("output_router_logits")
        wants = getattr(text, "output_router_logits", False) if wants is None else wants
        coef = model.__dict__.get("router_aux_loss_coef",
                                  getattr(text, "router_aux_loss_coef", 0.0))
        if not (wants and bound.get("labels") is not None and coef):
            return None
        e = model.__dict__.get("num_experts", getattr(text, "num_experts", None))
        k = model.__dict__.get("num_experts_per_tok", getattr(text, "num_experts_per_tok", None))
        self.current = AuxLossForward(coef=float(coef), num_experts=int(e), top_k=int(k),
                                      attention_mask=bound.get("attention_mask"))
        return None

    def post_hook(self, model, args, output):
        if self.current is not None:
            self.current.closed = True
        self.current = None
        return None

    def check_layer(self, config) -> None:
        """The open forward's E and k are the layer's (transformers passes the model's)."""
        f = self.current
        if f is not None and (f.num_experts, f.top_k) != (config.num_experts, config.top_k):
            raise ValueError(
                f"transformers' load-balancing loss counts top-{f.top_k} of {f.num_experts} "
                f"experts but a converted block routes top-{config.top_k} of "
                f"{config.num_experts}: the model's num_experts/num_experts_per_tok must "
                "match its blocks")
