"""Public helpers for testing MoE layers: the tolerance rule and the
plain/float64 results it compares against (``tolerance``)."""

from .tolerance import (
    assert_all_close_to_ref,
    assert_close_to_ref,
    assert_jointly_close_to_ref,
    error_bound,
    max_error,
    rounding_step,
    value_and_grads,
)

__all__ = [
    "assert_all_close_to_ref",
    "assert_close_to_ref",
    "assert_jointly_close_to_ref",
    "error_bound",
    "max_error",
    "rounding_step",
    "value_and_grads",
]
