"""expert_precision='fp8_rowwise' on the GPU (skipped without CUDA, or on a GPU without the
grouped FP8 GEMM): torch._scaled_grouped_mm, the FP8 kernels, the experts and the layer
against the float64 oracle by the tolerance rule, with the plain FP8 recipe
(moe_fn.testing.fp8) run on the GPU in bf16 as plain; CUDA-graph replay after the weights
change; the refusals only a GPU shows."""

from __future__ import annotations

import copy

import pytest
import torch

from moe_fn import MoEConfig, MoELayer, functional
from moe_fn.pure import fp8 as P
from moe_fn.testing import (
    assert_all_close_to_ref,
    layer_params,
    reference_activation,
    reference_moe,
    reference_route,
    split_gate_up,
)
from moe_fn.testing.fp8 import fp8_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(torch.cuda.is_available()
                       and torch.cuda.get_device_capability() < (9, 0),
                       reason="needs FP8 tensor cores (compute capability 9.0+)"),
]


def test_the_grouped_fp8_gemm_is_the_exact_product_to_bf16_accuracy():
    torch.manual_seed(0)
    counts = [64, 0, 200, 8, 120, 1]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    a = P.quantize_rows(torch.randn(sum(counts), 512) * 4)
    b = P.quantize_weight(torch.randn(len(counts), 256, 512))
    exact = P.fp8_grouped_mm(a, b, offs, torch.float64)
    gpu = P.grouped_mm_fp8(P.Fp8Rows(a.q.cuda(), a.scale.cuda()),
                           P.Fp8Rows(b.q.cuda(), b.scale.cuda()), offs.cuda(), torch.bfloat16)
    # Plain: the dequantised operands multiplied by cuBLAS in float32, rounded to bf16.
    af = (a.q.float() * a.scale[:, None]).cuda()
    bf = (b.q.float() * b.scale[..., None]).cuda()
    plain = torch.cat([af[s:e] @ bf[g].t() for g, (s, e) in
                       enumerate(zip([0] + offs.tolist()[:-1], offs.tolist()))]).bfloat16()
    assert_all_close_to_ref([gpu.cpu()], [plain.cpu()], [exact], ["y"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_quantising_kernels_give_the_pure_bits(dtype):
    torch.manual_seed(1)
    x = torch.randn(777, 2048, dtype=dtype) * torch.exp2(torch.randint(-6, 7, (777, 1))).to(dtype)
    index = torch.randint(0, 777, (1500,))
    from moe_fn import kernels
    got = kernels.quantize_rows_packed(x.cuda(), index.cuda()).cpu()
    assert torch.equal(got, P.quantize_rows_packed(x, index))
    rows = kernels.quantize_rows(x.cuda())
    want = P.quantize_rows(x)
    assert torch.equal(rows.q.cpu().view(torch.uint8), want.q.view(torch.uint8))
    assert torch.equal(rows.scale.cpu(), want.scale)


def _naive_experts(x, gu, dn, w, counts, fp8):
    lin = fp8_linear if fp8 else (lambda a, b: a @ b.t())
    outs, start = [], 0
    for e, c in enumerate(counts):
        r = slice(start, start + c)
        h = reference_activation(*split_gate_up(lin(x[r], gu[e]), "halves"), "swiglu")
        outs.append(lin(h * w[r, None], dn[e]))
        start += c
    return torch.cat(outs)


def test_experts_in_fp8_against_float64():
    torch.manual_seed(2)
    counts = [64, 0, 200, 8, 120]
    n, h, i, e = sum(counts), 256, 192, len(counts)
    x = torch.randn(n, h) * torch.exp2(torch.randint(-3, 4, (n, 1))).float()
    gu = torch.randn(e, 2 * i, h) * h ** -0.5 * 2
    dn = torch.randn(e, h, i) * i ** -0.5
    w = torch.rand(n)
    dy = torch.randn(n, h)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()

    def results(f, dt, dev):
        leaves = [t.detach().to(dev, dt).requires_grad_() for t in (x, gu, dn, w)]
        y = f(*leaves)
        y.backward(dy.to(dev, dt))
        return [y.detach().double().cpu()] + [t.grad.double().cpu() for t in leaves]

    ref64 = results(lambda *a: _naive_experts(*a, counts, False), torch.float64, "cpu")
    plain = results(lambda *a: _naive_experts(*a, counts, True), torch.bfloat16, "cuda")
    got = results(lambda x, gu, dn, w: functional.experts(x, gu, dn, offs, weights=w,
                                                          precision="fp8_rowwise"),
                  torch.bfloat16, "cuda")
    for name, g, p, r in zip(("y", "x", "gate_up", "down", "weights"), got, plain, ref64):
        assert_all_close_to_ref([g.bfloat16()], [p.bfloat16()], [r], [name])


def _layer_results(layer, x, dy):
    x = x.detach().clone().requires_grad_()
    out, logits = layer(x, return_router_logits=True)
    (out.float() * dy.float()).sum().backward()
    return [out.detach(), logits.detach(), x.grad] + [p.grad for _, p in
                                                      sorted(layer.named_parameters())]


@pytest.mark.parametrize("kw", [dict(), dict(score_func="sigmoid", score_apply="activation")],
                         ids=["softmax-post", "sigmoid-activation"])
def test_layer_in_fp8_against_float64(kw):
    cfg = MoEConfig(hidden_size=256, intermediate_size=128, num_experts=16, top_k=4,
                    expert_precision="fp8_rowwise", **kw)
    torch.manual_seed(3)
    ref = MoELayer(cfg, dtype=torch.float64)
    with torch.no_grad():
        ref.router.weight.normal_(0, 0.5)
    x = torch.randn(384, 256, dtype=torch.float64)
    dy = torch.randn_like(x)
    params = layer_params(ref)

    layer = MoELayer(cfg, device="cuda", dtype=torch.bfloat16)
    layer.load_state_dict(ref.state_dict())
    got = [t.cpu() for t in _layer_results(layer, x.cuda().bfloat16(), dy.cuda().bfloat16())]
    # The references take the layer's route (its bf16 logits' choice): near-ties in bf16
    # would otherwise route a few tokens elsewhere, which no tolerance covers.
    route = reference_route(got[1].double(), top_k=cfg.top_k, score_func=cfg.score_func,
                            norm_topk_prob=cfg.norm_topk_prob).topk_idx

    def reference(dt, dev, fp8):
        p = params._replace(**{k: v.detach().to(dev, dt).requires_grad_()
                               for k, v in params._asdict().items()
                               if isinstance(v, torch.Tensor) and k != "score_correction_bias"})
        xx = x.detach().to(dev, dt).requires_grad_()
        res = reference_moe(xx, p, cfg, fp8=fp8, topk_idx=route.to(dev))
        (res.out.float() * dy.to(dev, dt).float()).sum().backward()
        return [res.out.detach(), res.logits.detach(), xx.grad, p.down_proj.grad,
                p.gate_up_proj.grad, p.router_weight.grad]

    ref64 = [t.cpu() for t in reference(torch.float64, "cpu", False)]
    plain = [t.cpu() for t in reference(torch.bfloat16, "cuda", True)]
    assert_all_close_to_ref(got, plain, ref64, ["out", "logits", "x", "experts.down_proj",
                                                "experts.gate_up_proj", "router.weight"])


def test_a_captured_fp8_layer_reads_the_weights_as_they_change():
    torch.manual_seed(4)
    cfg = MoEConfig(hidden_size=256, intermediate_size=128, num_experts=16, top_k=4,
                    expert_precision="fp8_rowwise")
    eager = MoELayer(cfg, device="cuda", dtype=torch.bfloat16)
    graphed_layer = copy.deepcopy(eager)
    graphed = torch.cuda.make_graphed_callables(
        graphed_layer,
        (torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True),))
    for step in range(3):
        x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():  # an optimizer step, in place, on both
            for a, b in zip(eager.parameters(), graphed_layer.parameters()):
                delta = torch.randn_like(a) * 0.01
                a.add_(delta)
                b.add_(delta)
        assert torch.equal(eager(x.requires_grad_()).float(),
                           graphed(x.clone().requires_grad_()).float()), step


def test_a_float32_layer_is_refused_on_cuda():
    layer = MoELayer(MoEConfig(hidden_size=64, intermediate_size=32, num_experts=4, top_k=2,
                               expert_precision="fp8_rowwise"), device="cuda")
    with pytest.raises(TypeError, match="on CUDA needs a bfloat16 layer"):
        layer(torch.randn(8, 64, device="cuda"))
