"""Each benchmark's result checked against its group's reference by the tolerance rule
(``moe_fn.testing``), outside the timing and also under ``--benchmark-disable``; integer
results and copies exactly.

``check``: ``plain`` is the group's plain PyTorch arm in the benchmarks' dtype, ``ref64``
the same code on the same inputs in float64. ``check_layer`` (the MoE layer's output and
gradients): the float64 oracle is written from the formulas here and in ``moe_fn.testing``
(which calls none of moe_fn's implementation), on the arm's own route; plain is the plain
layer arm on that route in the arm's precision on a GPU, the formulas in it on a CPU, and
for an FP8 arm a plain quantise-then-matmul (``moe_fn.testing.fp8``).
"""

from __future__ import annotations

import collections

import torch

from moe_fn.testing import (
    assert_all_close_to_ref,
    assert_close_to_ref,
    assert_jointly_close_to_ref,
    reference_activation,
    reference_experts,
    reference_route,
    split_gate_up,
)
from moe_fn.testing.fp8 import fp8_linear

F64 = torch.float64
_DONE: set = set()
# The plain and float64 results of the latest groups: the arms of one group share them.
_MEMO: collections.OrderedDict = collections.OrderedDict()
MEMO_SIZE = 4


def f64(*ts):
    """Floating tensors as float64 leaves (requiring grad where the input did); others as
    they are."""
    out = []
    for t in ts:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t = t.detach().double().requires_grad_(t.requires_grad)
        out.append(t)
    return out if len(out) > 1 else out[0]


def check(got, plain, ref64, what: str) -> None:
    """``got`` (a tensor or a sequence of them) by the rule against ``plain`` and ``ref64``;
    an integer result must equal ``plain`` exactly."""
    if isinstance(got, torch.Tensor):
        got, plain, ref64 = [got], [plain], [ref64]
    floats = [(g, p, r) for g, p, r in zip(got, plain, ref64, strict=True)
              if g is not None and g.is_floating_point()]
    for g, p in zip(got, plain, strict=True):
        if g is not None and not g.is_floating_point():
            assert torch.equal(g, p), f"{what}: an integer result differs from plain PyTorch's"
    if len(floats) == 1:
        assert_close_to_ref(*(t.detach() for t in floats[0]), what)
    elif floats:
        assert_all_close_to_ref(*([t.detach() for t in col] for col in zip(*floats)),
                                [f"{what}[{i}]" for i in range(len(floats))])


def stable_tokens(logits64, model, dtype, bias=None, abs_logits64=None) -> torch.Tensor:
    """``(T,)`` bool: the tokens whose route no computation of the logits in ``dtype`` can
    change, by interval bounds. A logit computed in ``dtype`` (float32 accumulation rounded
    once to ``dtype``, or kept in float32) is within half a step of ``dtype`` of float64's
    plus the accumulation's error, a few float32 steps of ``|x| @ |w|^T`` (``abs_logits64``,
    where the arm computes the logits itself); each logit may move by four times that (a
    GEMM's split reductions round more often). Softmax ranks by logit; sigmoid moves each
    score by at most its steepest slope over the logit's interval times the move (a float32
    step more for the arm's own arithmetic), groups by the sum of their top two. A token is
    stable when the chosen groups' lowest bound stays above the others' highest, and
    likewise the chosen experts' among the eligible. An arm's route is compared with
    float64's there only; elsewhere a near tie may route either way at any precision."""
    move = 2 * torch.finfo(dtype).eps * logits64.abs()
    if abs_logits64 is not None:
        move = move + 16 * torch.finfo(torch.float32).eps * abs_logits64
    r, k = model.routing, model.top_k
    if r.get("score_func", "softmax") == "softmax":
        return _separated(logits64, logits64 - move, logits64 + move, k)
    c = torch.sigmoid(logits64)
    z = (logits64.abs() - move).clamp(min=0)  # the interval's point nearest 0
    steepest = torch.sigmoid(z) * torch.sigmoid(-z)
    dc = steepest * move + 4 * torch.finfo(torch.float32).eps
    if bias is not None:  # the choice bias (the weights stay the scores)
        c = c + bias.double()
    lo, hi = c - dc, c + dc
    t, e = c.shape
    g, tg = r["n_group"], r["topk_group"]

    def group(v):
        return v.view(t, g, e // g).topk(2, dim=-1).values.sum(-1)
    ok = _separated(group(c), group(lo), group(hi), tg) if tg < g else \
        torch.ones(t, dtype=torch.bool, device=c.device)
    keep = torch.zeros_like(group(c)).scatter_(1, group(c).topk(tg, dim=-1).indices, 1.0)
    out = keep[:, :, None].expand(t, g, e // g).reshape(t, e) == 0
    return ok & _separated(c.masked_fill(out, float("-inf")),
                           lo.masked_fill(out, float("-inf")),
                           hi.masked_fill(out, float("-inf")), k)


def _separated(v, lo, hi, k) -> torch.Tensor:
    """Whether each row's top ``k`` of ``v`` keep their lower bounds ``lo`` above the upper
    bounds ``hi`` of the rest (entries of -inf in ``v``: not candidates)."""
    chosen = torch.zeros_like(v, dtype=torch.bool).scatter_(1, v.topk(k, dim=-1).indices, True)
    low = lo.masked_fill(~chosen, float("inf")).amin(-1)
    high = hi.masked_fill(chosen, float("-inf")).amax(-1)
    return low > high


def once(key, check) -> None:
    """``check()`` the first time ``key`` is seen in this process (an arm benchmarked in
    several groups, or phases, is checked once per key)."""
    if key not in _DONE:
        check()
        _DONE.add(key)


def memo(key, make, tensors=()):
    """``make()``, reused for the same ``key`` and equal ``tensors`` (a route) while among the
    latest ``MEMO_SIZE``; ``key`` None: no reuse."""
    if key is None:
        return make()
    hit = _MEMO.get(key)
    if hit is not None and len(hit[0]) == len(tensors) and all(
            a.shape == b.shape and torch.equal(a, b) for a, b in zip(hit[0], tensors)):
        _MEMO.move_to_end(key)
        return hit[1]
    _MEMO.pop(key, None)
    value = make()
    _MEMO[key] = ([t.clone() for t in tensors], value)
    while len(_MEMO) > MEMO_SIZE:
        _MEMO.popitem(last=False)
    return value


def assert_rule(got, plain, ref64, names) -> None:
    """The arm's results ``got`` (output, gradients) by the tolerance rule against ``plain``
    and ``ref64``, taken as one (each at its own magnitude; compared where they lie: a GPU
    compares gigabytes of float64 in milliseconds, a host in seconds)."""
    got, plain, ref64 = (list(t) for t in (got, plain, ref64))
    assert len(got) == len(plain) == len(ref64) == len(names), (len(got), len(plain),
                                                                len(ref64), names)
    assert_jointly_close_to_ref([t.detach() for t in got], [t.detach() for t in plain],
                                [t.detach().to(F64) for t in ref64], list(names))


def value_and_grads(f, inputs, dtype=None, dy=None):
    """``[f(*inputs)]``, the floating inputs as leaves (cast to ``dtype`` where given: the
    float64 oracle), and with ``dy`` also the gradient of ``sum(out * dy)`` to each."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_(dy is not None)
              if t.is_floating_point() else t for t in inputs]
    with torch.enable_grad():
        out = f(*leaves)
        if dy is None:
            return [out.detach()]
        wanted = [t for t in leaves if t.is_floating_point()]
        return [out.detach(), *torch.autograd.grad(out, wanted, dy.to(out.dtype))]


def route_weights(logits, idx, model):
    """The routing weights of the chosen experts ``idx (T, k)`` (``moe_fn.testing.
    reference_route`` on the given route), computed in float32 at least (as the HF routers
    do)."""
    r = model.routing
    lg = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return reference_route(lg, top_k=model.top_k, score_func=r.get("score_func", "softmax"),
                           norm_topk_prob=bool(r.get("norm_topk_prob")),
                           routed_scaling_factor=r.get("routed_scaling_factor", 1.0),
                           topk_idx=idx).topk_weight


def expert_mlp(rows, gate_up, down, counts, *, fp8=False):
    """SwiGLU experts (HF's halves packing) on rows grouped by expert: the naive loop of
    ``moe_fn.testing.reference_experts``, or with ``fp8`` each GEMM a plain FP8 linear
    (``moe_fn.testing.fp8.fp8_linear``: quantise, then multiply)."""
    if not fp8:
        return reference_experts(rows, gate_up, down, counts)
    outs, start = [], 0
    for e, c in enumerate(counts):
        r = rows[start:start + c]
        start += c
        if c == 0:
            continue
        h = reference_activation(*split_gate_up(fp8_linear(r, gate_up[e])))
        outs.append(fp8_linear(h, down[e]))
    return torch.cat(outs) if outs else rows.new_zeros(0, down.shape[1])


def moe_formula(x, router, gate_up, down, idx, model, *, fp8=False):
    """The MoE layer on the route ``idx (T, k)`` from the formulas, sparse: logits, the
    chosen experts' weights, each (token, k) row through its expert, weighted, summed per
    token."""
    k = model.top_k
    w = route_weights(x @ router.t(), idx, model)
    flat = idx.reshape(-1)
    perm = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    y = expert_mlp(x[perm // k], gate_up, down, counts, fp8=fp8)
    y = y * w.reshape(-1)[perm, None].to(y.dtype)
    return torch.zeros_like(x).index_add(0, perm // k, y)


def check_layer(arm, got, idx, weights, plain_arm, model, x, dy, *, fp8=False,
                residual=False, memo_key=None):
    """An MoE layer arm's results ``got``: ``[out]`` or ``[out, x.grad, and the router's,
    gate_up's and down's gradients]`` under ``sum(out * dy)``, on its route ``idx``, with
    ``weights`` ``(router, gate_up, down)``. The plain arm and the float64 oracle take the
    arm's route (a near-tie in the arm's precision may choose otherwise than float64, which
    no tolerance covers). Plain: on a GPU the plain arm ``plain_arm(x, router, gate_up,
    down, idx)`` (for itself, and on a CPU for every arm, the formulas in the arm's dtype);
    for an FP8 arm a plain quantise-then-matmul. ``residual``: the arm computes
    ``x + layer(x)``. ``memo_key``: arms of one group on one route share the plain and
    float64 results."""
    dy_ = dy if len(got) > 1 else None

    def block(layer):
        return (lambda x, *w: x + layer(x, *w, idx)) if residual else \
            (lambda x, *w: layer(x, *w, idx))

    def formula(x, router, gate_up, down, idx, *, fp8=False):
        return moe_formula(x, router, gate_up, down, idx, model, fp8=fp8)
    if fp8:
        plain_fn, kind = block(lambda *a: formula(*a, fp8=True)), "fp8"
    elif arm == "torch" or not x.is_cuda:
        plain_fn, kind = block(formula), "formula"
    else:
        plain_fn, kind = block(plain_arm), "plain arm"

    def key(what):
        return None if memo_key is None else (memo_key, len(got), what)
    plain = memo(key(kind), lambda: value_and_grads(plain_fn, [x, *weights], dy=dy_), [idx])
    ref64 = memo(key("float64"), lambda: value_and_grads(block(formula), [x, *weights], F64,
                                                          dy_), [idx])
    assert_rule(got, plain, ref64, ["out", "x", "router", "gate_up", "down"][:len(got)])


def plain_layer(model, bias=None):
    """The plain layer arm (``plain.layer_forward``) as ``(x, router, gate_up, down, idx)``
    on a given route."""
    from .plain import layer_forward

    def call(x, router, gate_up, down, idx):
        i = model.inter
        return layer_forward(x, router, gate_up[:, :i].contiguous(),
                             gate_up[:, i:].contiguous(), down, model, bias, topk_idx=idx)
    return call


def linear_route(x, weight, model, bias=None):
    """The plain arm's route of ``x`` (``plain.route`` of ``F.linear``)."""
    from .plain import route

    return route(torch.nn.functional.linear(x, weight), model, bias)[1]


def stable_route(x, router, model):
    """``(stable (T,) bool, route64 (T, k))``: the tokens whose route no computation of the
    logits ``x @ router^T`` in ``x``'s dtype can change (``stable_tokens``) and the float64
    route (``plain.route``), each token's experts in ascending order."""
    from .plain import route

    x64, w64 = f64(x.detach(), router.detach())
    logits64 = torch.nn.functional.linear(x64, w64)
    stable = stable_tokens(logits64, model, x.dtype,
                           abs_logits64=torch.nn.functional.linear(x64.abs(), w64.abs()))
    assert stable.float().mean() > 0.25, "too few well-routed tokens to check the routes"
    return stable, route(logits64, model)[1].sort(-1).values


def assert_route(arm, idx, stable, route64) -> None:
    """The arm's route ``idx (T, k)`` on the ``stable`` tokens as ``route64`` (``stable_route``),
    as sets of experts: equal logits among the chosen come in either order."""
    assert torch.equal(idx[stable].long().sort(-1).values, route64[stable]), \
        f"{arm}: a token routed otherwise than float64 where no rounding can change it"
