"""Every preset trains with skip_recompute_combine under HF's reentrant checkpointing, its
recompute checked (moe_fn.skip_check), with the gradients it has without the skip."""

from __future__ import annotations

import copy

import pytest
import torch

from moe_fn import SkipContractError
from moe_fn.hf import convert, converted_blocks
from tests.hf.models import SUPPORTED, batch, make_model, preset_params, run

pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable:FutureWarning")


def _trained(model, skip):
    conv = convert(copy.deepcopy(model), skip_recompute_combine=skip)
    conv.train()
    conv.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids, labels = batch()
    out = run(conv, ids, labels)
    return conv, out


@pytest.mark.parametrize("name", preset_params(SUPPORTED))
def test_every_preset_skips_with_the_gradients_of_its_unskipped_recompute(name):
    model = make_model(name).double()
    want_model, want = _trained(model, skip=False)
    got_model, got = _trained(model, skip=True)
    # float64 both ways: the skip changes which combine runs, not what is computed.
    torch.testing.assert_close(got.loss, want.loss)
    torch.testing.assert_close(got.logits, want.logits)
    want_grads = dict(want_model.named_parameters())
    grads = 0
    for pname, p in got_model.named_parameters():
        w = want_grads[pname].grad
        if w is None:
            assert p.grad is None, f"{name}: {pname} has a gradient only with the skip"
            continue
        assert p.grad is not None, f"{name}: {pname} lost its gradient with the skip"
        assert torch.isfinite(p.grad).all(), f"{name}: {pname}"
        torch.testing.assert_close(p.grad, w, msg=lambda m, n=pname: f"{name} {n}: {m}")
        grads += 1
    assert grads > 0
    blocks = converted_blocks(got_model)
    assert blocks
    for _, b in blocks:
        c = b.moe_layer.exchange.counters
        # The forward's combine ran once; the recompute's was skipped, its backward ran.
        assert (c["combine"], c["combine_skipped"], c["combine_backward"]) == (1, 1, 1), \
            (name, dict(c))
        assert (c["layout"], c["cached_dispatch"]) == (1, 1)


def test_a_block_whose_output_feeds_more_than_the_residual_add_is_refused():
    """A forward hook that passes a converted block's output through a nonlinearity (as a
    model change around the preset's block would) is refused in HF's recompute."""
    conv = convert(make_model("qwen3_moe").double(), skip_recompute_combine=True)
    conv.train()
    conv.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    _, block = converted_blocks(conv)[0]
    block.register_forward_hook(lambda module, args, out: torch.tanh(out))
    ids, labels = batch()
    with pytest.raises(SkipContractError, match="TanhBackward0"):
        run(conv, ids, labels)
