"""convert(ep_size=2) over gloo against the unconverted model on each rank: one spawn runs
every preset, with and without HF's reentrant gradient checkpointing."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist

from moe_fn.hf import convert, converted_blocks, gather_expert_state_dict
from tests import fake_deep_ep
from tests.dist_utils import run_distributed
from tests.hf.models import AVAILABLE, Parity, batch, float64_twin, make_model, run, run64


def _check_preset(rank, world, name, ckpt, **options):
    ref = make_model(name)  # same seed on every rank: replicated weights
    conv = convert(copy.deepcopy(ref), ep_size=world, **options)
    for m in (ref, conv):
        m.train()
    if ckpt:  # against the unchecked model: its load-balancing loss trains too
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            conv.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": True})
    blocks = converted_blocks(conv)
    assert blocks
    for _, b in blocks:
        assert b.moe_layer.config.comm_backend == options.get("comm_backend", "all_to_all")
        b.moe_layer.exchange.reset_counters()
        assert b.experts.gate_up_proj.shape[0] == b.moe_layer.config.num_experts // world

    ids, labels = batch(seed=rank)  # each rank its own tokens
    ref64 = float64_twin(ref)  # the oracle; HF's float32 model is plain PyTorch
    want = run(ref, ids, labels)
    got = run(conv, ids, labels)
    want64 = run64(ref64, ids, labels)
    tag = f"{name} ep{world} rank{rank}{' ckpt' if ckpt else ''} {options}"
    parity = Parity(tag)
    parity.add_outputs(got, want, want64)
    for _, b in blocks:  # the recompute replayed the route: no second layout exchange
        counters = b.moe_layer.exchange.counters
        recomputed = ckpt and options.get("recompute_in_checkpoint", True)
        assert (counters["layout"], counters["cached_dispatch"]) == (1, int(recomputed)), tag

    # A rank's experts serve every rank's tokens: their gradient is the sum over ranks of
    # the reference's, sliced; every other parameter is replicated and sees local tokens.
    expert_keys = {f"{n}.experts.{p}" for n, _ in blocks
                   for p in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")}
    want_p, want64_p = dict(ref.named_parameters()), dict(ref64.named_parameters())
    for pname, p in conv.named_parameters():
        w, w64 = want_p[pname].grad, want64_p[pname].grad
        if pname in expert_keys:
            w, w64 = w.clone(), w64.clone()
            dist.all_reduce(w)
            dist.all_reduce(w64)
            n = p.shape[0]
            w, w64 = w[rank * n:(rank + 1) * n], w64[rank * n:(rank + 1) * n]
        if w is None:
            assert p.grad is None or not p.grad.any(), f"{tag}: {pname} has a stray gradient"
            continue
        assert p.grad is not None, f"{tag}: {pname} got no gradient"
        parity.add(f"grad {pname}", p.grad, w, w64)
    parity.check()

    full = gather_expert_state_dict(conv)
    sd = ref.state_dict()
    assert list(full) == list(sd)
    for k, v in sd.items():  # the slices gathered: copies, the same bits
        assert torch.equal(full[k], v), f"{tag} gathered {k}"
    fresh = make_model(name, seed=7)
    fresh.load_state_dict(full, strict=True)


def _all_presets(rank, world):
    fake_deep_ep.install()
    torch.manual_seed(0)
    for ckpt in (False, True):
        for name in AVAILABLE:  # the presets whose model this transformers has
            _check_preset(rank, world, name, ckpt)
        # An exchange summing on the expert side (symm_mem's stand-in), with the skip:
        # Qwen3-MoE, GPT-OSS (biases, interleaved) and Llama-4 (routing weights on the
        # experts' inputs), where this transformers has it.
        for name in ("qwen3_moe", "gpt_oss", *(["llama4"] if "llama4" in AVAILABLE else [])):
            _check_preset(rank, world, name, ckpt, comm_backend="symm_mem",
                          skip_recompute_combine=ckpt)
            # The reference weighting and combine (the default fuses them), with the skip.
            _check_preset(rank, world, name, ckpt, impl="reference",
                          skip_recompute_combine=ckpt)
            # DeepEP's exchange (over tests/fake_deep_ep.py's stand-in), with the skip.
            _check_preset(rank, world, name, ckpt, comm_backend="deepep",
                          skip_recompute_combine=ckpt)
            # Not recomputed: the forward's activations serve the checkpoint's backward.
            _check_preset(rank, world, name, ckpt, recompute_in_checkpoint=False,
                          comm_backend="symm_mem" if name == "gpt_oss"
                          else "all_to_all")


def test_expert_parallel_presets_match_hf():
    run_distributed(_all_presets, 2)
