"""Plain arms and oracles for tests of modules that hold MoE layers: the same module with
every layer computed by the naive reference MoE (``moe_fn.testing.reference_moe``) on its
own parameters, so that run in float32 it is plain PyTorch and in float64 the oracle,
sharing no function with the layer under test."""

from __future__ import annotations

import contextlib
from unittest import mock

from moe_fn import MoELayer
from moe_fn.testing import layer_params, reference_moe


def _reference_forward(self, x, return_router_logits=False, *, seq_len=None):
    if self.exchange.ep_size != 1 or self.balance.active:
        raise ValueError("naive_layers() computes single-rank layers without balancing losses")
    ref = reference_moe(x, layer_params(self), self.config)
    return (ref.out, ref.logits) if return_router_logits else ref.out


@contextlib.contextmanager
def naive_layers():
    """Within it every ``MoELayer`` call runs ``reference_moe`` on the layer's parameters
    (gradients reach their ``.grad``)."""
    with mock.patch.object(MoELayer, "forward", _reference_forward):
        yield
