"""Converted Hugging Face models under moe_fn.parallel.fully_shard_moe (FSDP2 over gloo):
Qwen3-MoE and DeepSeek-V3, their MoE blocks on mesh["ep"], train for several steps (SGD,
the global-norm clip) as one process training the unconverted model on every rank's batch
(the mean of their losses): every step's loss, gradients and clip norm, and the
parameters after the steps, by the tolerance rule against the float64 twin with plain
float32 PyTorch the yardstick; HF's own load-balancing loss included (each rank's batch's,
as the oracle's mean of the batches' losses has it). DP2 x EP2 on 4 processes (also with
decoder layers as units of their own, and FSDP2's MixedPrecisionPolicy: the experts
compute in bfloat16 too; and the refusals), DP4 x EP2 and DP2 x EP4 on 8."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from moe_fn.balance import moe_layers
from moe_fn.hf import convert
from moe_fn.parallel import clip_grad_norm_, experts_holder, fully_shard_moe
from tests.dist_utils import run_distributed
from tests.hf.models import Parity, batch, float64_twin, keep_float64, make_model

pytestmark = pytest.mark.multiproc

STEPS, LR = 3, 0.1


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _loss(model, ids):
    return model(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False).loss


def _mesh(replicas, ep):
    return init_device_mesh("cpu", (replicas, ep), mesh_dim_names=("dp_shard_mod_ep", "ep"))


def _train(name, mesh, per_block=False):
    """``STEPS`` steps of the converted model under fully_shard_moe against the HF model
    (float32, float64) on every rank's batch, run and checked by the first rank, which
    sends the others each step's clip threshold (half the float64 norm: the clip acts)."""
    world = mesh.size()
    dp_rank = mesh._flatten("dp").get_local_rank()
    lead = dp_rank == 0
    ref = make_model(name)
    twin = float64_twin(ref) if lead else None
    model = convert(copy.deepcopy(ref), ep_mesh=mesh["ep"])
    dense = list(model.model.layers) if per_block else ()
    fully_shard_moe(model, mesh, dense_modules=dense)
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (model, ref, twin) if m]
    data = [batch(seed=r)[0] for r in range(world)]
    tag = f"{name} DP{mesh.size(0)}xEP{mesh.size(1)}{' per block' if per_block else ''}"
    parity = Parity(tag)
    for step in range(STEPS):
        max_norm = torch.zeros((), dtype=torch.float64)
        if lead:
            want = sum(_loss(ref, ids) for ids in data) / world
            want.backward()
            with keep_float64():
                want64 = sum(_loss(twin, ids) for ids in data) / world
                want64.backward()
            before = [(p.grad.clone(), p64.grad.clone())
                      for p, p64 in zip(ref.parameters(), twin.parameters())]
            norm64 = torch.nn.utils.get_total_norm([p.grad for p in twin.parameters()])
            max_norm.fill_(0.5 * float(norm64))
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float(max_norm))
            torch.nn.utils.clip_grad_norm_(twin.parameters(), float(max_norm))
        dist.broadcast(max_norm, src=0)

        loss = _loss(model, data[dp_rank])
        loss.backward()
        grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        got_norm = clip_grad_norm_(model.parameters(), float(max_norm))
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if lead:
            parity.add(f"step {step} loss", mean / world, want.detach(), want64.detach())
            parity.add(f"step {step} clip norm", got_norm, norm, norm64)
            for (n, _), (g, g64) in zip(ref.named_parameters(), before):
                parity.add(f"step {step} grad {n}", grads[n], g, g64)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    final = {n: _full(p).detach() for n, p in model.named_parameters()}
    if lead:
        for (n, p), p64 in zip(ref.named_parameters(), twin.parameters()):
            parity.add(f"param {n}", final[n], p.detach(), p64.detach())
        parity.check()
    # Each expert tensor is split over every data-parallel rank (1/DP of it here).
    experts = [p for _, layer in moe_layers(model) for p in
               experts_holder(layer).parameters(recurse=False)]
    assert experts and all(p.to_local().numel() * world == p.numel() for p in experts), tag


def _mixed_precision(mesh):
    """MixedPrecisionPolicy(bfloat16 params, float32 reduction) reaches the experts' own
    units: their forward sees bfloat16 weights and inputs and returns bfloat16; one step's
    loss and gradients (float32, reduced in float32) against the HF model in bfloat16
    (plain) and float64 on every rank's batch."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    world = mesh.size()
    dp_rank = mesh._flatten("dp").get_local_rank()
    ref = make_model("qwen3_moe")
    twin = float64_twin(ref)
    plain = copy.deepcopy(ref).bfloat16()
    model = convert(copy.deepcopy(ref), ep_mesh=mesh["ep"])
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard_moe(model, mesh, mp_policy=policy)
    seen = []

    def floats(ts):
        return [t.dtype for t in ts if torch.is_tensor(t) and t.is_floating_point()]

    def before(module, args):  # after FSDP's pre-forward: the unsharded weights
        seen.append([module.gate_up_proj.dtype, module.down_proj.dtype, *floats(args)])

    def after(module, args, out):
        seen[-1] += floats(out if isinstance(out, tuple) else (out,))

    for _, layer in moe_layers(model):
        experts_holder(layer).register_forward_pre_hook(before)
        experts_holder(layer).register_forward_hook(after)
    data = [batch(seed=r)[0] for r in range(world)]
    loss = _loss(model, data[dp_rank])
    loss.backward()
    assert len(seen) == len(moe_layers(model)) and all(
        len(s) >= 4 and set(s) == {torch.bfloat16} for s in seen), seen
    want = sum(_loss(plain, ids) for ids in data) / world
    want.backward()
    with keep_float64():
        want64 = sum(_loss(twin, ids) for ids in data) / world
        want64.backward()
    parity = Parity("qwen3_moe DP2xEP2 bfloat16")
    mean = loss.detach().float()
    dist.all_reduce(mean)
    parity.add("loss", mean / world, want.detach(), want64.detach())  # HF upcasts it
    mine = dict(model.named_parameters())
    for (n, p), p64 in zip(plain.named_parameters(), twin.parameters()):
        got = _full(mine[n].grad)
        assert got.dtype == torch.float32, n  # reduced in float32 into float32 shards
        parity.add(f"grad {n}", got.bfloat16(), p.grad, p64.grad)
    parity.check()


def _refusals(mesh):
    """Each on every rank, before any collective."""
    import transformers
    from torch.distributed.fsdp import fully_shard

    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      head_dim=8, intermediate_size=24,
                                      moe_intermediate_size=8, num_experts=3,
                                      num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"ep_size \(2\) must divide num_experts \(3\)"):
        convert(transformers.Qwen3MoeForCausalLM(cfg), ep_mesh=mesh["ep"])
    with pytest.raises(ValueError, match=r"must be 1-D.*mesh\['ep'\]"):
        convert(make_model("qwen3_moe"), ep_mesh=mesh)
    # A block's experts module given alone: its DTensors would land in the dense unit.
    model = convert(make_model("qwen3_moe"), ep_mesh=mesh["ep"])
    with pytest.raises(ValueError, match=r"gate_up_proj: a DTensor parameter.*dense FSDP "
                                         r"unit.*'dp_shard_mod_ep'"):
        fully_shard_moe(model.model.layers[0].mlp.experts, mesh)
    # torch's fully_shard of the whole model: over the replicas alone, moe_fn's error;
    # over the data-parallel mesh, FSDP2's own, before any moe_fn code runs.
    with pytest.raises(ValueError, match="enclosing module.*fully_shard_moe"):
        fully_shard(convert(make_model("qwen3_moe"), ep_mesh=mesh["ep"]),
                    mesh=mesh["dp_shard_mod_ep"])
    with pytest.raises(RuntimeError, match="overlapping meshes"):
        fully_shard(convert(make_model("qwen3_moe"), ep_mesh=mesh["ep"]),
                    mesh=mesh._flatten("dp"))


def _four(rank, world):
    mesh = _mesh(2, 2)
    _refusals(mesh)
    _train("qwen3_moe", mesh)
    _train("deepseek_v3", mesh, per_block=True)
    _mixed_precision(mesh)
    dist.barrier()


def _eight(rank, world):
    _train("qwen3_moe", _mesh(4, 2))
    _train("deepseek_v3", _mesh(2, 4))
    dist.barrier()


def test_converted_models_train_under_fully_shard_moe_dp2xep2_bfloat16_and_refusals():
    run_distributed(_four, 4)


def test_converted_models_train_under_fully_shard_moe_dp4xep2_and_dp2xep4():
    run_distributed(_eight, 8)
