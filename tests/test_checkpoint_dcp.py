"""Distributed checkpoints (torch.distributed.checkpoint) of expert-parallel layers and their
AdamW states: saved sharded (each expert tensor one chunk per EP rank, no rank writes
another's experts), loaded into the same layout (identical: the same outputs and the same
training after the load, bit for bit), into EP4 and into one process, and from FSDP2's
DP2 x EP2 into one process (the parameters and AdamW states loaded exactly; the outputs and
the training continued after the load by the tolerance rule: against a float64 oracle,
naive code with torch's AdamW started from the saved state, at most twice the error of the
original layout continuing in float32, plus one rounding step), on both the process-group
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
from moe_fn.testing import assert_jointly_close_to_ref
from moe_fn.testing.reference import MoEParams, reference_moe
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.multiproc

H, I, E, TOKENS = 16, 8, 8, 24
TRAIN, MORE = 3, 2
KINDS = ("group", "mesh")
LR, DECAY = 1e-2, 0.1
PARAMS = ("router.weight", "experts.gate_up_proj", "experts.down_proj")


def config(ep: int, **kw) -> MoEConfig:
    base = dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2,
                comm_backend="all_to_all" if ep > 1 else "local", ep_size=ep)
    base.update(kw)
    return MoEConfig(**base)


def build(kind: str, world: int, **kw) -> MoELayer:
    """An EP``world`` layer in float32 on the world group or on a 1-D mesh."""
    cfg = config(world, **kw)
    if world == 1:
        return MoELayer(cfg)
    arg = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))["ep"] \
        if kind == "mesh" else None
    return MoELayer(cfg, arg)


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def set_from_full(layer: MoELayer, rank: int) -> None:
    """Every rank's slice of the same seeded full parameters."""
    full = MoELayer(config(1))
    g = torch.Generator().manual_seed(0)
    n = layer.config.num_local_experts
    with torch.no_grad():
        for name, p in layer.named_parameters():
            src = full.get_parameter(name)
            src.copy_(torch.randn(src.shape, generator=g) * 0.5)
            local(p).copy_(src[rank * n:(rank + 1) * n] if name.startswith("experts.")
                           else src)


def batch(step: int, rank: int, world: int):
    """This rank's share of step ``step``'s global batch (the same for every layout)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(TOKENS, H, generator=g)
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
        return t.clone()  # a snapshot, not the live parameter
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
    return torch.optim.AdamW(layer.parameters(), lr=LR, weight_decay=DECAY)


def fresh(kind, rank, world, seed=7):
    """A layer and optimizer unlike the saved ones (other weights, one step of state)."""
    torch.manual_seed(seed + rank)
    layer = build(kind, world)
    opt = new_opt(layer)
    train(layer, opt, [50], rank, world)
    return layer, opt


def assert_same(got: dict, want: dict, what: str, keys=None) -> None:
    """The same computation, or a load of the same data: bit for bit."""
    for k in (want if keys is None else keys):
        g, w = got[k], want[k]
        assert torch.equal(g, w), f"{what}: {k} differs by {(g - w).abs().max().item()}"


class Oracle:
    """One process in float64 naive code (``reference_moe``, all experts) with torch's AdamW,
    started from a snapshot's parameters and AdamW states after ``TRAIN`` steps."""

    def __init__(self, snap: dict):
        self.params = {n: snap[n].double().clone().requires_grad_() for n in PARAMS}
        self.opt = torch.optim.AdamW(list(self.params.values()), lr=LR, weight_decay=DECAY)
        for n, p in self.params.items():
            self.opt.state[p] = {"step": torch.tensor(float(TRAIN)),
                                 "exp_avg": snap[f"{n}.exp_avg"].double().clone(),
                                 "exp_avg_sq": snap[f"{n}.exp_avg_sq"].double().clone()}

    def __call__(self, x):
        p = self.params
        moe = MoEParams(p["router.weight"], p["experts.gate_up_proj"], p["experts.down_proj"])
        return reference_moe(x.double(), moe, config(1)).out

    def snapshot(self) -> dict:
        with torch.no_grad():
            snap = {"out": self(batch(99, 0, 1)[0])}
        for n, p in self.params.items():
            snap[n] = p.detach().clone()
            for k in ("exp_avg", "exp_avg_sq"):
                snap[f"{n}.{k}"] = self.opt.state[p][k].clone()
        return snap

    def train(self, steps) -> dict:
        """The global batch of each step, its mean square error; the snapshot after."""
        for step in steps:
            x, t = batch(step, 0, 1)
            loss = ((self(x) - t.double()) ** 2).mean()
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
        return self.snapshot()


def assert_continues(got_load, got_after, ref: dict, what: str) -> None:
    """A load into another layout: the state exactly as saved; the outputs, and the
    parameters and AdamW states after ``MORE`` steps, by the tolerance rule (plain: the
    saving layout's own float32 results, float64: the oracle from the saved state)."""
    assert_same(got_load, ref["at_save"], f"{what} load",
                [k for k in ref["at_save"] if k != "out"])
    oracle = Oracle(ref["at_save"])
    at_load = oracle.snapshot()
    after = oracle.train(range(TRAIN, TRAIN + MORE))
    keys = sorted(after)
    assert_jointly_close_to_ref(
        [got_load["out"], *(got_after[k] for k in keys)],
        [ref["at_save"]["out"], *(ref["after"][k] for k in keys)],
        [at_load["out"], *(after[k] for k in keys)],
        [f"{what} out", *(f"{what} continued {k}" for k in keys)])


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
        assert_same(snapshot(layer2, opt2, rank, world), at_save, f"EP2 {kind} reload")
        train(layer2, opt2, range(TRAIN, TRAIN + MORE), rank, world)
        assert_same(snapshot(layer2, opt2, rank, world), after, f"EP2 {kind} continued")

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
    assert_same(snapshot(layer3, opt3, rank, world), want, "group -> mesh")

    # Another config: refused on every rank before any collective, naming the field.
    for kw, field in ((dict(num_experts=4), "num_experts"), (dict(hidden_size=8),
                                                             "hidden_size")):
        torch.manual_seed(rank)
        cfg = config(world, **kw)
        other = MoELayer(cfg)
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
        at_load = snapshot(layer, opt, rank, world)
        if world > 1:  # for the one-process load below
            moe_dcp.save(os.path.join(root, f"{kind}_ep{world}"), layer, opt)
            check_sharded(os.path.join(root, f"{kind}_ep{world}"), layer, world)
        train(layer, opt, range(TRAIN, TRAIN + MORE), rank, world)
        after = snapshot(layer, opt, rank, world)
        if rank == 0:
            assert_continues(at_load, after, ref, f"EP2 -> EP{world} {kind}")
        if world == 1:
            layer, opt = fresh(kind, rank, world)
            moe_dcp.load(os.path.join(root, f"{kind}_ep4"), layer, opt)
            at_load = snapshot(layer, opt, rank, world)
            train(layer, opt, range(TRAIN, TRAIN + MORE), rank, world)
            assert_continues(at_load, snapshot(layer, opt, rank, world), ref,
                             f"EP2 -> EP4 -> one process {kind}")


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
    layer = MoELayer(config(2), mesh["ep"])
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
    at_load = snapshot(layer, opt, rank, world)
    train(layer, opt, range(TRAIN, TRAIN + MORE), rank, world)
    assert_continues(at_load, snapshot(layer, opt, rank, world), ref,
                     "FSDP2 DP2xEP2 -> one process")


def test_fsdp2_dp2_ep2_checkpoint_into_one_process(tmp_path):
    pytest.importorskip("moe_fn.parallel")
    root = str(tmp_path)
    run_distributed(_fsdp_save, 4, root)
    run_distributed(_fsdp_load_one, 1, root)
