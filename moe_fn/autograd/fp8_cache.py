"""The quantised expert weights of one layer, made once per change of the weights.

An optimizer step writes the parameters in place; replacing ``.data`` or a parameter
changes the tensor or its storage. A fused optimizer (``torch.optim.AdamW(fused=True)``,
TorchTitan's default) writes them without moving their ``_version``, so every cache is also
dropped after any ``torch.optim.Optimizer.step`` (a global step hook, registered with the
first cache; it holds the live caches weakly and no weights). The cache keeps one entry, keyed
by the two tensors (held weakly, so a dropped parameter frees its entry; for a view, its
base), their versions,
storages, shapes, strides, dtypes and devices: the forward, the checkpoint recompute and the
backward of a step read one quantisation, and a changed weight is never served stale. A
change the key cannot see (a write through ``torch.Tensor.set_`` or into another view
of the storage made under ``torch.no_grad`` and never versioned, say) is covered by
``invalidate()``.

Not pickled or deep-copied: a copy of a layer quantises its own weights on its first call.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..pure.experts_fp8 import Fp8ExpertWeights, quantize_expert_weights

# The live caches, weakly: what the optimizer step hook invalidates.
_LIVE: weakref.WeakSet = weakref.WeakSet()
_STEP_HOOK = []


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    for cache in list(_LIVE):
        cache.invalidate()


def _watch(cache) -> None:
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_post_hook(
            _after_optimizer_step))
    _LIVE.add(cache)


def _owner(t: torch.Tensor) -> torch.Tensor:
    """The tensor a weight is read from: the parameter itself, or the base of a view of one
    (a converted GPT-OSS layer serves its experts as ``.transpose(1, 2)`` views, a new view
    object every call)."""
    return t if t._base is None else t._base


def _key(t: torch.Tensor) -> tuple:
    return (t._version, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            t.stride(), t.dtype, t.device)


class Fp8WeightCache:
    """``get(gate_up_proj, down_proj, impl)`` -> ``Fp8ExpertWeights`` (quantised by
    ``impl.quantize_rows``, ``moe_fn.kernels`` for the layer), quantised again
    only when either tensor changed; ``quantizations`` counts how often it quantised."""

    def __init__(self):
        self._refs = None
        self._key = None
        self._value: Fp8ExpertWeights | None = None
        self.quantizations = 0
        _watch(self)

    def get(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
            impl=None) -> Fp8ExpertWeights:
        refs = self._refs
        key = (_key(gate_up_proj), _key(down_proj))
        if (refs is not None and refs[0]() is _owner(gate_up_proj)
                and refs[1]() is _owner(down_proj) and key == self._key):
            return self._value
        with torch.no_grad():
            value = quantize_expert_weights(gate_up_proj, down_proj, impl)
        self._refs = (weakref.ref(_owner(gate_up_proj)), weakref.ref(_owner(down_proj)))
        self._key, self._value = key, value
        self.quantizations += 1
        return value

    def invalidate(self) -> None:
        """Drop the quantised weights: the next forward quantises them again."""
        self._refs = self._key = self._value = None

    def __getstate__(self):
        return {"quantizations": 0}

    def __setstate__(self, state):
        self.__init__()

    def __deepcopy__(self, memo):
        return Fp8WeightCache()
