"""``SymmetricPeerMemory`` on the CPU, over a stand-in for torch's symmetric memory whose
"peer" is another tensor of this process: halves alternate, one barrier per exposure,
rows (or ``rows[index]``) and values land where the pulls read them, caches stay bounded,
and growth re-maps the buffer."""

from __future__ import annotations

import os

import pytest
import torch

from moe_fn.comm import peer_memory as pm
from moe_fn.comm.peer_memory import pull_rows
from moe_fn.kernels.peer import launch_pull_rows

# The stand-in's buffers are CPU tensors: the Triton kernels read them only in the
# interpreter (machines without a GPU); elsewhere the plain pulls do.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


class _Handle:
    def __init__(self, bufs):
        self.bufs = bufs
        self.buffer_ptrs = [b.data_ptr() for b in bufs]
        self.barriers = 0

    def get_buffer(self, rank, shape, dtype, offset):
        return self.bufs[rank].view(dtype)[offset:offset + shape[0]].view(shape)

    def barrier(self, channel=0):
        self.barriers += 1


class _Symm:
    def __init__(self):
        self.allocations = []

    def empty(self, n, dtype, device):
        self.bufs = [torch.zeros(n, dtype=dtype) for _ in range(2)]
        self.allocations.append(n)
        return self.bufs[0]

    def rendezvous(self, buf, group):
        self.handle = _Handle(self.bufs)
        return self.handle


@pytest.fixture
def memory(monkeypatch):
    monkeypatch.setattr(pm, "_GROW", 1 << 12)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    m = pm.SymmetricPeerMemory.__new__(pm.SymmetricPeerMemory)
    m._symm, m.group, m.device, m.rank, m.size = _Symm(), None, torch.device("cpu"), 0, 2
    m._buf = m._hdl = None
    m._half, m._flip, m._flat, m._offsets, m._bytes = 0, 0, {}, {}, ()
    m._views = {}
    return m


def test_exposures_alternate_halves_with_one_barrier_each(memory):
    g = torch.Generator().manual_seed(0)
    starts = []
    for step in range(6):
        n = 3 + step
        rows = torch.randn(n, 8, generator=g)
        vals = torch.randn(n, generator=g)
        if step % 2:  # written in place, or copied
            view = memory.expose_written(lambda r, rows=rows: r[:rows.shape[0]].copy_(rows),
                                         8, torch.float32, 10, vals, 12)
        else:
            view = memory.expose(rows, vals, 10, 12)
        assert memory._hdl.barriers == step + 1
        starts.append(view.rows[0].data_ptr())
        published = rows
        assert torch.equal(view.rows[0][:published.shape[0]], published)
        assert torch.equal(view.values[0][:n], vals)
        # The peer's tensors are its buffer at the same place; the offsets say so.
        assert view.rows[1].data_ptr() - view.rows[0].data_ptr() == view.byte_offsets[1]
        assert int(view.rows_offsets[1]) * 4 == view.byte_offsets[1]
        view.rows[1][:4] = 7.0  # what the "peer" published
        src_rank, src_idx = torch.tensor([1, 0], dtype=torch.int32), torch.tensor([2, 1])
        if INTERPRET:  # the kernel, with the offsets the view carries
            out, vout = launch_pull_rows(view.rows, view.values, 0, src_rank, src_idx,
                                         num_programs=1, rows_offsets=view.rows_offsets,
                                         values_offsets=view.values_offsets,
                                         byte_offsets=view.byte_offsets)
        else:
            out, vout = pull_rows(view, src_rank, src_idx)
        assert torch.equal(out[0], torch.full((8,), 7.0)) and torch.equal(out[1], published[1])
        assert vout[1] == vals[1]
    assert len(set(starts)) == 2 and starts[0] != starts[1] and starts[0] == starts[2]
    assert len(memory._flat) <= 4 and memory._symm.allocations == [2 * (1 << 12)]
    # Nothing to publish (no rank has tokens): empty regions, still one barrier.
    view = memory.expose(torch.zeros(0, 8), torch.zeros(0), 0, 0)
    assert view.rows[0].shape == (0, 8) and view.values[0].shape == (0,)
    assert memory._hdl.barriers == 7


def test_growth_remaps_the_buffer(memory):
    memory.expose(torch.ones(4, 8), None, 4, 0)
    first = memory._hdl
    view = memory.expose(torch.full((300, 8), 2.0), None, 300, 0)
    assert memory._hdl is not first and first.barriers == 2  # drained, then freed
    assert len(memory._symm.allocations) == 2 and memory._half >= 300 * 8 * 4
    assert torch.equal(view.rows[0], torch.full((300, 8), 2.0))


def test_region_views_are_reused_bounded_and_dropped_on_growth(memory):
    """A move of one shape reuses its half's views (host time before the transfer); the
    cache stays bounded, and growth drops views of the freed buffer."""
    a = memory.expose(torch.ones(3, 8), None, 4, 0)
    b = memory.expose(torch.ones(3, 8), None, 4, 0)
    c = memory.expose(torch.full((2, 8), 3.0), None, 4, 0)
    assert c.rows[0] is a.rows[0] and b.rows[0] is not a.rows[0]  # same half, same view
    assert torch.equal(c.rows[0][:2], torch.full((2, 8), 3.0))
    # Another dtype, width or height in the same half: views of their own.
    for rows, max_rows in ((torch.ones(3, 8, dtype=torch.float64), 4), (torch.ones(3, 4), 4),
                           (torch.ones(3, 8), 5)):
        memory.expose(torch.ones(1, 8), None, 4, 0)  # back to the first half
        v = memory.expose(rows, None, max_rows, 0)
        assert v.rows[0].dtype == rows.dtype and v.rows[0].shape == (max_rows, rows.shape[1])
        assert torch.equal(v.rows[0][:3], rows)
    for n in range(1, 100):  # many shapes: the cache never holds more than 64
        memory.expose(torch.ones(1, 8), None, n % 40 + 1, 0)
        assert len(memory._views) <= 64
    big = memory.expose(torch.full((300, 8), 2.0), None, 300, 0)
    assert len(memory._views) == 1 and torch.equal(big.rows[0], torch.full((300, 8), 2.0))
    again = memory.expose(torch.ones(3, 8), None, 4, 0)  # a shape seen before growth
    new_buf = memory._symm.bufs[0]
    start = again.rows[0].data_ptr() - new_buf.data_ptr()
    assert 0 <= start < new_buf.numel()  # a view of the new buffer, not the freed one


def test_written_exposures_fill_their_region_in_place(memory):
    seen = []

    def write(region):
        seen.append(region)
        region[:3] = 5.0
    vals = torch.arange(4.0)
    view = memory.expose_written(write, 8, torch.float32, 6, vals, 4)
    assert memory._hdl.barriers == 1
    # The writer got this rank's region of the buffer itself (no copy afterwards).
    assert seen[0].data_ptr() == view.rows[0].data_ptr() and seen[0].shape == (6, 8)
    assert torch.equal(view.rows[0][:3], torch.full((3, 8), 5.0))
    assert torch.equal(view.values[0], vals)
    assert view.rows[1].data_ptr() - view.rows[0].data_ptr() == view.byte_offsets[1]
    # The next exposure, written or copied, goes to the other half.
    nxt = memory.expose(torch.ones(2, 8), None, 2, 0)
    assert nxt.rows[0].data_ptr() != view.rows[0].data_ptr() and memory._hdl.barriers == 2
