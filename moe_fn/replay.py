"""Routing replay across activation-checkpoint recompute.

A checkpointed region runs its function twice: once in the forward and once when the
backward recomputes it. ``checkpoint`` (and ``wrap_checkpoint``, for frameworks that call
their own checkpoint function, such as Hugging Face's ``_gradient_checkpointing_func``)
gives each region a ``ReplayRegion``. During the region's forward every MoELayer records a
``ReplayEntry`` (its route plan and dispatch handle); during the recompute each layer takes
the next entry instead of routing and exchanging layouts again.

Entries live in their region, which lives exactly as long as the autograd graph of that
checkpoint call: an entry from an earlier step (a region whose backward never ran) cannot
be reached by a later one. Each entry is consumed once; the layer that takes it must be
the layer that made it.

A reentrant recompute in which a layer skipped its combine (``skip_recompute_combine``)
is checked before the checkpoint backpropagates through it: ``moe_fn.skip_check`` proves
that no backward reads a value computed from a skipped output, or refuses naming the op.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading

import attrs
import torch
import torch.utils.checkpoint as torch_checkpoint

from .skip_check import OPTION, SkipContractError, SkipWatch

_serials = itertools.count(1)
_state = threading.local()


@attrs.frozen(kw_only=True, eq=False)
class ReplayEntry:
    """One MoELayer call inside a checkpointed region.

    ``layer_id``: ``id()`` of the layer that recorded it (checked on replay).
    ``region``: serial of the region (checkpoint call) that recorded it.
    ``position``: index among the region's entries (forward order).
    ``plan``: the RoutePlan. ``handle``: the exchange handle the dispatch returned.
    ``kept``: instead of those, a layer with ``recompute_in_checkpoint=False`` records its
    ``KeptActivations``, which the recompute returns instead of running the layer.
    ``balance``: the ``BalanceTerms`` of the forward's balancing losses (their counts,
    all-reduced once), which the recompute reuses; None without such losses.
    """

    layer_id: int
    region: int
    plan: object = None
    handle: object = None
    kept: object = None
    balance: object = None


@attrs.frozen(kw_only=True, eq=False)
class KeptActivations:
    """The forward of a layer that is not recomputed. ``out`` / ``logits``: its outputs.
    Reentrant regions (whose forward runs without autograd) build the layer's graph from a
    leaf copy ``x_leaf`` of its input; the recompute's backward runs that graph. Elsewhere
    the forward's own graph serves, ``x_leaf`` is None and the outputs are detached values.
    """

    x_leaf: object
    out: object
    logits: object


class ReplayRegion:
    """State of one checkpoint call: its entries and whether it is recording or replaying."""

    def __init__(self, *, reentrant: bool):
        self.reentrant = reentrant
        # Whether autograd was on where the checkpoint was called: a reentrant checkpoint
        # runs its forward without autograd either way, so the layer cannot tell from
        # inside whether a backward (and the recompute) will come.
        self.grad_at_call = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        self.serial = next(_serials)
        self.entries: list[ReplayEntry] = []
        self.runs = 0
        self.cursor = 0
        self.watch: SkipWatch | None = None  # from the current run's first skipped combine
        self._args = ()  # the current run's arguments

    @property
    def replaying(self) -> bool:
        return self.runs > 1

    def record(self, layer, plan=None, handle=None, *, kept=None, balance=None) -> None:
        self.entries.append(ReplayEntry(layer_id=id(layer), region=self.serial,
                                        plan=plan, handle=handle,
                                        kept=kept, balance=balance))

    def consume(self, layer) -> ReplayEntry:
        if self.cursor >= len(self.entries):
            raise RuntimeError(
                "moe_fn replay: the recompute called more MoE layers than the forward recorded "
                f"({len(self.entries)}); a checkpointed function must call the same MoE layers "
                "in the same order each time")
        entry = self.entries[self.cursor]
        if entry is None:
            raise RuntimeError(
                "moe_fn replay: this checkpoint's route was already replayed; each replay entry "
                "is consumed once, so a second backward through one checkpoint "
                "(retain_graph=True) is not supported")
        if entry.layer_id != id(layer) or entry.region != self.serial:
            raise RuntimeError(
                f"moe_fn replay: recompute reached a different MoE layer than the forward at "
                f"position {self.cursor}; the checkpointed function must be deterministic in "
                "which MoE layers it calls")
        self.entries[self.cursor] = None  # consumed: drop the reference to the handle
        self.cursor += 1
        return entry

    def note_skip(self, out: torch.Tensor) -> None:
        """A layer skipped its combine in this run and returned ``out``, the sentinel."""
        if self.watch is None:
            self.watch = SkipWatch(out, self._args)
        else:
            self.watch.add_skip(out)

    def finish(self, outputs) -> None:
        """A run returned ``outputs``. A recompute that returns has called every recorded
        layer (a non-reentrant checkpoint that stops early leaves by an exception, not
        through here); one that skipped a combine is checked before its outputs are
        backpropagated: a use of a skipped output whose backward would read its value is
        refused (SkipContractError)."""
        if self.replaying and self.cursor < len(self.entries):
            raise RuntimeError(
                f"moe_fn replay: the recompute called {self.cursor} MoE layer(s) where the "
                f"forward called {len(self.entries)}; a checkpointed function must call the "
                "same MoE layers in the same order each time")
        if self.watch is not None:
            self.watch.check(outputs)

    @contextlib.contextmanager
    def run(self, args=()):
        self.runs += 1
        self.cursor = 0
        self.watch = None
        self._args = args
        stack = _stack()
        stack.append(self)
        try:
            yield self
        except RuntimeError as e:
            if (self.watch is not None and not isinstance(e, SkipContractError)
                    and "view was created inside a custom Function" in str(e)):
                raise SkipContractError(
                    f"{OPTION}: in this checkpoint's recompute, a view was modified inplace "
                    "where autograd forbids it (its error is the cause below). An MoE "
                    "layer's recomputed output is a read-only NaN sentinel, a view of a "
                    "shared buffer, so `y += h` or `y.mul_(...)` on it cannot run: write the "
                    "residual add out of place (`h + y`), or set "
                    "skip_recompute_combine=False") from e
            raise
        finally:
            stack.pop()
            self.watch = None  # drops the recomputed graph's nodes
            self._args = ()


def _stack() -> list:
    if not hasattr(_state, "stack"):
        _state.stack = []
    return _state.stack


def current_region() -> ReplayRegion | None:
    """The innermost checkpoint region being run on this thread, if any."""
    stack = _stack()
    return stack[-1] if stack else None


def _in_new_region(fn, *, reentrant: bool):
    region = ReplayRegion(reentrant=reentrant)

    def run(*a, **kw):
        with region.run((a, kw)):
            out = fn(*a, **kw)
            region.finish(out)
        return out
    return run


def _check_reentrant(use_reentrant) -> None:
    # Replay, the skip and kept layers act on the mode: a value torch would reinterpret
    # (None means True there) must not be read differently here.
    if not isinstance(use_reentrant, bool):
        raise TypeError(f"use_reentrant must be True or False, got {use_reentrant!r}")


class _ReplayCheckpoint:
    """``checkpoint_fn`` giving each call a ReplayRegion (an object, not a closure, so that a
    model holding it, as a converted HF layer does, pickles)."""

    moe_fn_replay = True

    def __init__(self, checkpoint_fn, use_reentrant: bool):
        functools.update_wrapper(self, checkpoint_fn)
        self.checkpoint_fn, self.use_reentrant = checkpoint_fn, use_reentrant

    def __call__(self, fn, *args, **kwargs):
        return self.checkpoint_fn(_in_new_region(fn, reentrant=self.use_reentrant), *args,
                                  **kwargs)


def wrap_checkpoint(checkpoint_fn, *, use_reentrant: bool):
    """Wrap a checkpoint function (``checkpoint_fn(fn, *args, **kw)``) so that each call gets
    a ReplayRegion. ``use_reentrant`` must say what ``checkpoint_fn`` does."""
    _check_reentrant(use_reentrant)
    return _ReplayCheckpoint(checkpoint_fn, use_reentrant)


def checkpoint(fn, *args, use_reentrant: bool = True, **kwargs):
    """Activation checkpointing with MoE routing replay: ``torch.utils.checkpoint.checkpoint``
    with the same arguments (reentrant by default), plus replay of every MoELayer's route and
    dispatch layout in the recompute, and — with ``skip_recompute_combine`` and a reentrant
    checkpoint — no forward combine in the recompute, its contract checked there
    (docs/checkpointing.md; a use it cannot serve raises SkipContractError)."""
    _check_reentrant(use_reentrant)
    if not callable(fn):
        raise TypeError(f"checkpoint's first argument must be the function to run, got "
                        f"{type(fn).__name__}")
    return torch_checkpoint.checkpoint(_in_new_region(fn, reentrant=use_reentrant), *args,
                                       use_reentrant=use_reentrant, **kwargs)
