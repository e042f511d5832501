"""Memory every rank of an expert-parallel group can read, and pulls out of it.

``expose(rows, values)`` publishes one tensor of rows and one of values per rank; the
returned ``PeerView`` lists every rank's published tensors as tensors this process can
read. On CUDA the tensors live in one torch symmetric-memory buffer per (group, device),
mapped into every rank's address space over NVLink, and exposing is a copy and one
device-side barrier. On CPUs (gloo) a stand-in gathers every rank's tensors with
``all_gather``: slower, but the exchange built on it runs the same index logic, so CPU
tests check it.

``expose_written(write, ...)`` instead lets the producer write its rows straight into
its region (the combine's per-token partials). The pulls build their output in final
order in one pass (``moe_fn.kernels.peer`` on CUDA; elsewhere their pure twins,
``peer_gather``/``slot_sum``/``peer_partial_sum`` in ``moe_fn.pure.dispatch``).
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist

from ..kernels._registry import use_triton
from ..pure.dispatch import peer_gather, peer_partial_sum, slot_sum
from .carveout import sm_count

_ALIGN = 256  # bytes between regions: row copies stay 16-byte aligned
_GROW = 64 << 20  # capacities are rounded up to this, so that growth is rare


@attrs.frozen(eq=False)
class PeerView:
    """What ``expose`` published: per rank, its rows ``(max_rows, width)`` (only the
    first rows it exposed are meaningful) and its values ``(max_values,)`` or None.
    In symmetric memory also the peers' offsets from this rank's tensors, in elements
    (``rows_offsets``, ``values_offsets``: int64 tensors on the device) and in bytes
    (``byte_offsets``), the same for every exposure of one buffer."""

    rank: int
    rows: tuple | None
    values: tuple | None
    rows_offsets: torch.Tensor | None = None
    values_offsets: torch.Tensor | None = None
    byte_offsets: tuple | None = None


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


class SymmetricPeerMemory:
    """One symmetric-memory buffer for a group on one device (see the module docstring).

    Every rank must call ``expose`` in the same order with the same ``max_rows`` /
    ``max_values`` (the exchanges derive them from counts every rank has), as it would a
    collective, and read what it exposed before its next ``expose``. Successive exposures
    alternate between two halves of the buffer, so one barrier per exposure suffices:
    the barrier after exposure N (every rank's copy complete before anyone reads it) is
    reached by each rank only after its reads of exposure N-1, whose half exposure N+1
    overwrites (stream order; a pull on a side stream is awaited before the next move)."""

    def __init__(self, group, device: torch.device):
        try:
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError as e:  # pragma: no cover - depends on the torch build
            raise RuntimeError("comm_backend='symm_mem' needs torch's symmetric memory "
                               "(torch.distributed._symmetric_memory), which this torch build "
                               "lacks: use comm_backend='all_to_all'") from e
        self._symm = symm_mem
        self.group = group if group is not None else dist.group.WORLD
        self.device = device
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._buf = None
        self._hdl = None
        self._half = 0  # bytes in each half
        self._flip = 0
        self._flat: dict = {}  # (half, dtype) -> every rank's half as a flat tensor
        self._views: dict = {}  # _regions' arguments and half -> its regions
        self._offsets: dict = {}  # element size -> peers' element offsets (device)
        self._bytes: tuple = ()

    def _ensure(self, nbytes: int):
        if self._buf is not None and self._half >= nbytes:
            return
        if self._hdl is not None:
            # Every rank's reads of the old buffer are finished before anyone frees it.
            self._hdl.barrier(channel=0)
            torch.cuda.synchronize(self.device)
        self._buf = self._hdl = None
        self._flat.clear()
        self._views.clear()
        self._offsets.clear()
        self._half = _round(max(nbytes, 1), _GROW)
        buf = self._symm.empty(2 * self._half, dtype=torch.uint8, device=self.device)
        try:
            self._hdl = self._symm.rendezvous(buf, self.group)
        except RuntimeError as e:
            raise RuntimeError(
                "comm_backend='symm_mem' could not map the ranks' buffers into each "
                f"other ({e}); it needs CUDA ranks of one host with peer access (NVLink): "
                "use comm_backend='all_to_all' elsewhere") from e
        self._buf = buf
        ptrs = list(self._hdl.buffer_ptrs)
        self._bytes = tuple(p - ptrs[self.rank] for p in ptrs)

    def _halves(self, at: int, dtype: torch.dtype) -> tuple:
        key = (at, dtype)
        flat = self._flat.get(key)
        if flat is None:
            es = dtype.itemsize
            flat = self._flat[key] = tuple(
                self._hdl.get_buffer(r, (self._half // es,), dtype, at // es)
                for r in range(self.size))
        return flat

    def _element_offsets(self, es: int) -> torch.Tensor:
        # A peer's offset does not depend on where in the buffer a region starts.
        d = self._offsets.get(es)
        if d is None:
            from ..kernels.peer import element_offsets

            d = self._offsets[es] = element_offsets(self._bytes, es, self.device)
        return d

    def _regions(self, width: int, dtype, max_rows: int, vdtype, max_values: int, *,
                 rows: bool, values: bool):
        """The next half's per-rank rows ``(max_rows, width)`` and values ``(max_values,)``
        regions (None where not asked for)."""
        rows_bytes = _round(max_rows * width * dtype.itemsize, _ALIGN)
        self._ensure(rows_bytes + _round(max_values * vdtype.itemsize, _ALIGN))
        self._flip ^= 1
        # The views of one shape are made once (about 25 us of host time per move else, on
        # the H200 hosts, before the transfer can start); a route's moves reuse them.
        key = (self._flip, width, dtype, max_rows, vdtype, max_values, rows, values)
        got = self._views.get(key)
        if got is None:
            if len(self._views) >= 64:  # an entry per route and move shape: bounded
                self._views.clear()
            got = self._views[key] = self._new_regions(width, dtype, max_rows, vdtype,
                                                       max_values, rows, values, rows_bytes)
        return got

    def _new_regions(self, width, dtype, max_rows, vdtype, max_values, rows, values,
                     rows_bytes):
        at = self._flip * self._half
        peer_rows = peer_vals = None
        if rows:
            peer_rows = tuple(f[:max_rows * width].view(max_rows, width)
                              for f in self._halves(at, dtype))
        if values:
            v0 = rows_bytes // vdtype.itemsize
            peer_vals = tuple(f[v0:v0 + max_values] for f in self._halves(at, vdtype))
        return peer_rows, peer_vals

    def _publish(self, peer_rows, peer_vals, values, dtype, vdtype) -> PeerView:
        if values is not None:
            peer_vals[self.rank][:values.shape[0]].copy_(values)
        self._hdl.barrier(channel=0)
        return PeerView(self.rank, peer_rows, peer_vals,
                        None if peer_rows is None else self._element_offsets(dtype.itemsize),
                        None if values is None else self._element_offsets(vdtype.itemsize),
                        self._bytes)

    def expose(self, rows, values, max_rows: int, max_values: int) -> PeerView:
        width = rows.shape[1] if rows is not None else 0
        dtype = rows.dtype if rows is not None else torch.uint8
        vdtype = values.dtype if values is not None else torch.uint8
        peer_rows, peer_vals = self._regions(
            width, dtype, max_rows, vdtype, max_values if values is not None else 0,
            rows=rows is not None, values=values is not None)
        if rows is not None:
            peer_rows[self.rank][:rows.shape[0]].copy_(rows)
        return self._publish(peer_rows, peer_vals, values, dtype, vdtype)

    def expose_written(self, write, width: int, dtype, max_rows: int, values,
                       max_values: int, device=None) -> PeerView:
        """As ``expose``, with this rank's rows written in place by ``write(region)`` into
        its ``(max_rows, width)`` region (no copy), and ``values`` copied."""
        vdtype = values.dtype if values is not None else torch.uint8
        peer_rows, peer_vals = self._regions(width, dtype, max_rows, vdtype,
                                             max_values if values is not None else 0,
                                             rows=True, values=values is not None)
        write(peer_rows[self.rank])
        return self._publish(peer_rows, peer_vals, values, dtype, vdtype)


class GatheredPeerMemory:
    """The CPU stand-in: every rank's exposed tensors, padded to the agreed sizes,
    gathered to every rank."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def _gather(self, t, n):
        padded = t.new_zeros((n, *t.shape[1:]))
        padded[:t.shape[0]] = t
        out = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(out, padded, group=self.group)
        return tuple(out)

    def expose(self, rows, values, max_rows: int, max_values: int) -> PeerView:
        return PeerView(self.rank,
                        None if rows is None else self._gather(rows, max_rows),
                        None if values is None else self._gather(values, max_values))

    def expose_written(self, write, width: int, dtype, max_rows: int, values,
                       max_values: int, device=None) -> PeerView:
        region = torch.zeros((max_rows, width), dtype=dtype, device=device)
        write(region)
        return self.expose(region, values, max_rows, max_values)


def pull_rows(view: PeerView, src_rank, src_idx, *, row_div: int = 1, token_slots=None):
    """``out[i] = view.rows[src_rank[i]][src_idx[i] // row_div]`` (given rows) and
    ``vout[i] = view.values[src_rank[i]][src_idx[i]]`` (given values):
    ``(out or None, vout or None)``, on the whole GPU. ``token_slots``
    (``SymmMemHandle.token_slots`` of these indices, ``row_div`` being top_k): the CUDA
    kernel then reads each token row once however many rows copy it."""
    peers = view.rows
    ref = peers[view.rank] if peers is not None else view.values[view.rank]
    if use_triton(ref) and not torch.compiler.is_compiling():
        from ..kernels import peer

        if token_slots is not None and peers is not None:
            return peer.launch_pull_token_rows(
                peers, view.values, view.rank, token_slots, src_idx.numel(), row_div,
                num_programs=peer.PULL_TOKENS_PER_SM * sm_count(ref.device),
                rows_offsets=view.rows_offsets, values_offsets=view.values_offsets,
                byte_offsets=view.byte_offsets)
        return peer.launch_pull_rows(
            peers, view.values, view.rank, src_rank, src_idx, row_div=row_div,
            num_programs=sm_count(ref.device),
            rows_offsets=view.rows_offsets if peers is not None else None,
            values_offsets=view.values_offsets, byte_offsets=view.byte_offsets)
    # The pure twin (also what float64 takes on CUDA).
    out = None if peers is None else peer_gather(peers, src_rank, src_idx, row_div)
    vout = None if view.values is None else peer_gather(view.values, src_rank, src_idx)
    return out, vout


def write_slot_sums(out, rows, token_slots, top_k: int, weights=None):
    """``out[g] = slot_sum(rows, token_slots, top_k, weights)[g]`` for the groups with a slot
    (``moe_fn.pure.dispatch.slot_sum``; the CUDA kernel, on the whole GPU, leaves the others
    unwritten)."""
    if use_triton(rows) and not torch.compiler.is_compiling():
        from ..kernels import peer

        return peer.launch_slot_sum(rows, token_slots, top_k, out, weights,
                                    num_programs=2 * sm_count(rows.device))
    part = slot_sum(rows, token_slots, top_k, weights)
    out[:part.shape[0]] = part
    return out


def pull_partials(view: PeerView, home_rank, values_pos, max_tokens: int, top_k: int,
                  out_dtype, *, num_programs: int | None = None):
    """Each token's partials summed over the ranks that hold its rows
    (``peer_partial_sum``) in ``out_dtype``, and with values ``vout[i] =
    view.values[home_rank[i]][values_pos[i]]``: ``(out, vout or None)``. ``num_programs``
    (CUDA: the few SMs an overlapped backward leaves free) also switches to the launch
    shape that keeps more reads in flight per program; default the whole GPU."""
    ref = view.rows[view.rank]
    if use_triton(ref) and not torch.compiler.is_compiling():
        from ..kernels import peer

        few = num_programs is not None
        return peer.launch_pull_partials(
            view.rows, view.values, view.rank, home_rank, values_pos, top_k, max_tokens,
            out_dtype, num_programs=num_programs or 2 * sm_count(ref.device),
            tokens_per_program=peer.FEW_SMS_SUM_TOKENS if few else None,
            num_warps=peer.FEW_SMS_SUM_WARPS if few else None, rows_offsets=view.rows_offsets,
            values_offsets=view.values_offsets, byte_offsets=view.byte_offsets)
    vout = None
    if view.values is not None:
        vout = peer_gather(view.values, home_rank, values_pos)
    return peer_partial_sum(view.rows, home_rank, view.rank, max_tokens, top_k, out_dtype), vout
