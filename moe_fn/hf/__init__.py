"""Hugging Face integration: ``convert(model)`` runs every sparse MoE block of a transformers
model on a MoELayer, in place, with HF's parameter names, outputs and router logits.

See :mod:`moe_fn.hf.presets` for each family's routing and :mod:`moe_fn.hf.convert` for how a
block is converted.
"""

from .convert import (
    OPTIONS,
    ConvertedBlock,
    HFMoELayer,
    convert,
    converted_blocks,
    expert_parameter_names,
    gather_expert_state_dict,
    resolve_preset,
)
from .presets import MODEL_TYPES, PRESETS, Preset

__all__ = ["MODEL_TYPES", "OPTIONS", "PRESETS", "ConvertedBlock", "HFMoELayer", "Preset",
           "convert", "converted_blocks", "expert_parameter_names", "gather_expert_state_dict",
           "resolve_preset"]
