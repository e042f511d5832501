"""The three ways a whole module is copied: pickle, torch.save/torch.load, copy.deepcopy."""

from __future__ import annotations

import copy
import io
import pickle

import torch


def pickled(module):
    return pickle.loads(pickle.dumps(module))


def saved(module):
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


ROUND_TRIPS = {"pickle": pickled, "torch.save": saved, "deepcopy": copy.deepcopy}


def assert_same_tensors(got: dict, want: dict, what: str) -> None:
    """Bit-identical tensors (or None alike) under the same keys."""
    assert got.keys() == want.keys(), f"{what}: {sorted(got.keys() ^ want.keys())}"
    for key, w in want.items():
        g = got[key]
        if w is None:
            assert g is None, f"{what} {key}: {g} where the original has None"
            continue
        assert g is not None, f"{what} {key} is None where the original has a tensor"
        assert g.dtype == w.dtype and torch.equal(g, w), f"{what} {key} differs"


def assert_owns_its_tensors(copied: torch.nn.Module, original: torch.nn.Module) -> None:
    """A round trip makes new parameters and buffers, never aliases of the original's."""
    mine = {t.data_ptr() for t in (*original.parameters(), *original.buffers()) if t.numel()}
    for name, t in (*copied.named_parameters(), *copied.named_buffers()):
        assert not t.numel() or t.data_ptr() not in mine, f"{name} shares the original's storage"
