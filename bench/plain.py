"""The reference arms: MoE pieces as plain PyTorch code writes them, and transformers'
modules with its ``grouped_mm`` experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .shapes import Model


def _at_least_float32(t):
    return t.to(torch.promote_types(t.dtype, torch.float32))


def route(logits, model: Model, bias=None):
    """``(topk_weight float32 (T, k), topk_idx (T, k))`` as the HF blocks route: softmax,
    ``torch.topk``, renormalise (Qwen3, Mixtral); or sigmoid with the choice bias, expert
    groups by their top-2 sums, the best groups' top-k, renormalise and scale (DeepSeek-V3).
    """
    r, k = model.routing, model.top_k
    if r.get("score_func", "softmax") == "softmax":
        probs = torch.softmax(_at_least_float32(logits), dim=-1)
        w, idx = torch.topk(probs, k, dim=-1)
        if r.get("norm_topk_prob"):
            w = w / w.sum(dim=-1, keepdim=True)
        return w * r.get("routed_scaling_factor", 1.0), idx
    scores = torch.sigmoid(_at_least_float32(logits))
    choice = scores if bias is None else scores + bias
    t, e = choice.shape
    g = r["n_group"]
    group_scores = choice.view(t, g, e // g).topk(2, dim=-1).values.sum(dim=-1)
    keep = torch.zeros_like(group_scores).scatter_(
        1, torch.topk(group_scores, r["topk_group"], dim=-1).indices, 1.0)
    mask = keep[:, :, None].expand(t, g, e // g).reshape(t, e)
    idx = torch.topk(choice.masked_fill(mask == 0, float("-inf")), k, dim=-1).indices
    w = scores.gather(1, idx)
    if r.get("norm_topk_prob"):
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * r.get("routed_scaling_factor", 1.0), idx


def layout(topk_idx, num_experts: int):
    """``(counts, offs int32, perm, inv_perm, token_of_sorted)``: a stable argsort."""
    flat = topk_idx.reshape(-1)
    perm = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    offs = counts.cumsum(0).to(torch.int32)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return counts, offs, perm, inv, perm // topk_idx.shape[1]


def experts(x, w_gate, w_up, w_down, offs):
    """Three ``torch._grouped_mm`` with an eager ``silu(g) * u`` between (a matmul per
    expert in float64, which ``_grouped_mm`` does not take)."""
    g = grouped_mm(x, w_gate, offs)
    u = grouped_mm(x, w_up, offs)
    return grouped_mm(F.silu(g) * u, w_down, offs)


def grouped_mm(x, w, offs, linear=None):
    """Rows ``x[offs[e-1]:offs[e]] @ w[e]^T`` per expert: one ``torch._grouped_mm``, or with
    ``linear(rows, w[e])`` (or in float64) a loop."""
    if linear is None and x.dtype != torch.float64:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    linear = linear or (lambda r, we: r @ we.t())
    parts, start = [], 0
    for e, end in enumerate(offs.tolist()):
        parts.append(linear(x[start:end], w[e]))
        start = end
    return torch.cat(parts)


def fp8_experts(x, gate_up, down, offs):
    """The expert MLP with both GEMMs as ``moe_fn.testing.fp8.fp8_linear`` (the FP8 rule's
    plain arm), SwiGLU on the halves between."""
    from moe_fn.testing.fp8 import fp8_linear

    i = down.shape[2]
    gu = grouped_mm(x, gate_up, offs, fp8_linear)
    return grouped_mm(F.silu(gu[:, :i]) * gu[:, i:], down, offs, fp8_linear)


def torchao_fp8_available() -> bool:
    """Whether torchao's FP8 rowwise MoE training GEMM can run here (CUDA, torchao)."""
    if not torch.cuda.is_available():
        return False
    try:
        from torchao.prototype.moe_training.fp8_grouped_mm import (  # noqa: F401
            _to_fp8_rowwise_then_scaled_grouped_mm,
        )
    except ImportError:
        return False
    return True


def torchao_fp8_experts(x, gate_up, down, offs):
    """torchao's FP8 rowwise MoE training path, as TorchTitan runs the experts: each
    GEMM through ``_to_fp8_rowwise_then_scaled_grouped_mm`` (its own Triton quantisation of
    both operands, forward and backward; groups already multiples of 16, so unpadded),
    an eager SwiGLU between."""
    from torchao.prototype.moe_training.fp8_grouped_mm import (
        _to_fp8_rowwise_then_scaled_grouped_mm as fp8_mm,
    )
    i = down.shape[2]
    gu = fp8_mm(x, gate_up.transpose(-2, -1), offs, pad_token_groups_for_grouped_mm=False)
    h = F.silu(gu[:, :i]) * gu[:, i:]
    return fp8_mm(h, down.transpose(-2, -1), offs, pad_token_groups_for_grouped_mm=False)


def grouped_linear_loop(x, weight, counts: list[int]):
    """A Python loop of one matmul per expert."""
    parts, start = [], 0
    for e, c in enumerate(counts):
        parts.append(x[start:start + c] @ weight[e].t())
        start += c
    return torch.cat(parts)


class PlainLayer(torch.nn.Module):
    """A plain PyTorch MoE layer: the HF router, a stable argsort, three grouped GEMMs with
    an eager activation, weighted rows summed back with ``index_add``."""

    def __init__(self, model: Model, router_weight, gate_up_proj, down_proj, bias=None):
        super().__init__()
        i = model.inter
        self.model = model
        self.router = torch.nn.Parameter(router_weight.detach().clone())
        self.w_gate = torch.nn.Parameter(gate_up_proj.detach()[:, :i].contiguous())
        self.w_up = torch.nn.Parameter(gate_up_proj.detach()[:, i:].contiguous())
        self.w_down = torch.nn.Parameter(down_proj.detach().clone())
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x):
        return layer_forward(x, self.router, self.w_gate, self.w_up, self.w_down, self.model,
                             self.bias)


def route_weights(logits, idx, model: Model):
    """The weights ``route`` gives the experts ``idx (T, k)`` (a route taken elsewhere)."""
    r = model.routing
    if r.get("score_func", "softmax") == "softmax":
        w = torch.softmax(_at_least_float32(logits), dim=-1).gather(1, idx)
        if r.get("norm_topk_prob"):
            w = w / w.sum(dim=-1, keepdim=True)
    else:
        w = torch.sigmoid(_at_least_float32(logits)).gather(1, idx)
        if r.get("norm_topk_prob"):
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * r.get("routed_scaling_factor", 1.0)


def layer_forward(x, router, w_gate, w_up, w_down, model: Model, bias=None, topk_idx=None):
    """``PlainLayer``'s forward on the given weights; ``topk_idx``: on that route instead of
    its own."""
    k = model.top_k
    logits = F.linear(x, router)
    if topk_idx is None:
        w, idx = route(logits, model, bias)
    else:
        w, idx = route_weights(logits, topk_idx, model), topk_idx
    _, offs, perm, _, token = layout(idx, model.experts)
    y = experts(x[token], w_gate, w_up, w_down, offs)
    y = y * w.reshape(-1)[perm, None].to(y.dtype)
    return torch.zeros_like(x).index_add(0, perm // k, y)


def hf_qwen3_config(model: Model, num_experts: int | None = None):
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(hidden_size=model.hidden, moe_intermediate_size=model.inter,
                         num_experts=num_experts or model.experts,
                         num_experts_per_tok=model.top_k,
                         norm_topk_prob=bool(model.routing.get("norm_topk_prob")))
    cfg._experts_implementation = "grouped_mm"
    return cfg


def hf_applies(model: Model) -> bool:
    """Qwen3's block routes as softmax, top-k, renormalise: the softmax shapes."""
    return (model.routing.get("score_func", "softmax") == "softmax"
            and model.routing.get("routed_scaling_factor", 1.0) == 1.0)


def _on(module_cls, cfg, device, dtype):
    """``module_cls(cfg)`` built without initialising its weights, on ``device``."""
    with torch.device("meta"):
        mod = module_cls(cfg)
    return mod.to(dtype).to_empty(device=device)


def hf_block(model: Model, router_weight, gate_up_proj, down_proj):
    """transformers' ``Qwen3MoeSparseMoeBlock`` (``grouped_mm`` experts) holding the given
    weights; called on ``(T, H)`` it returns ``(T, H)``."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    block = _on(Qwen3MoeSparseMoeBlock, hf_qwen3_config(model), router_weight.device,
                router_weight.dtype)
    with torch.no_grad():
        block.gate.weight.copy_(router_weight)
        block.experts.gate_up_proj.copy_(gate_up_proj)
        block.experts.down_proj.copy_(down_proj)

    def call(x):
        out = block(x[None])
        return (out[0] if isinstance(out, tuple) else out).reshape(x.shape)
    call.module = block
    return call


def hf_experts(model: Model, gate_up_proj, down_proj):
    """transformers' ``Qwen3MoeExperts`` with its ``grouped_mm`` implementation over the
    given (E, 2I, H) / (E, H, I) parameters; called as ``(x, expert_of_row (N, 1), ones)``."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = hf_qwen3_config(model, num_experts=gate_up_proj.shape[0])
    mod = _on(Qwen3MoeExperts, cfg, gate_up_proj.device, gate_up_proj.dtype)
    mod.gate_up_proj = gate_up_proj
    mod.down_proj = down_proj
    return mod
