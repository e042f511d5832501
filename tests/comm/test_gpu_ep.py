"""Two-GPU checks (skipped with fewer than two GPUs): the copy_engine transport (bit for
bit) and the symm_mem transport (to rounding) over real symmetric memory against the
collective all_to_all over NCCL on the same model — plain, with the weight-gradient
overlap, under the reentrant checkpoint with the combine skip — and across a buffer
growth and a release. Run with both GPUs visible:
``python -m pytest tests/test_gpu_ep.py``."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moe_fn
from moe_fn import MoEConfig, MoELayer
from moe_fn.comm.base import stream_of
from moe_fn.comm.nccl_pool import registered_pool, release_registered_buffers
from moe_fn.comm.peer_memory import release_peer_memory
from moe_fn.testing import assert_close_to_ref
from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.multiproc,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

H, I, E = 256, 128, 16


def _lag_pulls(ex, device, cycles=2_000_000):
    """Every move's pulls queued behind ~1 ms of sleep on the pull stream, so that a read of
    the received rows not ordered after them (a missing event wait) reads stale memory."""
    real = ex._exchange

    def lagging(*a, **kw):
        with torch.cuda.stream(stream_of(ex, "_pull_streams", device)):
            torch.cuda._sleep(cycles)
        return real(*a, **kw)
    ex._exchange = lagging


def _grads(rank, world, device, dtype, tokens, transport, parts=None, lag=False, **kw):
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=4,
                    comm_backend="all_to_all", ep_size=world, all_to_all_transport=transport,
                    row_weighting_impl="fused", combine_impl="fused", **kw)
    layer = MoELayer(cfg, device=device, dtype=dtype)
    if parts is not None:  # the copy engines' pulls in this many parts, however small
        layer.exchange.pull_parts, layer.exchange.min_part_bytes = parts, 0
    if lag:
        _lag_pulls(layer.exchange, device)
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


@contextlib.contextmanager
def _moves_in_registered_pool(device):
    """Asserts that every ``all_to_all_single`` inside hands NCCL tensors (those with
    bytes) lying in the registered pool's segments."""
    real, seen = dist.all_to_all_single, []

    def spy(out, inp, *a, **kw):
        segs = [(g["address"], g["address"] + g["total_size"])
                for g in registered_pool(None, device).snapshot()]
        for t in (out, inp):
            p = t.data_ptr()
            assert t.numel() == 0 or any(lo <= p < hi for lo, hi in segs), (p, segs)
        seen.append(1)
        return real(out, inp, *a, **kw)
    dist.all_to_all_single = spy
    try:
        yield
    finally:
        dist.all_to_all_single = real
    assert seen, "no row move ran"


def compare_transports(rank, world, device=None):
    """registered, copy_engine and symm_mem against collective; ``device`` defaults to this
    rank's GPU. The registered buffers and the copy engines carry the collective's rows:
    every result equal bit for bit. symm_mem
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
            ref64[tokens] = _grads(rank, world, device, torch.float64, tokens, "collective")
        want = _grads(rank, world, device, dtype, tokens, "collective", **kw)
        # The copy engines move the collective's rows: the same results bit for bit.
        # Pulled whole, in three parts however small, and in parts whose pulls lag behind
        # the host by a sleep on their stream (the reads must wait for them).
        # Registered with NCCL: the same collective over other memory, bit for bit too,
        # every row move's two tensors inside the registered pool.
        with _moves_in_registered_pool(device):
            reg = _grads(rank, world, device, dtype, tokens, "registered", **kw)
        for name, a, b in zip(["out", "x.grad", "router", "gate_up", "down"], want, reg):
            assert torch.equal(a, b), f"registered {name} {dtype} {kw} {tokens}"
        for parts, lag in ((None, False), (3, False), (3, True)):
            ce = _grads(rank, world, device, dtype, tokens, "copy_engine", parts, lag, **kw)
            for name, a, b in zip(["out", "x.grad", "router", "gate_up", "down"], want, ce):
                assert torch.equal(a, b), (f"copy_engine {name} {dtype} {kw} {tokens} "
                                           f"{parts} {lag}")
        got = _grads(rank, world, device, dtype, tokens, "symm_mem", **kw)
        for name, a, b, r in zip(["out", "x.grad", "router", "gate_up", "down"], want, got,
                                 ref64[tokens]):
            assert_close_to_ref(b, a, r, f"{name} {dtype} {kw} {tokens}")
            if name in ("gate_up", "down"):  # the same row gradients reach the experts
                assert torch.equal(b, a), f"{name} {dtype} {kw} {tokens}"
    release_peer_memory()
    got = _grads(rank, world, device, torch.float32, 64, "symm_mem")
    want = _grads(rank, world, device, torch.float32, 64, "collective")
    ref = _grads(rank, world, device, torch.float64, 64, "collective")
    for a, b, r in zip(want, got, ref):
        assert_close_to_ref(b, a, r, "after release")
    release_registered_buffers()  # the next move makes and registers a new pool
    for a, b in zip(want, _grads(rank, world, device, torch.float32, 64, "registered")):
        assert torch.equal(a, b), "registered, after release"


def test_symm_mem_matches_the_collective_on_two_gpus():
    run_distributed(compare_transports, 2, backend="nccl")


def _exit_after_destroy(rank, world, init_file):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    _grads(rank, world, torch.device("cuda", rank), torch.float32, 64, "registered")
    dist.destroy_process_group()  # no release first: the pool outlives its communicator
    # ... and the process must still end cleanly (freeing that pool would abort it).


def _registered_edge_cases(rank, world):
    """The pool made while another GPU is current still belongs to the layer's GPU (and
    its moves run in it); a rank without tokens sends no rows (empty tensors beside the
    peer's registered ones)."""
    device = torch.device("cuda", rank)
    dist.all_reduce(torch.ones(1, device=device))  # the communicator, as a layout makes it
    with torch.cuda.device(world - 1 - rank):
        registered_pool(None, device)
    tokens = 300 if rank == 0 else 0
    with _moves_in_registered_pool(device):
        got = _grads(rank, world, device, torch.float32, tokens, "registered")
    segments = registered_pool(None, device).snapshot()
    assert segments and all(g["device"] == rank for g in segments), segments
    want = _grads(rank, world, device, torch.float32, tokens, "collective")
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_registered_buffers_with_an_empty_rank_and_another_current_gpu():
    run_distributed(_registered_edge_cases, 2, backend="nccl")


def test_a_registered_pool_left_at_exit_does_not_abort_the_process(tmp_path):
    mp.spawn(_exit_after_destroy, args=(2, str(tmp_path / "init")), nprocs=2)
