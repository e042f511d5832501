"""What the exchanges keep between moves, with one owner per (process group, device).

``CommResources`` holds, for one process group on one device: DeepEP's ``Buffer``, the
symmetric-memory buffer of the ``symm_mem`` exchange, the NaN sentinels of the recompute
skip and the side streams of overlapped moves, each made at its first use.
``ResourceRegistry`` hands out one ``CommResources`` per (group, device) and frees them all
in one call (``release``), which it also makes at interpreter exit. Nothing here is module
state: a registry is an object, passed to the exchanges that use it (``moe_fn.resources``
holds the process's).
"""

from __future__ import annotations

import atexit
import importlib
import sys
import threading

import torch
import torch.distributed as dist

from .peer_memory import GatheredPeerMemory, SymmetricPeerMemory


class CommResources:
    """One process group's resources on one device (``group`` None: no group, the local
    exchange). Every rank of the group must make and release the collective ones (DeepEP's
    buffer, the symmetric memory) at the same points, as its moves do."""

    def __init__(self, group, device: torch.device):
        self.group = group
        self.device = device
        self._streams: dict = {}
        self._sentinels: dict = {}
        self._peer_memory = None
        self._deepep = None
        self._deepep_retired: list = []

    def stream(self, purpose: str) -> torch.cuda.Stream:
        """A CUDA stream of this device for ``purpose`` (one per purpose, made at first use),
        shared by the group's exchanges."""
        s = self._streams.get(purpose)
        if s is None:
            s = self._streams[purpose] = torch.cuda.Stream(self.device)
        return s

    def nan_sentinel(self, num_tokens: int, width: int, dtype) -> torch.Tensor:
        """A contiguous ``(num_tokens, width)`` view of NaN rows, filled once and reused by
        every skipped combine. Contiguous so that the residual add reading it takes
        PyTorch's vectorised path (a broadcast NaN row made that add about twice as slow).
        Returned by a custom Function, the view cannot be written in place and then used
        (autograd refuses); if anything wrote into the buffer anyway, it is refilled.
        Keyed by stream so that no stream reads a fill still queued on another."""
        device = self.device
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
        key = (dtype, width, stream)
        buf, version = self._sentinels.get(key, (None, None))
        if buf is None or buf.shape[0] < num_tokens or buf._version != version:
            rows = num_tokens if buf is None else max(num_tokens, buf.shape[0])
            buf = torch.full((rows, width), float("nan"), dtype=dtype, device=device)
            self._sentinels[key] = (buf, buf._version)
        return buf[:num_tokens]

    def peer_memory(self):
        """The group's peer memory: one symmetric-memory buffer on CUDA, shared by every
        exchange of the group (``SymmetricPeerMemory``), the gathering stand-in elsewhere."""
        if self._peer_memory is None:
            self._peer_memory = (SymmetricPeerMemory(self.group, self.device)
                                 if self.device.type == "cuda"
                                 else GatheredPeerMemory(self.group))
        return self._peer_memory

    def deepep_buffer(self, deep_ep, num_nvl_bytes: int):
        """The group's DeepEP ``Buffer`` with at least ``num_nvl_bytes`` of NVLink buffer
        (one per group, grown for the largest layer asked for: every rank asks for the same
        sizes in the same order, so a growth, which is collective, happens everywhere at
        once). A grown-out buffer is kept until ``release``: a handle of a move still in
        flight may use it. Made with ``explicitly_destroy=True``, so that ``release`` frees
        them collectively while the ranks live, as DeepEP's users do before
        ``destroy_process_group``; released in its destructor a buffer can hang or fault at
        exit."""
        buf = self._deepep
        if buf is None or buf.num_nvl_bytes < num_nvl_bytes:
            if buf is not None:
                self._deepep_retired.append(buf)
            group = self.group if self.group is not None else dist.group.WORLD
            self._deepep = deep_ep.Buffer(group, num_nvl_bytes=num_nvl_bytes,
                                          num_rdma_bytes=0, explicitly_destroy=True)
        return self._deepep

    def release(self) -> None:
        """Free everything held here (DeepEP's buffer collectively: every rank of the group
        releases at the same point); what the next move needs is made again."""
        buffers = [*self._deepep_retired, *([self._deepep] if self._deepep is not None else [])]
        self._deepep, self._deepep_retired = None, []
        self._peer_memory = None
        self._sentinels.clear()
        self._streams.clear()
        for buf in buffers:
            buf.destroy()


class ResourceRegistry:
    """One ``CommResources`` per (process group, device), made at first use.

    Keyed by the group object itself, held here, so that a group created after another was
    destroyed (whose address may repeat) gets resources of its own. ``release()`` frees
    every group's on every device (or one group's), and runs at interpreter exit too.

    A registry is shared, never copied: ``copy.deepcopy`` of a layer keeps its exchange's
    registry. ``home`` (``"module:attribute"``) names where the process keeps it, so that
    an unpickled layer draws on the process's registry (a registry without one unpickles
    as a new, empty one)."""

    def __init__(self, home: str | None = None):
        self.home = home
        self._owners: dict = {}
        self._lock = threading.Lock()
        self._exit_hook = False

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self

    def __reduce__(self):
        if self.home is None:
            return ResourceRegistry, ()
        return _registry_at, (self.home,)

    def get(self, group, device: torch.device) -> CommResources:
        """``group``'s resources on ``device`` (``group`` None: the default group's while
        torch.distributed is initialised, else those of no group)."""
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (id(group), device)
        with self._lock:
            entry = self._owners.get(key)
            if entry is None or entry[0] is not group:
                entry = self._owners[key] = (group, CommResources(group, device))
                if not self._exit_hook:
                    # Registered after torch's own exit handlers (LIFO: this one runs
                    # first), so the groups still live when it frees what they hold.
                    atexit.register(self._release_at_exit)
                    self._exit_hook = True
            return entry[1]

    def owners(self) -> list[CommResources]:
        with self._lock:
            return [owner for _, owner in self._owners.values()]

    def release(self, group=None) -> None:
        """Free the resources of ``group`` (all groups' when None) on every device. Call it
        on every rank of those groups with nothing in flight, before
        ``destroy_process_group``; the next move makes new ones."""
        with self._lock:
            keys = [k for k, (g, _) in self._owners.items() if group is None or g is group]
            owners = [self._owners.pop(k)[1] for k in keys]
        for owner in owners:
            owner.release()

    def _release_at_exit(self) -> None:
        try:
            self.release()
        except Exception as e:  # noqa: BLE001 - an exit must not raise from here
            print(f"moe_fn: freeing the exchanges' resources at exit failed: {e!r}",
                  file=sys.stderr)


def _registry_at(home: str) -> ResourceRegistry:
    """The registry a process keeps at ``home`` (``"module:attribute"``)."""
    module, _, name = home.partition(":")
    return getattr(importlib.import_module(module), name)
