"""Public helpers for testing MoE layers and one's own MoE code.

- The tolerance rule (``assert_close_to_ref``, ``assert_all_close_to_ref``,
  ``assert_jointly_close_to_ref``, ``error_bound``, ...): a result's error against float64
  may be at most twice plain same-precision PyTorch's, plus one rounding step;
  ``value_and_grads`` gives the plain and float64 results of naive code.
- A dense reference MoE written from the formulas, independent of moe_fn's
  implementation (``reference_moe``, ``reference_route``, ``reference_experts``,
  ``reference_activation``), its parameter record ``MoEParams`` and helpers to move
  parameters between it and a ``MoELayer`` (``layer_params``, ``load_params``,
  ``random_params``).
- ``gradcheck_layer``: a MoELayer (or a config) in float64 against autograd of the
  reference: output, router logits, and every gradient.
- ``moe_fn.testing.strategies`` (imported on its own; needs ``hypothesis``): configs,
  cases with empty experts and no tokens, token counts per rank.
"""

from .gradcheck import gradcheck_layer
from .reference import (
    MoEOutput,
    MoEParams,
    Route,
    layer_params,
    load_params,
    random_params,
    reference_activation,
    reference_experts,
    reference_moe,
    reference_route,
    split_gate_up,
)
from .tolerance import (
    assert_all_close_to_ref,
    assert_close_to_ref,
    assert_jointly_close_to_ref,
    error_bound,
    max_error,
    rounding_step,
    value_and_grads,
)

__all__ = ["MoEOutput", "MoEParams", "Route", "assert_all_close_to_ref", "assert_close_to_ref",
           "assert_jointly_close_to_ref", "error_bound", "gradcheck_layer", "layer_params",
           "load_params", "max_error", "random_params", "reference_activation",
           "reference_experts", "reference_moe", "reference_route", "rounding_step",
           "split_gate_up", "value_and_grads"]
