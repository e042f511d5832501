"""The Exchange protocol: all the layer and the autograd shells know of an exchange.

An exchange moves expert rows between the ranks of an expert-parallel group, and back.
Rank r owns the contiguous global experts ``[r*E_local, (r+1)*E_local)``. Its verbs:

- ``layout(plan) -> layout``: what the dispatch must know before it runs (split sizes,
  DeepEP's layout, ...). Counted as ``"layout"``.
- ``dispatch(x, weights, layout, *, cached=False, encode=None) -> (rows, row_weights,
  handle)``: token rows ``x (T, H)`` and their routing weights ``(T, k)`` (or None) to
  expert rows ``(N, H)`` grouped by local expert (``handle.local_offs``), each with its
  weight. The handle is what every later move of the same route reuses; ``cached=True``
  replays a dispatch with the handle it returned (no layout, no host sync). ``encode(src,
  index) -> rows`` (only where ``encodes_rows``): the exchange moves ``encode``'s rows of
  the tokens ``src[index]`` (``index`` None: all of them) instead of the tokens themselves,
  calling it where it first reads the token rows (the FP8 dispatch's quantising gather).
- ``dispatch_backward(handle, d_rows, d_row_weights, *, async_op=False) -> Pending``: row
  gradients back to their tokens, summed over k; ``wait()`` gives ``(dx, d_weights)``.
  With ``async_op`` the move runs beside what the caller queues until ``wait()`` (the
  weight-gradient overlap); without, it has finished when this returns.
- ``combine(rows, handle, *, weights=None, keep=True) -> (out (T, H), saved)``: expert
  rows back to their tokens, each token's k rows summed; with ``weights`` the sum is
  weighted where the exchange's ``summation`` says (below). ``saved`` is what
  ``combine_backward`` needs (None unless home weights were given with ``keep``).
- ``combine_backward(handle, d_out, *, weights=None, saved=None) -> (d_rows, d_weights)``:
  the combine's backward, a cached dispatch of the output gradient (and, for home
  weights, the weighted sum's backward; ``d_weights`` None without them).
- ``combine_backward_gathered(handle, d_out) -> Gathered``: the unweighted combine's
  backward as a gather not yet run, so that the caller can fuse it into what reads it
  (the backward of a row weighting that preceded the combine).

Capabilities (class attributes): ``encodes_rows``, whether ``dispatch`` takes ``encode``
(rows of any dtype and width move as they are); ``summation``, where a combine sums each
token's k rows,
and so where routing weights may enter that sum instead of a weighting pass of their own
(``Summation``). Whether they do is the caller's choice (``MoELayer``'s ``impl``): the
exchanges weight what they are given and decide nothing about weighting.

``counters`` counts what ran (``COUNTER_KEYS``), so tests and users can see that a
recompute did not communicate again.
"""

from __future__ import annotations

import abc
import enum
from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import torch

from ..pure.dispatch import behind
from ..records import RoutePlan
from .groups import HoldsProcessGroups, check_loaded_group

COUNTER_KEYS = ("layout", "dispatch", "cached_dispatch", "combine", "combine_skipped",
                "dispatch_backward", "combine_backward")


class Summation(enum.Enum):
    """Where an exchange's combine sums each token's k returning rows."""

    #: At the token's home rank, row by row as the rows come home (``local``,
    #: ``all_to_all``). ``combine(weights=(T, k))`` applies the routing weights in that sum
    #: in float32: they never travel to the experts and no weighting pass runs.
    HOME = "home"
    #: On the expert side: each rank sums the rows of each token it received into one
    #: partial per (token, rank), and the home adds the partials (``symm_mem``, ``deepep``).
    #: ``combine(weights=(N,))`` applies each expert row's weight (as the dispatch delivered
    #: it) inside that sum, as ``combine(rows * weights[:, None])`` would, without writing
    #: the weighted rows; its backward is the unweighted combine's followed by that
    #: weighting's backward, which the caller runs (``combine_backward_gathered``).
    EXPERTS = "experts"


class Pending:
    """A result whose communication may still be in flight: ``wait()`` finishes it once."""

    def __init__(self, finish: Callable[[], Any]):
        self._finish = finish
        self._done = False
        self._value = None

    def wait(self):
        if not self._done:
            self._value = self._finish()
            self._done = True
            self._finish = None
        return self._value


class Gathered(NamedTuple):
    """Expert rows not yet written: row ``i`` is ``src[index[i]]`` (``src[i]`` with
    ``index`` None), where a position ``p`` from ``len(src)`` on reads
    ``own[own_index[p - len(src)]]`` (a rank's own rows read where they are)."""

    src: torch.Tensor
    index: torch.Tensor | None = None
    own: torch.Tensor | None = None
    own_index: torch.Tensor | None = None

    def materialize(self) -> torch.Tensor:
        rows = behind(self.src, self.own, self.own_index)
        return rows if self.index is None else rows.index_select(0, self.index)


class Exchange(HoldsProcessGroups, abc.ABC):
    """Moves expert rows between the ranks of an expert-parallel group (see the module).

    ``backend`` names it as ``MoEConfig.comm_backend`` does; ``summation`` says where its
    combine sums a token's rows. ``resources`` (a ``ResourceRegistry``) owns what its moves
    keep between calls (streams, buffers), shared by every exchange of its group.

    Copies share the group and the registry; a pickled exchange of the default group loads
    where torch.distributed has a default group of ``ep_size`` ranks, on the rank that
    saved it (``moe_fn.comm.groups``), and draws on that process's registry.
    """

    backend: ClassVar[str]
    summation: ClassVar[Summation]
    encodes_rows: ClassVar[bool] = False

    def __init__(self, *, num_experts: int, ep_size: int, rank: int, group, resources):
        if num_experts % ep_size:
            raise ValueError(f"ep_size ({ep_size}) must divide num_experts ({num_experts})")
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.rank = rank
        self.group = group
        self.resources = resources
        self.num_local_experts = num_experts // ep_size
        self.counters: Counter = Counter({k: 0 for k in COUNTER_KEYS})

    def __setstate__(self, state):
        super().__setstate__(state)
        if self.backend != "local":
            check_loaded_group(self.group, size=self.ep_size, rank=self.rank,
                               what=f"a {self.backend!r} exchange")

    def resources_on(self, device: torch.device):
        """This exchange's group's resources on ``device`` (looked up at every move, so
        that after a release the next move makes new ones)."""
        return self.resources.get(self.group, device)

    @abc.abstractmethod
    def layout(self, plan: RoutePlan, *, stamp=None, agree=None):
        """What the dispatch of ``plan``'s rows needs to know before it runs.

        ``stamp`` (a small int64 tensor) travels to every rank in the layout's first
        collective, and ``agree`` is called with every rank's stamp (a host list, the same
        on every rank) before any collective that the ranks' disagreement could break:
        so a caller's agreement check runs on every rank at every fresh layout, without a
        collective of its own where the layout gathers counts anyway."""

    @abc.abstractmethod
    def dispatch(self, x, weights, layout, *, cached: bool = False, encode=None):
        """Token rows (and weights) to expert rows: ``(rows, row_weights, handle)``."""

    @abc.abstractmethod
    def dispatch_backward(self, handle, d_rows, d_row_weights, *,
                          async_op: bool = False) -> Pending:
        """Row gradients home, summed over k; ``wait()``: ``(dx, d_weights)``."""

    @abc.abstractmethod
    def combine(self, rows, handle, *, weights=None, keep: bool = True):
        """Expert rows home, summed over k (weighted as ``summation`` says):
        ``(out, saved)``."""

    @abc.abstractmethod
    def combine_backward(self, handle, d_out, *, weights=None, saved=None):
        """The combine's backward: ``(d_rows, d_weights)``."""

    def combine_backward_gathered(self, handle, d_out) -> Gathered:
        """The unweighted combine's backward as a ``Gathered`` (here: already written)."""
        return Gathered(self.combine_backward(handle, d_out)[0])

    def reset_counters(self) -> None:
        for k in COUNTER_KEYS:
            self.counters[k] = 0


def refuse_encode(exchange: Exchange, encode) -> None:
    """An exchange whose moves are typed (``encodes_rows`` False) takes no ``encode``."""
    if encode is not None:
        raise TypeError(f"the {exchange.backend!r} exchange moves rows of the layer's dtype "
                        "only (encodes_rows is False): dispatch its rows, then encode them")


def side_stream_after(resources, *inputs):
    """``(main, side)``: the current stream of ``resources``' device and the group's side
    stream there, ordered after the work queued on the current stream so far, with
    ``inputs`` (``None`` skipped) recorded as used by it so that their memory outlives its
    reads."""
    main = torch.cuda.current_stream(resources.device)
    side = resources.stream("side")
    side.wait_stream(main)
    for t in inputs:
        if t is not None:
            t.record_stream(side)
    return main, side


def joined(main, side, *outputs, then=None) -> Pending:
    """A ``Pending`` whose ``wait()`` orders ``main`` after ``side`` and hands it the side
    stream's ``outputs`` (``then(*outputs)`` when given)."""
    def finish():
        main.wait_stream(side)
        for t in outputs:
            if t is not None:
                t.record_stream(main)
        return then(*outputs) if then is not None else outputs
    return Pending(finish)


def check_cached_tokens(x, handle) -> None:
    """A cached dispatch moves the tokens its handle was made for: the same count."""
    if x.shape[0] != handle.plan.num_tokens:
        raise ValueError(f"a cached dispatch must move the {handle.plan.num_tokens} tokens its "
                         f"handle was made for, got {x.shape[0]}: make a fresh layout "
                         "(exchange.layout) for other tokens")


def check_combine_weights(exchange: Exchange, weights, rows, handle) -> None:
    """``combine``'s weights are the kind its ``summation`` takes."""
    if weights is None:
        return
    want = ((handle.plan.num_tokens, handle.plan.top_k)
            if exchange.summation is Summation.HOME else (rows.shape[0],))
    if tuple(weights.shape) != want:
        where = "at home" if exchange.summation is Summation.HOME else "on the expert side"
        raise ValueError(f"the {exchange.backend} exchange sums a token's rows {where}: its "
                         f"combine takes weights of shape {want}, got {tuple(weights.shape)}")
