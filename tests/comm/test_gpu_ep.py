"""Two-GPU checks (skipped with fewer than two GPUs): the symm_mem exchange (to rounding)
over real symmetric memory against the all_to_all exchange over NCCL on the same model:
plain, with the weight-gradient overlap, under the reentrant checkpoint with the combine
skip, and across a buffer growth and a release. Run with both GPUs visible:
``python -m pytest tests/comm/test_gpu_ep.py``."""

from __future__ import annotations

import pytest
import torch

import moe_fn
from moe_fn import MoEConfig, MoELayer
from moe_fn.testing import assert_close_to_ref
from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.multiproc,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

H, I, E = 256, 128, 16


def _grads(rank, world, device, dtype, tokens, backend, **kw):
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=4,
                    comm_backend=backend, ep_size=world, **kw)
    layer = MoELayer(cfg, device=device, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    el = cfg.num_local_experts
    with torch.no_grad():
        layer.router.weight.copy_(torch.randn(E, H, generator=g) * 0.1)
        layer.experts.gate_up_proj.copy_((torch.randn(E, 2 * I, H, generator=g) * 0.05)
                                         [rank * el:(rank + 1) * el])
        layer.experts.down_proj.copy_((torch.randn(E, H, I, generator=g) * 0.05)
                                      [rank * el:(rank + 1) * el])
    gx = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(tokens, H, generator=gx).to(device, dtype).requires_grad_()
    dy = torch.randn(tokens, H, generator=gx).to(device, dtype)

    def block(h):
        return h + layer(h)
    out = (moe_fn.checkpoint(block, x) if kw.get("skip_recompute_combine") else block(x))
    out.backward(dy)
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


def compare_transports(rank, world, device=None):
    """symm_mem against collective; ``device`` defaults to this rank's GPU. symm_mem
    sums in other orders (a token's rows per rank first, then the ranks' float32 partials;
    the routing weights' gradient as a dot product on the expert side), so its results are
    held to the kernel rule against a float64 run of the collective: its error at most
    twice the collective's plus one step of the dtype; the experts' gradients are
    identical."""
    device = device or torch.device("cuda", rank)
    ref64 = {}
    for dtype, kw, tokens in [
            (torch.float32, {}, 300),
            (torch.bfloat16, {}, 300),
            (torch.float32, dict(overlap_weight_grad=True), 300),
            (torch.float32, dict(skip_recompute_combine=True), 300),
            (torch.float32, {}, 20000)]:  # 80 MB of rows: more than the first buffer holds
        if tokens not in ref64:  # the same function with every option
            ref64[tokens] = _grads(rank, world, device, torch.float64, tokens, "all_to_all")
        want = _grads(rank, world, device, dtype, tokens, "all_to_all", **kw)
        got = _grads(rank, world, device, dtype, tokens, "symm_mem", **kw)
        for name, a, b, r in zip(["out", "x.grad", "router", "gate_up", "down"], want, got,
                                 ref64[tokens]):
            assert_close_to_ref(b, a, r, f"{name} {dtype} {kw} {tokens}")
            if name in ("gate_up", "down"):  # the same row gradients reach the experts
                assert torch.equal(b, a), f"{name} {dtype} {kw} {tokens}"
    moe_fn.release_comm_resources()
    got = _grads(rank, world, device, torch.float32, 64, "symm_mem")
    want = _grads(rank, world, device, torch.float32, 64, "all_to_all")
    ref = _grads(rank, world, device, torch.float64, 64, "all_to_all")
    for a, b, r in zip(want, got, ref):
        assert_close_to_ref(b, a, r, "after release")


def test_symm_mem_matches_the_collective_on_two_gpus():
    run_distributed(compare_transports, 2, backend="nccl")
