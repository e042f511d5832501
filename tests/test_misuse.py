"""Misuse that would crash or silently mislead: each gets a clear error naming the fix."""

from __future__ import annotations

import pytest
import torch

import moe_fn
from moe_fn import MoEConfig, MoELayer


def _cfg(**kw):
    return MoEConfig(hidden_size=8, intermediate_size=16, num_experts=4, top_k=2, **kw)


@pytest.mark.parametrize("factor", [1e300, 1e39, 1e-300, 1e-39])
def test_routed_scaling_factor_outside_float32_is_refused(factor):
    # In float32 routing weights, 1e300 is inf (outputs inf/NaN, NaN gradients) and 1e-300
    # is 0 (outputs exactly zero).
    with pytest.raises(ValueError, match="routed_scaling_factor.*outside float32's range"):
        _cfg(routed_scaling_factor=factor)


def test_routed_scaling_factor_inside_float32_is_accepted_and_finite():
    layer = MoELayer(_cfg(routed_scaling_factor=1e30))
    out = layer(torch.randn(5, 8))
    assert torch.isfinite(out).all() and out.abs().max() > 0


@pytest.mark.parametrize("factor", [1e5, 1e-6])
def test_routed_scaling_factor_outside_float16_is_refused_for_a_float16_layer(factor):
    layer = MoELayer(_cfg(routed_scaling_factor=factor), dtype=torch.float16)
    with pytest.raises(ValueError, match="outside float16's range.*bfloat16 or float32"):
        layer(torch.randn(5, 8, dtype=torch.float16))
    # The same factor is fine in float32.
    MoELayer(_cfg(routed_scaling_factor=factor))(torch.randn(5, 8))


def _biased_layer():
    layer = MoELayer(_cfg(score_func="sigmoid", score_correction_bias=True))
    with torch.no_grad():
        layer.router.e_score_correction_bias.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0]))
    return layer


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_score_correction_bias_is_refused_at_load(bad):
    layer = _biased_layer()
    sd = layer.state_dict()
    sd["router.e_score_correction_bias"] = torch.tensor([0.0, bad, 0.0, 0.0])
    with pytest.raises(ValueError, match=r"e_score_correction_bias.*non-finite.*experts \[1\]"):
        layer.load_state_dict(sd)
    # Refused before anything was copied in.
    assert torch.isfinite(layer.router.e_score_correction_bias).all()
    # A finite one loads.
    sd["router.e_score_correction_bias"] = torch.zeros(4)
    layer.load_state_dict(sd)


def test_nonfinite_score_correction_bias_written_directly_is_caught_by_debug_checks():
    layer = _biased_layer()
    with torch.no_grad():
        layer.router.e_score_correction_bias[2] = float("nan")
    x = torch.randn(6, 8)
    moe_fn.set_debug_checks(True)
    try:
        with pytest.raises(ValueError, match=r"non-finite values \(experts \[2\]\)"):
            layer(x)
    finally:
        moe_fn.set_debug_checks(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_meta_device_forward_names_the_meta_device(dtype):
    with torch.device("meta"):
        layer = MoELayer(_cfg(), dtype=dtype)
    with pytest.raises(ValueError, match="x is on the meta device.*to_empty"):
        layer(torch.randn(5, 8, device="meta", dtype=dtype))
    real = MoELayer(_cfg(), dtype=dtype)
    with pytest.raises(ValueError, match="x is on the meta device"):
        real(torch.randn(5, 8, device="meta", dtype=dtype))
    # Real input, parameters still on meta (to_empty forgotten).
    with pytest.raises(ValueError, match="on the meta device \\(no data\\).*to_empty"):
        layer(torch.randn(5, 8, dtype=dtype))
