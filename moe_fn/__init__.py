"""moe_fn: fast, provably correct Mixture-of-Experts layers for PyTorch."""

from ._checks import debug_checks, set_debug_checks

__all__ = ["debug_checks", "set_debug_checks"]
__version__ = "0.1.0"
