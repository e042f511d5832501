"""Taking a wrapper's Triton branch, normally CUDA only, on the CPU under the interpreter."""

from __future__ import annotations

import pytest
import torch

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def force_triton(monkeypatch, module) -> list:
    """Make ``module.use_triton`` say yes for the kernels' dtypes on any device (skips the
    test unless the interpreter runs the kernels); returns the dtypes it was asked about, so
    a test can prove the branch ran."""
    from moe_fn.kernels.activation import interpreting

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported")
    asked = []

    def force(t):
        asked.append(t.dtype)
        return t.dtype in KERNEL_DTYPES
    monkeypatch.setattr(module, "use_triton", force)
    return asked
