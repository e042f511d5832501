"""Public helpers for testing MoE layers: the tolerance rule (``tolerance``)."""

from .tolerance import assert_close_to_ref, error_bound, max_error, rounding_step

__all__ = ["assert_close_to_ref", "error_bound", "max_error", "rounding_step"]
