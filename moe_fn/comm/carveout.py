"""SMs: how many a GPU has, and withholding some from cuBLAS GEMMs for overlapped moves."""

from __future__ import annotations

import contextlib

import torch


def sm_count(device) -> int:
    """The CUDA device's streaming multiprocessors."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@contextlib.contextmanager
def sm_carveout(num_sms: int | None):
    """Withhold ``num_sms`` SMs from cuBLAS GEMMs inside the block (for overlapped comms).

    Always restores the previous value, exceptions included. ``None`` or 0 does nothing.
    """
    if not num_sms:
        yield
        return
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    getter = getattr(torch._C, "_get_sm_carveout_experimental", None)
    if setter is None or getter is None:
        raise RuntimeError("this torch build has no SM carveout API "
                           "(torch._C._set_sm_carveout_experimental); upgrade torch")
    previous = getter()
    setter(int(num_sms))
    try:
        yield
    finally:
        setter(previous)
