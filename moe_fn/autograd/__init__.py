"""Autograd shells: where a pure pair meets ctx, saved tensors, events and exchanges."""

from .experts import Experts, GroupedLinear, RowWeight, Swiglu, SwigluPacked

__all__ = ["Experts", "GroupedLinear", "RowWeight", "Swiglu", "SwigluPacked"]
