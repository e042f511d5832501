"""FSDP2 over expert-parallel layers (moe_fn.parallel) over gloo: DP x EP layouts training a
model around a MoELayer against one process training the whole model on every rank's
batch (float64 oracle: naive code, moe_fn.testing.reference_moe); per-rank memory of the
experts and their Adam states; the score-correction bias after a load step; the global
gradient norm. One launch per layout does every check."""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.distributed as dist
from torch import nn

from moe_fn import MoEConfig, MoELayer
from moe_fn.balance import expert_load, update_expert_bias
from moe_fn.parallel import clip_grad_norm_, fully_shard_moe
from moe_fn.placement import local
from moe_fn.testing import assert_jointly_close_to_ref
from moe_fn.testing.reference import MoEParams, random_params, reference_moe
from tests.dist_utils import run_distributed

H, I, E, K, T, STEPS, LR, MAX_NORM = 16, 8, 8, 2, 6, 2, 1e-2, 1e-3
CFG = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K,
                score_func="sigmoid", score_correction_bias=True)
EXPERTS = ("gate_up_proj", "down_proj")


def _dense(seed):
    g = torch.Generator().manual_seed(seed)
    return {"inp": 0.3 * torch.randn(H, H, generator=g, dtype=torch.float64),
            "out": 0.3 * torch.randn(H, H, generator=g, dtype=torch.float64)}


class Net(nn.Module):
    """A linear, a residual MoE layer, a linear; the loss is the mean square."""

    def __init__(self, moe):
        super().__init__()
        self.inp = nn.Linear(H, H, bias=False)
        self.moe = moe
        self.out = nn.Linear(H, H, bias=False)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + self.moe(h)).square().mean()


class RefNet(nn.Module):
    """The same model in naive code, all experts on one process."""

    def __init__(self, params: MoEParams, dense, dtype):
        super().__init__()
        self.inp = nn.Parameter(dense["inp"].to(dtype))
        self.out = nn.Parameter(dense["out"].to(dtype))
        self.router_weight = nn.Parameter(params.router_weight.to(dtype))
        self.gate_up_proj = nn.Parameter(params.gate_up_proj.to(dtype))
        self.down_proj = nn.Parameter(params.down_proj.to(dtype))
        self.register_buffer("bias", params.score_correction_bias.to(torch.float32))

    def forward(self, x):
        h = x @ self.inp.t()
        p = MoEParams(self.router_weight, self.gate_up_proj, self.down_proj,
                      score_correction_bias=self.bias.to(h.dtype))
        return ((h + reference_moe(h, p, CFG).out) @ self.out.t()).square().mean()

    def named_grads(self):
        return {"inp.weight": self.inp, "out.weight": self.out,
                "moe.router.weight": self.router_weight,
                "moe.experts.gate_up_proj": self.gate_up_proj,
                "moe.experts.down_proj": self.down_proj}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _layout_body(rank, world, dp_mod_ep, ep):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    if dp_mod_ep == 1:
        mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
        ep_mesh = mesh
    else:
        mesh = init_device_mesh("cpu", (dp_mod_ep, ep),
                                mesh_dim_names=("dp_shard_mod_ep", "ep"))
        ep_mesh = mesh["ep"]
    params = random_params(CFG, generator=torch.Generator().manual_seed(0))
    dense = _dense(1)
    xs = torch.randn(world, T, H, generator=torch.Generator().manual_seed(2),
                     dtype=torch.float64)

    net = Net(MoELayer(attrs.evolve(CFG, ep_size=ep, comm_backend="all_to_all"), ep_mesh))
    r = net.moe.ep_rank
    n = E // ep
    with torch.no_grad():
        net.inp.weight.copy_(dense["inp"])
        net.out.weight.copy_(dense["out"])
        net.moe.router.weight.copy_(params.router_weight)
        net.moe.router.e_score_correction_bias.copy_(params.score_correction_bias)
        for name in EXPERTS:
            local(getattr(net.moe.experts, name)).copy_(getattr(params, name)[r * n:(r + 1) * n])
    assert isinstance(net.moe.experts.gate_up_proj, torch.distributed.tensor.DTensor)
    # EP == DP: the MoE layer as a dense unit of its own (its experts left out of it).
    fully_shard_moe(net, mesh, dense_modules=[net.moe] if dp_mod_ep == 1 else ())
    assert isinstance(net.moe, FSDPModule) == (dp_mod_ep == 1)
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    refs = {dt: RefNet(params, dense, dt) for dt in (torch.float32, torch.float64)}
    ref_opts = {dt: torch.optim.Adam(m.parameters(), lr=LR) for dt, m in refs.items()}

    got, plain, ref64, names = [], [], [], []

    def add(what, g, p, r64):
        got.append(g.detach())
        plain.append(p.detach())
        ref64.append(r64.detach())
        names.append(f"dp{world} ep{ep} {what}")

    for step in range(STEPS):
        loss = net(xs[rank].float())
        loss.backward()
        mine = {pname: _full(p.grad).clone() for pname, p in net.named_parameters()}
        norm = clip_grad_norm_(net.parameters(), MAX_NORM)
        ref_out = {}
        for dt, m in refs.items():
            ref_out[dt] = m(xs.reshape(-1, H).to(dt))
            ref_out[dt].backward()
        grads = {dt: {k: p.grad.clone() for k, p in m.named_grads().items()}
                 for dt, m in refs.items()}
        ref_norm = {dt: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)
                    for dt, m in refs.items()}
        assert ref_norm[torch.float64] > MAX_NORM  # the clip acts
        # The step's loss: the mean over ranks of each one's mean is the whole batch's.
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        add(f"step{step} loss", mean_loss / world, ref_out[torch.float32],
            ref_out[torch.float64])
        add(f"step{step} grad norm", norm, ref_norm[torch.float32], ref_norm[torch.float64])
        for pname, g in mine.items():  # the gradients before the clip
            add(f"step{step} grad {pname}", g, grads[torch.float32][pname],
                grads[torch.float64][pname])
        opt.step()
        opt.zero_grad()
        for o in ref_opts.values():
            o.step()
            o.zero_grad()
    for pname, p in net.named_parameters():
        want = {dt: m.named_grads()[pname] for dt, m in refs.items()}
        add(f"param {pname}", _full(p), want[torch.float32], want[torch.float64])
    assert_jointly_close_to_ref(got, plain, ref64, names)

    # Memory: each rank holds 1/DP of every expert tensor and of its Adam states; the
    # experts replicated over the replicas (EP alone) would hold 1/EP.
    for name in EXPERTS:
        p = getattr(net.moe.experts, name)
        full = getattr(params, name).numel()
        assert p.to_local().numel() == full // world, (name, p.to_local().shape)
        for state in ("exp_avg", "exp_avg_sq"):
            assert opt.state[p][state].to_local().numel() == full // world

    # Load balancing: the counts of every rank's tokens, the same bias on every rank.
    update_expert_bias(net, 1e-3)
    load = expert_load(net)["moe"].last
    assert int(load.sum()) == STEPS * world * T * K
    bias = net.moe.router.e_score_correction_bias
    every = [torch.empty_like(bias) for _ in range(world)]
    dist.all_gather(every, bias)
    assert all(torch.equal(b, bias) for b in every)
    assert not torch.equal(bias, params.score_correction_bias.float())


@pytest.mark.multiproc
@pytest.mark.parametrize("dp_mod_ep, ep", [(2, 2), (1, 4), (2, 4), (4, 2)])
def test_fully_shard_moe_trains_as_one_process(dp_mod_ep, ep):
    run_distributed(_layout_body, dp_mod_ep * ep, dp_mod_ep, ep)


def _misuse_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard_mod_ep", "ep"))
    cfg = attrs.evolve(CFG, ep_size=2, comm_backend="all_to_all")
    # A mesh whose size does not divide num_experts.
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    with pytest.raises(ValueError, match="do not divide num_experts=6"):
        MoELayer(attrs.evolve(cfg, num_experts=6), flat)
    # Experts left in the unit of an enclosing module: refused, not averaged as replicas.
    # Plain slices (a layer on a process group): refused naming the recipe.
    dp = mesh._flatten("dp")
    with pytest.raises(ValueError, match="fully_shard_moe"):
        fully_shard(Net(MoELayer(cfg, mesh["ep"].get_group())), mesh=dp)
    # DTensors over the EP mesh under torch's own fully_shard of the whole model: FSDP2
    # refuses the overlapping meshes while it builds its shards, before any module hook.
    with pytest.raises(RuntimeError, match="overlapping meshes"):
        fully_shard(Net(MoELayer(cfg, mesh["ep"])), mesh=dp)
    # Through fully_shard_moe: expert DTensors whose layer it is not given (the experts
    # module alone) would land in the dense unit over the data-parallel mesh: named.
    with pytest.raises(ValueError, match=r"moe\.gate_up_proj.*dense FSDP unit.*"
                                         r"overlapping.*'dp_shard_mod_ep'.*fully_shard_moe"):
        fully_shard_moe(nn.ModuleDict({"moe": MoELayer(cfg, mesh["ep"]).experts}), mesh)
    # Dense units: only the model's own modules, never a layer's experts module.
    net = Net(MoELayer(cfg, mesh["ep"]))
    with pytest.raises(ValueError, match="not a submodule of the model"):
        fully_shard_moe(net, mesh, dense_modules=[nn.Linear(H, H)])
    with pytest.raises(ValueError, match=r"dense_modules\[0\] \(moe.experts\) holds the "
                                         "experts.*unit of their own"):
        fully_shard_moe(net, mesh, dense_modules=[net.moe.experts])
    # A layer on a process group, or on a mesh that is not the FSDP mesh's "ep" dimension.
    with pytest.raises(ValueError, match="process group"):
        fully_shard_moe(Net(MoELayer(cfg, mesh["ep"].get_group())), mesh)
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard_mod_ep", "ep"))
    transposed = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "dp_shard_mod_ep"))
    with pytest.raises(ValueError, match="not the FSDP mesh's expert dimension"):
        fully_shard_moe(Net(MoELayer(cfg, transposed["ep"])), other)


@pytest.mark.multiproc
def test_fully_shard_moe_refuses_misuse_on_every_rank():
    run_distributed(_misuse_body, 4)
