"""Hooks on a converted router see what HF's router gives them: its input as HF's block
passes it, and its output (router logits, routing weights, expert indices; Llama-4's scores
and logits) in HF's shapes and dtypes, with the values the MoELayer computed: the same
experts, and logits and weights by the tolerance rule against HF's float64 twin, gradients
included (a hook's term in the loss trains the router as in HF). In checkpoints the
recompute hands the hooks what the forward did, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch

from moe_fn.hf import convert, converted_blocks
from tests.hf.models import (
    SUPPORTED,
    Parity,
    batch,
    float64_twin,
    keep_float64,
    make_model,
    preset_of,
    preset_params,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]

# Their routers take torch.topk(..., sorted=False), whose order torch leaves unspecified:
# their indices (and weights) are compared as sets, ordered by expert.
UNSORTED = {"deepseek_v2", "deepseek_v3", "glm4_moe", "minimax_m2", "minimax_m3",
            "deepseek_v32", "glm4_moe_lite", "dots1", "step3p7"}


class RouterLog:
    """A read-only forward hook on every converted block's router of a model: each call's
    input and output, detached, and the first call's output as it came (for a loss term)."""

    def __init__(self, model, block_names, router_attr):
        self.calls = {n: [] for n in block_names}
        self.first = {}
        for n in block_names:
            router = getattr(model.get_submodule(n), router_attr)
            router.register_forward_hook(self._hook(n))

    def _hook(self, name):
        def log(module, args, out):
            self.calls[name].append(tuple(
                tuple(None if t is None else t.detach().clone() for t in ts)
                for ts in (args, out)))
            self.first.setdefault(name, out)
        return log

    def loss_term(self):
        """A term of the loss read from the routing weights (Llama-4: its scores)."""
        return sum(out[1 if len(out) == 3 else 0].float().square().sum()
                   for out in self.first.values())


def _routes(name, out):
    """``(logits, weights (T, k), indices (T, k))`` of a router output; for an unsorted
    family ordered by expert; Llama-4's chosen experts (where its scores are not 0)."""
    if len(out) == 2:  # Llama-4: (scores (T, E), logits)
        scores, logits = out
        return logits, scores, None
    logits, w, idx = out
    if name in UNSORTED:
        idx, order = idx.sort(dim=1)
        w = w.gather(1, order)
    return logits, w, idx


def _step(model, log, ids, labels, f64=False, term=True):
    model.zero_grad(set_to_none=True)
    with keep_float64() if f64 else torch.enable_grad():
        out = model(input_ids=ids, labels=labels, output_router_logits=True, use_cache=False)
        (out.loss + 0.5 * log.loss_term() if term else out.loss).backward()
    return out


def _converted(name, ckpt=None, **options):
    ref = make_model(name)
    conv = convert(copy.deepcopy(ref), **options)
    ref.train()
    conv.train()
    if ckpt is not None:
        conv.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt})
    return ref, conv


def _check_against_hf(name, ckpt=None, **options):
    ref, conv = _converted(name, ckpt, **options)
    ref64 = float64_twin(ref)
    blocks = [n for n, _ in converted_blocks(conv)]
    attr = preset_of(name).router_attr
    logs = [RouterLog(m, blocks, attr) for m in (conv, ref, ref64)]
    ids, labels = batch()
    # A reentrant checkpoint's forward runs without autograd (HF's too): its hooks' outputs
    # train nothing, so the loss then has no hook term.
    for i, model in enumerate((conv, ref, ref64)):
        _step(model, logs[i], ids, labels, f64=i == 2, term=ckpt is not True)
    got, want, want64 = (log.calls for log in logs)
    parity = Parity(name)
    for n in blocks:
        # HF's router runs once per forward (unchecked); a recompute hands the hooks again
        # what the forward did, bit for bit (a non-reentrant one may stop before the router).
        assert len(want[n]) == len(want64[n]) == 1, n
        assert 1 <= len(got[n]) <= (1 if ckpt is None else 2), (n, len(got[n]))
        if ckpt is True:
            assert len(got[n]) == 2, n
        for again in got[n][1:]:
            for a, b in zip((t for ts in again for t in ts), (t for ts in got[n][0] for t in ts)):
                assert a.dtype == b.dtype and torch.equal(a, b), f"{n}: the recompute's hook"
        (g_args, g_out), (w_args, w_out), (r_args, r_out) = got[n][0], want[n][0], want64[n][0]
        # The router's input, as HF's block passes it.
        assert len(g_args) == len(w_args), n
        for i, (g, w, r) in enumerate(zip(g_args, w_args, r_args)):
            assert (g.shape, g.dtype) == (w.shape, w.dtype), f"{n} input {i}"
            parity.add(f"{n} router input {i}", g, w, r)
        # Its output, in HF's shapes and dtypes.
        assert len(g_out) == len(w_out), n
        for i, (g, w) in enumerate(zip(g_out, w_out)):
            assert (g.shape, g.dtype) == (w.shape, w.dtype), f"{n} output {i}"
        (g_lg, g_w, g_idx), (w_lg, w_w, w_idx), (r_lg, r_w, r_idx) = (
            _routes(name, o) for o in (g_out, w_out, r_out))
        if g_idx is None:  # Llama-4: the chosen experts are its scores' nonzero entries
            g_idx, w_idx, r_idx = (s != 0 for s in (g_w, w_w, r_w))
        # The same experts (HF's float64 twin chooses them too: the weights compare).
        assert torch.equal(g_idx, w_idx) and torch.equal(w_idx, r_idx), f"{n}: experts differ"
        parity.add(f"{n} router logits", g_lg, w_lg, r_lg)
        parity.add(f"{n} routing weights", g_w, w_w, r_w)
    got_p, want_p, want64_p = (dict(m.named_parameters()) for m in (conv, ref, ref64))
    for pname, p in got_p.items():  # the hooks' loss term trains the routers as in HF
        if want_p[pname].grad is not None:
            parity.add(f"grad {pname}", p.grad, want_p[pname].grad, want64_p[pname].grad)
    parity.check()


@pytest.mark.parametrize("name", preset_params(SUPPORTED))
def test_router_hooks_see_what_hf_routers_give_them(name):
    _check_against_hf(name)


# Two families: the checkpoint modes act on the route the same way in every preset; Llama-4
# builds its scores from the weights (a non-reentrant recompute must save what its forward
# saved).
@pytest.mark.parametrize("name", preset_params(["qwen3_moe", "llama4"]))
@pytest.mark.parametrize(("ckpt", "options"), [
    (True, {}), (True, {"skip_recompute_combine": True}),
    (True, {"recompute_in_checkpoint": False}), (False, {"recompute_in_checkpoint": False}),
    (False, {})], ids=["replay", "skip", "kept", "kept-nonreentrant", "replay-nonreentrant"])
def test_router_hooks_in_checkpoints_see_the_forwards_route(name, ckpt, options):
    _check_against_hf(name, ckpt, **options)


@pytest.mark.parametrize("name", preset_params(SUPPORTED))
def test_router_hooks_see_hf_dtypes_in_bfloat16(name):
    """Shapes and dtypes where HF's routers mix them: bfloat16 logits with float32 weights
    (Mixtral, MiniMax), float32 logits (DeepSeek), weights in the input's dtype (ERNIE)."""
    ref = make_model(name).to(torch.bfloat16)
    conv = convert(copy.deepcopy(ref))
    blocks = [n for n, _ in converted_blocks(conv)]
    logs = [RouterLog(m, blocks, preset_of(name).router_attr) for m in (conv, ref)]
    ids, _ = batch()
    with torch.no_grad():
        for m in (conv, ref):
            m(input_ids=ids, use_cache=False)
    for n in blocks:
        (g_args, g_out), (w_args, w_out) = (log.calls[n][0] for log in logs)
        assert ([(t.shape, t.dtype) for t in (*g_args, *g_out)]
                == [(t.shape, t.dtype) for t in (*w_args, *w_out)]), n


def test_a_hook_registered_between_a_kept_forward_and_its_recompute_is_refused():
    """With recompute_in_checkpoint=False the recompute does not route again: a hook that
    was not there in the forward has no route to read, and says so."""
    _, conv = _converted("qwen3_moe", True, recompute_in_checkpoint=False)
    ids, labels = batch()
    out = conv(input_ids=ids, labels=labels, output_router_logits=False, use_cache=False)
    RouterLog(conv, [n for n, _ in converted_blocks(conv)], "gate")
    with pytest.raises(RuntimeError, match="registered between a checkpoint's forward and "
                                           "its recompute"):
        out.loss.backward()


def test_hooks_under_inference_mode_read_and_writes_are_refused():
    """Inference tensors have no version counter: the output is still handed, and a hook
    writing into it is still refused."""
    ref, conv = _converted("qwen3_moe")
    ids, _ = batch()
    with torch.inference_mode():  # no hook at all: nothing to check
        assert torch.isfinite(conv(input_ids=ids, use_cache=False).logits).all()
    blocks = [n for n, _ in converted_blocks(conv)]
    logs = [RouterLog(m, blocks, "gate") for m in (conv, ref)]
    with torch.inference_mode():
        for m in (conv, ref):
            m(input_ids=ids, use_cache=False)
    for n in blocks:
        g_idx, w_idx = (log.calls[n][0][1][2] for log in logs)
        assert torch.equal(g_idx, w_idx), n

    def scale_in_place(module, args, out):
        out[1].mul_(2)

    conv.get_submodule(blocks[0]).gate.register_forward_hook(scale_in_place)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="wrote into its input or "
                                                                     "output"):
        conv(input_ids=ids, use_cache=False)


def test_a_pre_hook_writing_into_the_routers_input_is_refused():
    """HF would route on the written input; the converted block has routed already."""
    _, conv = _converted("qwen3_moe")

    def halve_in_place(module, args):
        args[0].mul_(0.5)

    conv.get_submodule(converted_blocks(conv)[0][0]).gate.register_forward_pre_hook(
        halve_in_place)
    with pytest.raises(RuntimeError, match=r"halve_in_place.*wrote into its input or output"):
        conv(input_ids=batch()[0], use_cache=False)
