"""The recompute-combine skip's contract, checked in every recompute that skips.

With ``skip_recompute_combine`` a reentrant recompute does not run an MoE layer's forward
combine: the layer returns a NaN sentinel of its output's shape, and its backward is the
real one. That is correct exactly when no backward that the recompute runs reads a value
computed from the sentinel. Before the checkpoint backpropagates through the recomputed
graph, ``SkipWatch.check`` proves this from autograd's graph, or refuses with
``SkipContractError`` naming the op whose backward would read such a value.

What the proof rests on:

- A node's backward reads the incoming gradient and what the node saved. Generated nodes
  expose every saved tensor (``_raw_saved_<name>``, ``_saved_<name>``); a custom Function
  exposes its ``saved_tensors`` but may keep anything on its ctx, so one is refused unless
  it is one of an MoE layer's own (``trust_layer``) or compiled code that saved nothing.
- Sequence numbers grow on a thread. A node numbered below the first skipped combine of
  the run was made before any sentinel existed: nothing it saved comes from one. A node's
  inputs are made before it, so a child numbered at or above its parent was made on
  another thread before this recompute (the forward's graph, reached through a tensor the
  function closes over).
- A value is *traced* when it is a parameter, an input of the checkpointed function (not
  written in place since the first skip), a Python number, a view of a traced value, or
  the output of a node made before the first skip; or the output of a later node whose
  inputs are all traced and none of which is a skipped combine. A node's inputs are the
  children on its edges and the tensors it saved. Anything else without autograd history
  (a mask, indices, a detached copy made inside the checkpoint) cannot be traced and is
  refused where a backward reads it.

A later node may read a traced value (a parameter, an input's mask, a shared expert's
activation) but nothing else. What the graph cannot show stays outside: an input that
requires no grad on an edge without a node (the 1.0 of ``x + 1.0``; a mask computed from
the MoE output and added into a value a later op saves would be one), Python numbers
read off the MoE output on the host (``.item()``) and writes under ``no_grad`` into
tensors made before the skip. The NaN sentinel makes most of those loud.
"""

from __future__ import annotations

import functools
import re

import torch
from torch import nn
from torch.autograd.function import BackwardCFunction

__all__ = ["SkipContractError", "SkipWatch"]

OPTION = "skip_recompute_combine=True"
RULE = ("The skip leaves an MoE layer's recomputed output a NaN sentinel, which is correct "
        "only where no backward reads a value computed from it: between it and the "
        "checkpoint's outputs, additions, subtractions, views, dtype casts and other ops "
        "that save nothing computed from it (docs/checkpointing.md).")
FIX = ("Use the MoE output only in the residual add that ends the checkpointed block (one "
       "MoE layer per checkpoint region), set skip_recompute_combine=False, or keep the MoE "
       "layer's activations with recompute_in_checkpoint=False.")


class SkipContractError(ValueError, RuntimeError):
    """A checkpointed function uses an MoE layer's skipped recompute output where the skip
    cannot serve it. Raised from the recompute, so from the backward: a ValueError (a use
    the contract excludes) that is also a RuntimeError (where autograd's own errors are)."""


# Why a value is not traced (completed with the node that makes it, where there is one).
_DERIVED = "derived"
_NO_HISTORY = "no_history"
_LOOSE_LEAF = "loose_leaf"
_OPAQUE = "opaque"
_HOOKED = "hooked"

_WHY = {
    _DERIVED: "computed from an MoE layer's skipped output (a NaN sentinel in the recompute)",
    _NO_HISTORY: "a tensor without autograd history that is neither a parameter, an input "
                 "of the checkpointed function nor a Python number (a mask, indices, a "
                 "buffer or a detached copy made inside the checkpoint may come from the "
                 "MoE output)",
    _LOOSE_LEAF: "a tensor that requires grad but is neither a parameter nor an input of "
                 "the checkpointed function",
    _OPAQUE: "computed by {node}, a custom autograd Function (or an op) whose saved state "
             "the check cannot inspect",
    _HOOKED: "packed by a saved-tensor hook (a nested non-reentrant checkpoint, "
             "save_on_cpu), which the check does not unpack",
}

# Generated nodes are named <Op>Backward<n>. copy_'s backward casts the gradient only.
_GENERATED = re.compile(r"Backward\d+$")
_PLAIN_MANUAL = frozenset({"CopyBackwards"})
_LEAF, _GENERATED_NODE, _COMPILED, _MOE_FN, _OPAQUE_NODE = range(5)

# Saved outputs of the node itself that carry no autograd history: dropout's mask, drawn
# from the RNG and never from the input's values; the indices a selection picked, traced
# when the values it picked from are.
_RANDOM_OUTPUTS = {"NativeDropoutBackward0": ("result1",)}
_PICKED_OUTPUTS = {"TopkBackward0": ("indices",), "SortBackward0": ("indices",),
                   "MaxBackward0": ("indices",), "MinBackward0": ("indices",),
                   "KthvalueBackward0": ("indices",),
                   "MaxPool2DWithIndicesBackward0": ("result1",)}

# A Python number becomes a 0-dim "wrapped number" tensor, which type promotion ranks below
# a 0-dim tensor: against a narrower 0-dim tensor of its kind, only a wrapped number loses.
_NUMBER_PROBES = {torch.float64: torch.tensor(0.0, dtype=torch.float16),
                  torch.int64: torch.tensor(0, dtype=torch.int8),
                  torch.complex128: torch.tensor(0j, dtype=torch.complex64)}


def _kind(node) -> int:
    return _kind_of(type(node))


@functools.cache
def _kind_of(cls: type) -> int:
    name = cls.__name__
    if name == "AccumulateGrad":
        return _LEAF
    if issubclass(cls, BackwardCFunction):
        fwd = getattr(cls, "_forward_cls", None)
        module = getattr(fwd, "__module__", None) or ""
        if module.startswith("moe_fn."):
            return _MOE_FN
        if module.startswith("torch._functorch") and hasattr(fwd, "_aot_id"):
            return _COMPILED  # AOTAutograd's: every tensor it keeps is saved
        return _OPAQUE_NODE
    if _GENERATED.search(name) or name in _PLAIN_MANUAL:
        return _GENERATED_NODE
    return _OPAQUE_NODE


def _name(node) -> str:
    return type(node).__name__


@functools.cache
def _saved_attrs(cls: type) -> tuple[tuple[str, str, str], ...]:
    """``(name, raw attribute, attribute)`` of each tensor (or tensor list) a node of
    ``cls`` saves."""
    if _kind_of(cls) != _GENERATED_NODE:
        return (("saved_tensors", "_raw_saved_tensors", "saved_tensors"),)
    prefix = "_raw_saved_"
    return tuple((n[len(prefix):], n, "_saved_" + n[len(prefix):])
                 for n in dir(cls) if n.startswith(prefix))


def _saved_tensors(node) -> dict:
    """``{name: tuple of tensors, or _HOOKED}`` of what ``node`` saved. A value autograd
    cannot give back (freed, or written in place after it was saved) is left out: the
    backward that needs it raises autograd's own error."""
    out = {}
    for name, raw_attr, attr in _saved_attrs(type(node)):
        try:
            raw = getattr(node, raw_attr)
            hooked = False
            for r in (raw if isinstance(raw, (tuple, list)) else (raw,)):
                # (A torch without ``unpack_hook`` unpacks: a nested non-reentrant
                # checkpoint's tensor then fails its second unpack, loudly.)
                if r is not None and getattr(r, "unpack_hook", None) is not None:
                    hooked = True
            if hooked:
                out[name] = _HOOKED
                continue
            value = getattr(node, attr)
        except RuntimeError:
            continue
        if isinstance(value, torch.Tensor):
            out[name] = (value,)
        elif isinstance(value, (tuple, list)):
            out[name] = tuple(v for v in value if isinstance(v, torch.Tensor))
    if _kind(node) == _COMPILED:
        out["tensors_no_vc_check"] = tuple(getattr(node, "_tensors_no_vc_check", ()))
    return out


def _is_python_number(t: torch.Tensor) -> bool:
    probe = _NUMBER_PROBES.get(t.dtype)
    return (probe is not None and t.dim() == 0 and t.device.type == "cpu"
            and not t.requires_grad and torch.result_type(probe, t) == probe.dtype)


def _tensors(obj):
    """The tensors of a (nested) tuple, list or dict, or of one tensor."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _latest_sequence_nr() -> int:
    # A node made now is numbered above every node made before it on this thread.
    with torch.enable_grad():
        return torch.empty(0, requires_grad=True).view(0).grad_fn._sequence_nr()


class SkipWatch:
    """One recompute run's skipped combines, from the first one on, and the check of the
    graph the run built after it.

    ``first``: the sequence number of the first skipped combine's node (nodes numbered
    below it were made before any sentinel). ``sentinels``: the skipped combines' nodes.
    ``storages``: the sentinels' storages (a detached copy shares one). ``trusted``: an
    MoE layer's own nodes made after the first skip by a layer whose input was proven
    traced (``trust_layer``). ``inputs``: the checkpointed function's input tensors and
    their versions at the first skip.
    """

    def __init__(self, sentinel: torch.Tensor, inputs):
        node = sentinel.grad_fn
        self.first = node._sequence_nr() if node is not None else _latest_sequence_nr()
        self.sentinels: set = set()
        self.storages: set = set()
        self.trusted: set = set()
        self.inputs = {id(t): (t, t._version) for t in _tensors(inputs)}
        self._traced: set = set()  # nodes whose outputs are proven traced
        self._saved: dict = {}  # node -> _saved_tensors(node), read once
        self.add_skip(sentinel)

    def add_skip(self, sentinel: torch.Tensor) -> None:
        """A layer skipped its combine and returned ``sentinel``."""
        if sentinel.grad_fn is not None:
            self.sentinels.add(sentinel.grad_fn)
        self.storages.add(sentinel.untyped_storage().data_ptr())

    def trust_layer(self, outputs, x: torch.Tensor) -> None:
        """An MoE layer ran on ``x`` (proven traced) after the first skip: its own nodes
        (from its outputs down to ``x``) read only what it computed from ``x``, its
        parameters and the forward's replay record."""
        stop = x.grad_fn
        stack = [t.grad_fn for t in outputs if t is not None]
        seen = set()
        while stack:
            node = stack.pop()
            if node is None or node is stop or node in seen:
                continue
            seen.add(node)
            kind = _kind(node)
            if kind == _LEAF or node._sequence_nr() < self.first:
                continue
            if kind == _MOE_FN:
                self.trusted.add(node)
            stack.extend(c for c, _ in node.next_functions)

    # --- is a value traced? -----------------------------------------------------------

    def _saved_of(self, node) -> dict:
        saved = self._saved.get(node)
        if saved is None:
            saved = self._saved[node] = _saved_tensors(node)
        return saved

    def _is_input(self, t) -> bool:
        seen = self.inputs.get(id(t))
        return seen is not None and seen[0] is t and t._version == seen[1]

    def _leaf(self, t, requires_grad_why=_NO_HISTORY):
        """Why a tensor without a node is not traced (None: it is)."""
        if isinstance(t, nn.Parameter) or self._is_input(t) or _is_python_number(t):
            return None
        base = t._base
        if base is not None:
            problem, node = self._tensor(base, None, None)
            return problem if node is None else self._outputs_problem(node)
        if t.untyped_storage().data_ptr() in self.storages:
            return (_DERIVED, None)  # the sentinel's rows, detached
        return (requires_grad_why, None)

    def _tensor(self, t, reader, reader_seq):
        """``(problem, node)`` for a tensor ``reader`` (numbered ``reader_seq``) saved:
        a problem, or a node whose outputs are still to be proven traced, or neither."""
        try:
            fn = t.grad_fn
        except RuntimeError:  # a view autograd refuses to rebase: refused as untraced
            return (_NO_HISTORY, None), None
        if fn is None:
            return self._leaf(t), None
        if fn is reader:
            return None, None  # its own output: traced when its inputs are
        return self._node(fn, reader_seq)

    def _node(self, node, parent_seq):
        """``(problem, node)`` for a node on an edge of one numbered ``parent_seq``."""
        if node in self.sentinels:
            return (_DERIVED, None), None
        if _kind(node) == _LEAF:
            return self._leaf(node.variable, _LOOSE_LEAF), None
        if node in self.trusted or node in self._traced:
            return None, None
        seq = node._sequence_nr()
        if seq < self.first or (parent_seq is not None and seq >= parent_seq):
            return None, None  # made before the first skip, or before this recompute
        return None, node

    def _inputs_of(self, node):
        """``(problem, nodes)``: why ``node``'s outputs are not traced, else the later
        nodes among its inputs that remain to be proven."""
        kind = _kind(node)
        if kind in (_OPAQUE_NODE, _MOE_FN):
            return (_OPAQUE, node), ()
        seq = node._sequence_nr()
        found = []

        def add(problem, pending):
            if problem is not None:
                return problem if problem[1] is not None else (problem[0], node)
            if pending is not None:
                found.append(pending)
            return None

        # An edge without a node is an input that requires no grad, which the graph does
        # not show (the 1.0 of ``x + 1.0`` is one): taken as given.
        for child, _ in node.next_functions:
            problem = None if child is None else add(*self._node(child, seq))
            if problem is not None:
                return problem, ()
        saved = self._saved_of(node) if kind == _GENERATED_NODE else {}
        skip = _RANDOM_OUTPUTS.get(_name(node), ()) + _PICKED_OUTPUTS.get(_name(node), ())
        for name, tensors in saved.items():
            if name in skip:
                continue
            if tensors is _HOOKED:
                return (_HOOKED, node), ()
            for t in tensors:
                problem = add(*self._tensor(t, node, seq))
                if problem is not None:
                    return problem, ()
        return None, found

    def _outputs_problem(self, root):
        """Why the values of ``root``'s outputs may come from a skipped combine (or cannot
        be traced); None when they are traced."""
        if root in self._traced:
            return None
        stack, seen = [root], {root}
        while stack:
            problem, pending = self._inputs_of(stack.pop())
            if problem is not None:
                return problem
            for node in pending:
                if node not in seen:
                    seen.add(node)
                    stack.append(node)
        self._traced |= seen
        return None

    def _tensor_problem(self, t, reader, reader_seq):
        problem, node = self._tensor(t, reader, reader_seq)
        return problem if node is None else self._outputs_problem(node)

    # --- the checks -------------------------------------------------------------------

    def input_problem(self, x: torch.Tensor) -> str | None:
        """Why an MoE layer's input in this run may come from a skipped combine (or cannot
        be traced), in words; None when it is traced."""
        problem = self._tensor_problem(x, None, None)
        return None if problem is None else _why(problem)

    def check(self, outputs) -> None:
        """Refuse, naming the op, any node made after the first skip on the way to the
        checkpointed function's ``outputs`` whose backward reads an untraced value."""
        stack = [(t.grad_fn, None) for t in _tensors(outputs) if t.grad_fn is not None]
        seen = set()
        while stack:
            node, parent_seq = stack.pop()
            if node in seen or _kind(node) == _LEAF:
                continue
            seq = node._sequence_nr()
            if seq < self.first or (parent_seq is not None and seq >= parent_seq):
                continue
            seen.add(node)
            if node not in self.sentinels and node not in self.trusted:
                self._check_reads(node, seq)
            stack.extend((c, seq) for c, _ in node.next_functions if c is not None)

    def _check_reads(self, node, seq) -> None:
        kind = _kind(node)
        name = _name(node)
        if kind in (_OPAQUE_NODE, _MOE_FN):
            raise SkipContractError(
                f"{OPTION}: in this checkpoint's recompute, {name} runs after an MoE layer's "
                "skipped output, and it is a custom autograd Function (or an op) whose "
                f"backward's saved state the check cannot inspect. {RULE} {FIX}")
        saved = self._saved_of(node)
        if kind == _COMPILED:
            # Compiled code computes what it saved from its inputs alone.
            if any(saved.values()):
                problem = self._outputs_problem(node)
                if problem is not None:
                    self._refuse(name, "tensors", problem)
            return
        random = _RANDOM_OUTPUTS.get(name, ())
        picked = _PICKED_OUTPUTS.get(name, ())
        for attr, tensors in saved.items():
            if attr in random:
                continue
            if tensors is _HOOKED:
                self._refuse(name, attr, (_HOOKED, None))
            for t in tensors:
                if attr in picked or t.grad_fn is node:
                    problem = self._outputs_problem(node)  # its own output
                else:
                    problem = self._tensor_problem(t, node, seq)
                if problem is not None:
                    self._refuse(name, attr, problem)

    @staticmethod
    def _refuse(name, attr, problem):
        raise SkipContractError(
            f"{OPTION}: in this checkpoint's recompute, {name}'s backward reads its saved "
            f"`{attr}`, {_why(problem)}. {RULE} {FIX}")


def _why(problem) -> str:
    why, node = problem
    return _WHY[why].format(node=_name(node) if node is not None else "an op")
