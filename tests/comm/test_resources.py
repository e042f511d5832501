"""The owner of the exchanges' resources: one ``CommResources`` per (process group,
device), each resource made at first use, everything freed by one call (and at exit), and
exchanges that look their resources up at every move, so a release never leaves one
holding a freed buffer."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from moe_fn.comm import resources as res
from moe_fn.comm.resources import CommResources, ResourceRegistry

CPU = torch.device("cpu")


class Group:
    """A stand-in process group: only its identity matters to the registry."""


def test_one_owner_per_group_and_device_made_at_first_use():
    reg = ResourceRegistry()
    g, other = Group(), Group()
    a = reg.get(g, CPU)
    assert reg.get(g, CPU) is a and reg.get(g, "cpu") is a
    assert reg.get(other, CPU) is not a
    assert reg.get(g, torch.device("meta")) is not a
    assert reg.get(None, CPU) is not a  # the local exchange's (no group)
    assert len(reg.owners()) == 4


def test_a_new_group_at_a_reused_address_gets_its_own_owner(monkeypatch):
    """Keyed by the group object held, not its id alone: a group created after another
    was destroyed may reuse its address."""
    monkeypatch.setattr(res, "id", lambda o: 1, raising=False)  # every group at one address
    reg = ResourceRegistry()
    g, h = Group(), Group()
    old = reg.get(g, CPU)
    new = reg.get(h, CPU)
    assert new is not old and new.group is h


def test_release_frees_every_group_or_one():
    reg = ResourceRegistry()
    g, other = Group(), Group()
    a, b = reg.get(g, CPU), reg.get(other, CPU)
    reg.release(g)
    assert reg.get(other, CPU) is b and reg.get(g, CPU) is not a
    reg.release()
    assert reg.owners() == [] and reg.get(other, CPU) is not b


def test_sentinel_is_a_contiguous_nan_view_grown_and_refilled():
    owner = CommResources(None, CPU)
    a = owner.nan_sentinel(6, 4, torch.float32)
    assert a.shape == (6, 4) and a.is_contiguous() and torch.isnan(a).all()
    b = owner.nan_sentinel(3, 4, torch.float32)  # fewer tokens: the same buffer's rows
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    c = owner.nan_sentinel(9, 4, torch.float32)  # more: a larger buffer
    assert c.shape == (9, 4) and c.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    assert owner.nan_sentinel(2, 4, torch.bfloat16).dtype == torch.bfloat16  # its own
    with torch.no_grad():
        c.zero_()  # written anyway: refilled before its next use
    assert torch.isnan(owner.nan_sentinel(9, 4, torch.float32)).all()
    owner.release()
    assert owner.nan_sentinel(9, 4, torch.float32).untyped_storage().data_ptr() != \
        c.untyped_storage().data_ptr()


def test_one_stream_per_purpose_on_the_owners_device(monkeypatch):
    """A layer moved to another GPU orders its side work on a stream of that GPU: streams
    belong to the (group, device) owner (CUDA streams stood in by their device)."""
    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: made.append(device) or device)
    reg, g = ResourceRegistry(), Group()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
    s0 = reg.get(g, d0).stream("side")
    assert reg.get(g, d0).stream("side") is s0 and reg.get(g, "cuda").stream("side") is s0
    assert reg.get(g, d1).stream("side") == d1 and s0 == d0
    reg.get(g, d0).stream("pulls")  # another purpose: another stream
    assert made == [d0, d1, d0]


def test_peer_memory_is_made_once_per_owner_and_released(monkeypatch):
    made = []
    monkeypatch.setattr(res, "SymmetricPeerMemory",
                        lambda group, device: made.append((group, device)) or object())
    reg, g = ResourceRegistry(), Group()
    cuda = torch.device("cuda", 0)
    first = reg.get(g, cuda).peer_memory()
    assert reg.get(g, cuda).peer_memory() is first and made == [(g, cuda)]
    reg.release()
    assert reg.get(g, cuda).peer_memory() is not first and len(made) == 2
    monkeypatch.setattr(res, "GatheredPeerMemory", lambda group: ("gathered", group))
    assert reg.get(g, CPU).peer_memory() == ("gathered", g)  # the CPU stand-in


class FakeBuffer:
    """DeepEP's Buffer as the owner uses it: made with explicitly_destroy, destroyed once."""

    def __init__(self, group, num_nvl_bytes, num_rdma_bytes, explicitly_destroy):
        assert num_rdma_bytes == 0 and explicitly_destroy
        self.num_nvl_bytes, self.destroyed = num_nvl_bytes, 0

    def destroy(self):
        self.destroyed += 1


def test_deepep_buffer_grows_keeps_the_old_until_release_and_destroys_each_once():
    deep_ep = type("deep_ep", (), {"Buffer": FakeBuffer})
    owner = CommResources(Group(), CPU)
    small = owner.deepep_buffer(deep_ep, 128)
    assert owner.deepep_buffer(deep_ep, 64) is small  # large enough: shared
    big = owner.deepep_buffer(deep_ep, 256)
    assert big is not small and big.num_nvl_bytes == 256 and small.destroyed == 0
    owner.release()
    assert (small.destroyed, big.destroyed) == (1, 1)
    owner.release()  # nothing left to free
    assert (small.destroyed, big.destroyed) == (1, 1)
    assert owner.deepep_buffer(deep_ep, 64) is not big  # made again after a release


def test_a_registry_is_shared_by_copies_and_found_again_when_unpickled():
    import copy
    import pickle

    import moe_fn.resources as top

    reg = ResourceRegistry()
    assert copy.deepcopy(reg) is reg and copy.copy(reg) is reg
    assert pickle.loads(pickle.dumps(top.RESOURCES)) is top.RESOURCES
    fresh = pickle.loads(pickle.dumps(reg))  # no home: a new, empty registry
    assert isinstance(fresh, ResourceRegistry) and fresh is not reg and fresh.owners() == []


def test_the_exit_hook_is_registered_once_and_never_raises(monkeypatch, capsys):
    hooks = []
    monkeypatch.setattr(res.atexit, "register", hooks.append)
    reg = ResourceRegistry()
    reg.get(Group(), CPU)
    reg.get(Group(), CPU)
    assert len(hooks) == 1

    class Failing(FakeBuffer):
        def destroy(self):
            raise RuntimeError("peer gone")
    reg.get(Group(), CPU).deepep_buffer(type("m", (), {"Buffer": Failing}), 128)
    hooks[0]()
    assert "freeing the exchanges' resources at exit failed" in capsys.readouterr().err
    assert reg.owners() == []


def test_a_symm_mem_exchange_looks_its_buffer_up_every_move(monkeypatch):
    """After a release nothing keeps the old buffer alive and the next move gets a new
    one, for an exchange built before the release."""
    from moe_fn.comm.symm_mem import SymmMemExchange

    monkeypatch.setattr(res, "SymmetricPeerMemory", lambda group, device: object())
    ex = SymmMemExchange.__new__(SymmMemExchange)
    ex.group, ex.resources = Group(), ResourceRegistry()
    cuda = torch.device("cuda", 0)
    first = ex._mem(cuda)
    assert ex._mem(cuda) is first  # one buffer per group and device, shared
    ex.resources.release()
    assert ex._mem(cuda) is not first


def test_leaving_without_gloo_releases_the_resources(monkeypatch):
    """Outside gloo (NCCL, or no group at all) a finished rank frees the exchanges'
    resources before the group goes, and returns."""
    import moe_fn.resources as top

    released = []
    monkeypatch.setattr(top.RESOURCES, "release", lambda group=None: released.append(group))
    assert not torch.distributed.is_initialized()
    top.leave_after_last_collective()
    assert released == [None]


def test_a_process_holding_resources_exits_cleanly_without_a_release():
    """No release call: the exit hook frees what the exchanges hold (here the skip's
    sentinel) and the interpreter ends with status 0."""
    script = textwrap.dedent("""
        import torch, moe_fn
        from moe_fn.resources import RESOURCES
        cfg = moe_fn.MoEConfig(hidden_size=8, intermediate_size=4, num_experts=4, top_k=2,
                               skip_recompute_combine=True)
        layer = moe_fn.MoELayer(cfg)
        x = torch.randn(5, 8, requires_grad=True)
        moe_fn.checkpoint(lambda h: h + layer(h), x).sum().backward()
        assert RESOURCES.owners(), "the skip's sentinel was made"
        print("done", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stdout + proc.stderr
