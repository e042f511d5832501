"""Exchanges: moving expert rows between the ranks of an expert-parallel group.

``Exchange`` (``base``) is the declared protocol the layer and the autograd shells use;
``local``/``all_to_all`` (``sorted_rows``), ``symm_mem`` and ``deepep`` implement it.
``CommResources`` / ``ResourceRegistry`` (``resources``) own what they keep between moves;
``groups`` says how the process groups held by layers and exchanges are copied and pickled.
"""

from .base import Exchange, Gathered, Pending, Summation
from .carveout import sm_carveout
from .resources import CommResources, ResourceRegistry

__all__ = ["CommResources", "Exchange", "Gathered", "Pending", "ResourceRegistry",
           "Summation", "sm_carveout"]
