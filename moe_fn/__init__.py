"""moe_fn: fast, provably correct Mixture-of-Experts layers for PyTorch."""

from . import balance, functional
from ._checks import debug_checks, set_debug_checks
from .config import MoEConfig
from .layer import MoELayer
from .replay import checkpoint
from .resources import release_comm_resources
from .skip_check import SkipContractError

__all__ = ["MoEConfig", "MoELayer", "SkipContractError", "balance", "checkpoint",
           "debug_checks", "functional", "release_comm_resources", "set_debug_checks"]
__version__ = "0.1.0"
