"""Distributed checkpoints (torch.distributed.checkpoint) of expert-parallel layers and their
AdamW states: saved sharded (each expert tensor one chunk per EP rank, no rank writes
another's experts), loaded into the same layout (identical), into EP4 and into one process
(the same outputs, training continues as the original does), on both the process-group
layer and the mesh layer; a checkpoint of another config refused on every rank."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import moe_fn.dcp as moe_dcp
from moe_fn import MoEConfig, MoELayer
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.multiproc

H, I, E, TOKENS = 16, 8, 8, 24
TRAIN, MORE = 3, 2
KINDS = ("group", "mesh")


def config(ep: int, **kw) -> MoEConfig:
    base = dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2,
                comm_backend="all_to_all" if ep > 1 else "local", ep_size=ep)
    base.update(kw)
    return MoEConfig(**base)


def build(kind: str, world: int, **kw) -> MoELayer:
    """An EP``world`` layer in float64 on the world group or on a 1-D mesh."""
    cfg = config(world, **kw)
    if world == 1:
        return MoELayer(cfg, dtype=torch.float64)
    arg = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))["ep"] \
        if kind == "mesh" else None
    return MoELayer(cfg, arg, dtype=torch.float64)


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def set_from_full(layer: MoELayer, rank: int) -> None:
    """Every rank's slice of the same seeded full parameters."""
    full = MoELayer(config(1), dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    n = layer.config.num_local_experts
    with torch.no_grad():
        for name, p in layer.named_parameters():
            src = full.get_parameter(name)
            src.copy_(torch.randn(src.shape, generator=g, dtype=torch.float64) * 0.5)
            local(p).copy_(src[rank * n:(rank + 1) * n] if name.startswith("experts.")
                           else src)


def batch(step: int, rank: int, world: int):
    """This rank's share of step ``step``'s global batch (the same for every layout)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(TOKENS, H, generator=g, dtype=torch.float64)
    target = torch.tanh(x.roll(1, dims=-1) * x)
    n = TOKENS // world
    return x[rank * n:(rank + 1) * n], target[rank * n:(rank + 1) * n]


def train(layer, opt, steps, rank, world) -> None:
    """The loss is the global batch's mean: each expert's gradient already sums every
    rank's tokens (the exchange's backward); the replicated router's is summed here."""
    for step in steps:
        x, t = batch(step, rank, world)
        loss = ((layer(x) - t) ** 2).sum() / (TOKENS * H)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if world > 1:
            for p in layer.router.parameters():
                dist.all_reduce(p.grad)
        opt.step()


def gather_rows(t, world):
    t = local(t).detach().contiguous()
    if world == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    return torch.cat(parts)


def snapshot(layer, opt, rank, world) -> dict:
    """Full outputs on a probe batch, full parameters and full AdamW states."""
    with torch.no_grad():
        out = gather_rows(layer(batch(99, rank, world)[0]), world)
    snap = {"out": out}
    for name, p in layer.named_parameters():
        expert = name.startswith("experts.")
        snap[name] = gather_rows(p, world) if expert else p.detach().clone()
        for k in ("exp_avg", "exp_avg_sq"):
            s = opt.state[p][k]
            snap[f"{name}.{k}"] = gather_rows(s, world) if expert else s.clone()
    return snap


def new_opt(layer):
    return torch.optim.AdamW(layer.parameters(), lr=1e-2, weight_decay=0.1)


def fresh(kind, rank, world, seed=7):
    """A layer and optimizer unlike the saved ones (other weights, one step of state)."""
    torch.manual_seed(seed + rank)
    layer = build(kind, world)
    opt = new_opt(layer)
    train(layer, opt, [50], rank, world)
    return layer, opt


def assert_same(got: dict, want: dict, what: str, exact: bool) -> None:
    for k, w in want.items():
        g = got[k]
        if exact:
            assert torch.equal(g, w), f"{what}: {k} differs by {(g - w).abs().max().item()}"
        else:
            # Another layout sums the same float64 terms in another order (the router's
            # gradient over the ranks, an expert's rows in other groupings): a few units of
            # float64 rounding at each step's magnitude.
            tol = 64 * torch.finfo(torch.float64).eps * max(w.abs().max().item(), 1e-300)
            err = (g - w).abs().max().item()
            assert err <= tol, f"{what}: {k} differs by {err:.3e} > {tol:.3e}"


def check_sharded(path, layer, world) -> None:
    """Each expert tensor and its AdamW states: one chunk per EP rank, together covering
    the whole tensor once, each of one rank's size (no rank wrote another's experts)."""
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    n = E // world
    keys = [k for k in meta if ".experts." in k and k.endswith(("proj", "exp_avg", "exp_avg_sq"))]
    assert len(keys) == 2 * 3, sorted(meta)  # two parameters, each with exp_avg(_sq)
    for k in keys:
        chunks = sorted(meta[k].chunks, key=lambda c: c.offsets[0])
        assert tuple(meta[k].size)[0] == E, (k, meta[k].size)
        assert [c.offsets[0] for c in chunks] == [r * n for r in range(world)], (k, chunks)
        assert all(c.sizes[0] == n and tuple(c.sizes[1:]) == tuple(meta[k].size)[1:]
                   for c in chunks), (k, chunks)


def _save_ep2(rank, world, root):
    for kind in KINDS:
        path = os.path.join(root, kind)
        layer = build(kind, world)
        set_from_full(layer, rank)
        opt = new_opt(layer)
        train(layer, opt, range(TRAIN), rank, world)
        moe_dcp.save(path, layer, opt)
        check_sharded(path, layer, world)
        at_save = snapshot(layer, opt, rank, world)
        train(layer, opt, range(TRAIN, TRAIN + MORE), rank, world)
        after = snapshot(layer, opt, rank, world)
        if rank == 0:
            torch.save({"at_save": at_save, "after": after}, os.path.join(root, f"{kind}.pt"))

        # The same layout: the same computation, so identical outputs and training.
        layer2, opt2 = fresh(kind, rank, world)
        moe_dcp.load(path, layer2, opt2)
        assert_same(snapshot(layer2, opt2, rank, world), at_save, f"EP2 {kind} reload", True)
        train(layer2, opt2, range(TRAIN, TRAIN + MORE), rank, world)
        assert_same(snapshot(layer2, opt2, rank, world), after, f"EP2 {kind} continued", True)

    # The plain model-only recipe: dcp over layer.state_dict(), load_state_dict.
    ref = torch.load(os.path.join(root, "group.pt"))["at_save"]
    layer4, opt4 = fresh("group", rank, world)
    layer5 = build("group", world)
    set_from_full(layer5, rank)
    train(layer5, new_opt(layer5), range(TRAIN), rank, world)
    dcp.save({"model": layer5.state_dict()}, checkpoint_id=os.path.join(root, "plain"))
    sd = {"model": layer4.state_dict()}
    dcp.load(sd, checkpoint_id=os.path.join(root, "plain"))
    layer4.load_state_dict(sd["model"])
    with torch.no_grad():
        out = gather_rows(layer4(batch(99, rank, world)[0]), world)
    assert torch.equal(out, ref["out"]), (out - ref["out"]).abs().max()

    # The process-group layer's checkpoint into the mesh layer: one placement, two forms.
    layer3, opt3 = fresh("mesh", rank, world)
    moe_dcp.load(os.path.join(root, "group"), layer3, opt3)
    want = torch.load(os.path.join(root, "group.pt"))["at_save"]
    assert_same(snapshot(layer3, opt3, rank, world), want, "group -> mesh", True)

    # Another config: refused on every rank before any collective, naming the field.
    for kw, field in ((dict(num_experts=4), "num_experts"), (dict(hidden_size=8),
                                                             "hidden_size")):
        torch.manual_seed(rank)
        cfg = config(world, **kw)
        other = MoELayer(cfg, dtype=torch.float64)
        with pytest.raises(ValueError, match=rf"another model.*{field}.*build the model"):
            moe_dcp.load(os.path.join(root, "group"), other, new_opt(other))
    dist.barrier()  # every rank raised and is still in step

    # A converted HF model on a process group: its expert slices given as DTensors of
    # the full shape (not one replicated tensor); GPT-OSS's transposed views refused.
    if importlib.util.find_spec("transformers") is not None:
        from moe_fn.hf import convert, expert_parameter_names
        from tests.hf.models import make_model

        conv = convert(make_model("qwen3_moe", seed=rank), ep_size=world)
        msd = moe_dcp.get_state_dict(conv)["model"]
        names = expert_parameter_names(conv)
        assert names and all(isinstance(msd[n], DTensor) and msd[n].shape[0] ==
                             world * conv.get_parameter(n).shape[0] for n in names), names
        conv = convert(make_model("gpt_oss", seed=rank), ep_size=world)
        with pytest.raises(ValueError, match="view of another parameter.*DeviceMesh"):
            moe_dcp.get_state_dict(conv)
    dist.barrier()


def _load_elsewhere(rank, world, root):
    for kind in KINDS:
        ref = torch.load(os.path.join(root, f"{kind}.pt"))
        layer, opt = fresh(kind, rank, world)
        moe_dcp.load(os.path.join(root, kind), layer, opt)
        assert_same(snapshot(layer, opt, rank, world), ref["at_save"], f"EP{world} {kind}",
                    world == 1)
        if world > 1:  # for the one-process load below
            moe_dcp.save(os.path.join(root, f"{kind}_ep{world}"), layer, opt)
            check_sharded(os.path.join(root, f"{kind}_ep{world}"), layer, world)
        train(layer, opt, range(TRAIN, TRAIN + MORE), rank, world)
        assert_same(snapshot(layer, opt, rank, world), ref["after"],
                    f"EP{world} {kind} continued", False)
        if world == 1:
            for ep in (4,):
                layer, opt = fresh(kind, rank, world)
                moe_dcp.load(os.path.join(root, f"{kind}_ep{ep}"), layer, opt)
                assert_same(snapshot(layer, opt, rank, world), ref["at_save"],
                            f"EP{ep} {kind} -> one process", False)


def test_dcp_save_reshard_and_continue(tmp_path):
    root = str(tmp_path)
    run_distributed(_save_ep2, 2, root)
    run_distributed(_load_elsewhere, 4, root)
    run_distributed(_load_elsewhere, 1, root)


def full(t):
    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t.clone()


def fsdp_snapshot(layer, opt, rank, world) -> dict:
    with torch.no_grad():
        out = layer(batch(99, rank, world)[0])
    parts = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(parts, out.contiguous())
    snap = {"out": torch.cat(parts)}
    for name, p in layer.named_parameters():
        snap[name] = full(p)
        for k in ("exp_avg", "exp_avg_sq"):
            snap[f"{name}.{k}"] = full(opt.state[p][k])
    return snap


def fsdp_train(layer, opt, steps, rank, world) -> None:
    """FSDP2 averages each rank's mean loss's gradients (the experts' by the whole
    data-parallel size, fully_shard_moe's factor): the global batch's mean."""
    for step in steps:
        x, t = batch(step, rank, world)
        loss = ((layer(x) - t) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def _fsdp_save(rank, world, root):
    from moe_fn.parallel import fully_shard_moe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard_mod_ep", "ep"))
    layer = MoELayer(config(2), mesh["ep"], dtype=torch.float64)
    set_from_full(layer, mesh["ep"].get_local_rank())
    fully_shard_moe(layer, mesh)
    opt = new_opt(layer)
    fsdp_train(layer, opt, range(TRAIN), rank, world)
    path = os.path.join(root, "fsdp")
    moe_dcp.save(path, layer, opt)
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for k in ("model.experts.gate_up_proj", "optim.state.experts.gate_up_proj.exp_avg"):
        # Sharded over all four ranks: the chunks cover the tensor once, none is whole.
        size = torch.Size(meta[k].size)
        assert sum(torch.Size(c.sizes).numel() for c in meta[k].chunks) == size.numel(), k
        assert all(torch.Size(c.sizes).numel() < size.numel() for c in meta[k].chunks), k
    at_save = fsdp_snapshot(layer, opt, rank, world)
    fsdp_train(layer, opt, range(TRAIN, TRAIN + MORE), rank, world)
    after = fsdp_snapshot(layer, opt, rank, world)
    if rank == 0:
        torch.save({"at_save": at_save, "after": after}, os.path.join(root, "fsdp.pt"))


def _fsdp_load_one(rank, world, root):
    ref = torch.load(os.path.join(root, "fsdp.pt"))
    layer, opt = fresh("group", rank, world)
    moe_dcp.load(os.path.join(root, "fsdp"), layer, opt)
    assert_same(snapshot(layer, opt, rank, world), ref["at_save"], "DP2xEP2 -> one", False)
    train(layer, opt, range(TRAIN, TRAIN + MORE), rank, world)
    assert_same(snapshot(layer, opt, rank, world), ref["after"], "DP2xEP2 continued", False)


def test_fsdp2_dp2_ep2_checkpoint_into_one_process(tmp_path):
    pytest.importorskip("moe_fn.parallel")
    root = str(tmp_path)
    run_distributed(_fsdp_save, 4, root)
    run_distributed(_fsdp_load_one, 1, root)
