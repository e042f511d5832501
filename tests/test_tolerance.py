"""The tolerance rule's helpers (moe_fn.testing): the bound they enforce and what they refuse."""

import re

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from moe_fn.testing import (
    assert_all_close_to_ref,
    assert_close_to_ref,
    assert_jointly_close_to_ref,
    error_bound,
    max_error,
    rounding_step,
    value_and_grads,
)

NON_FINITE = (float("nan"), float("inf"), float("-inf"))


def test_bound_is_twice_plain_error_plus_one_step():
    ref = torch.tensor([1.0, -4.0], dtype=torch.float64)
    plain = torch.tensor([1.0 + 2**-20, -4.0])
    step = torch.finfo(torch.float32).eps * 4.0
    assert error_bound(plain, ref) == 2 * 2**-20 + step
    assert_close_to_ref(torch.tensor([1.0 + 2 * 2**-20, -4.0 - step]), plain, ref)
    with pytest.raises(AssertionError, match="error against float64"):
        assert_close_to_ref(torch.tensor([1.0 + 4 * 2**-20, -4.0 - step]), plain, ref)
    with pytest.raises(AssertionError, match="got holds 1 non-finite"):
        assert_close_to_ref(torch.tensor([float("nan"), -4.0]), plain, ref)
    with pytest.raises(AssertionError, match="dtypes differ"):
        assert_close_to_ref(plain.double(), plain, ref)


def test_sequences_check_each_entry_and_none_together():
    ref = [torch.ones(2, dtype=torch.float64), None]
    plain = [torch.ones(2), None]
    assert_all_close_to_ref([torch.ones(2), None], plain, ref)
    with pytest.raises(AssertionError, match="b: error"):
        assert_all_close_to_ref([torch.ones(2), None, torch.full((2,), 1.5)],
                                plain + [torch.ones(2)],
                                ref + [torch.ones(2, dtype=torch.float64)], ("a", "n", "b"))
    with pytest.raises(AssertionError, match="None in some but not all"):
        assert_all_close_to_ref([torch.ones(2), torch.ones(2)], plain, ref)
    with pytest.raises(AssertionError, match="lengths differ"):
        assert_all_close_to_ref([torch.ones(2)], plain, ref)


def test_value_and_grads_casts_floats_and_passes_the_rest():
    x = torch.tensor([1.0, 2.0])
    idx = torch.tensor([1, 0])
    y, gx, gi, gs = value_and_grads(lambda x, i, s: x[i] * s, [x, idx, 3.0],
                                    dtype=torch.float64)
    assert y.dtype == gx.dtype == torch.float64 and gi is None and gs is None
    assert torch.equal(y, torch.tensor([6.0, 3.0], dtype=torch.float64))
    assert torch.equal(gx, 2 * 3 * torch.tensor([3.0, 6.0], dtype=torch.float64))  # d sum y^2
    assert not x.requires_grad  # the inputs themselves are left alone
    _, g = value_and_grads(lambda x: x.sum(), [x], loss=lambda y: 5 * y)
    assert torch.equal(g, torch.full((2,), 5.0))
    # The default loss keeps float64 in float64 (a float32 one would round 1 + 2**-40).
    _, g = value_and_grads(lambda x: x, [torch.tensor([1 + 2**-40], dtype=torch.float64)])
    assert g.item() == 2 * (1 + 2**-40)


def test_joint_rule_scales_each_entry_and_names_the_worst():
    big, small = torch.full((3,), 1000.0, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    ref = [big, small, None]
    plain = [big.float() + 1e-3, small.float(), None]  # plain's worst: 1e-6 of its scale
    # Each entry against its own magnitude: 1.5e-6 of 1 passes beside plain's 1e-6 of 1000.
    assert_jointly_close_to_ref([big.float(), small.float() + 1.5e-6, None], plain, ref)
    with pytest.raises(AssertionError, match="small: error against float64"):
        assert_jointly_close_to_ref([big.float(), small.float() + 3e-6, None], plain, ref,
                                    ("big", "small", "none"))
    with pytest.raises(AssertionError, match="small: got holds 2 non-finite"):
        assert_jointly_close_to_ref([big.float(), small.float() * float("nan"), None], plain,
                                    ref, ("big", "small", "none"))
    zero = [torch.zeros(2, dtype=torch.float64)]  # an all-zero oracle: absolute errors
    with pytest.raises(AssertionError, match="error against float64"):
        assert_jointly_close_to_ref([torch.full((2,), 1e-3)], [torch.zeros(2)], zero)
    with pytest.raises(AssertionError, match="None in some but not all"):
        assert_jointly_close_to_ref([big.float(), small.float(), small.float()], plain, ref)


def test_a_check_that_cannot_fail_is_refused():
    """Where plain is off by half the result or more (a gradient cancelling to rounding
    noise), the bound reaches the result's magnitude and even zero would pass: refused."""
    ref = torch.tensor([1e-7, -2e-7], dtype=torch.float64)
    plain = torch.tensor([-1e-7, 1e-7])
    with pytest.raises(AssertionError, match="cannot fail"):
        assert_close_to_ref(torch.zeros(2), plain, ref, "w")
    fine = torch.tensor([3.0, -1.0], dtype=torch.float64)
    with pytest.raises(AssertionError, match="^noise: the check cannot fail"):
        assert_jointly_close_to_ref([fine.float(), torch.zeros(2)], [fine.float(), plain],
                                    [fine, ref], ["fine", "noise"])
    # Just below: plain off by less than half keeps the check able to fail.
    assert_close_to_ref(ref.float(), (ref * 0.6).float(), ref)
    with pytest.raises(AssertionError, match="error against float64"):
        assert_close_to_ref(torch.zeros(2), (ref * 0.6).float(), ref)


def _three_entries():
    """Three entries of different magnitudes and a ``None``, each honest: got is plain."""
    big = torch.full((3,), 1000.0, dtype=torch.float64)
    mid = torch.tensor([[2.0, -3.0], [5.0, 0.5]], dtype=torch.float64)
    small = torch.ones(2, dtype=torch.float64)
    ref = [big, mid, small, None]
    plain = [big.float() + 1e-3, mid.float(), small.float(), None]
    got = [t if t is None else t.clone() for t in plain]
    return got, plain, ref, ("big", "mid", "small", "none")


@pytest.mark.parametrize("bad", NON_FINITE, ids=("nan", "inf", "-inf"))
@pytest.mark.parametrize("arm", ("got", "plain", "ref64"))
@pytest.mark.parametrize("helper", (assert_all_close_to_ref, assert_jointly_close_to_ref),
                         ids=("each", "joint"))
def test_a_non_finite_value_fails_wherever_it_sits(helper, arm, bad):
    """Every element of every entry, first, middle or last, in each of the three arms."""
    got, plain, ref, names = _three_entries()
    helper(got, plain, ref, names)
    for e, name in enumerate(names[:3]):
        for i in range(ref[e].numel()):
            arms = dict(zip(("got", "plain", "ref64"), _three_entries()[:3]))
            t = arms[arm][e].clone()
            t.view(-1)[i] = bad
            arms[arm][e] = t
            index = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), t.shape))
            with pytest.raises(AssertionError,
                               match=rf"^{name}: {arm} holds 1 non-finite .* at index "
                                     rf"{re.escape(str(index))}$"):
                helper(arms["got"], arms["plain"], arms["ref64"], names)


@pytest.mark.parametrize("bad", NON_FINITE, ids=("nan", "inf", "-inf"))
def test_single_tensor_helpers_refuse_non_finite_values(bad):
    ref = torch.tensor([1.0, -4.0, 2.0], dtype=torch.float64)
    plain = ref.float()
    for i in range(3):
        for arm in ("got", "plain", "ref64"):
            arms = {"got": plain.clone(), "plain": plain.clone(), "ref64": ref.clone()}
            arms[arm][i] = bad
            with pytest.raises(AssertionError, match=rf"^x: {arm} holds 1 non-finite .*"
                                                     rf"at index \({i},\)$"):
                assert_close_to_ref(arms["got"], arms["plain"], arms["ref64"], "x")
        bad_ref, bad_plain = ref.clone(), plain.clone()
        bad_ref[i], bad_plain[i] = bad, bad
        with pytest.raises(AssertionError, match="ref64 holds 1 non-finite"):
            rounding_step(torch.float32, bad_ref)
        with pytest.raises(AssertionError, match="ref64 holds 1 non-finite"):
            max_error(plain, bad_ref)
        with pytest.raises(AssertionError, match="compared holds 1 non-finite"):
            max_error(bad_plain, ref)
        with pytest.raises(AssertionError, match="plain holds 1 non-finite"):
            error_bound(bad_plain, ref)
        with pytest.raises(AssertionError, match="ref64 holds 1 non-finite"):
            error_bound(plain, bad_ref)
    with pytest.raises(AssertionError, match=r"at index \(\)"):  # a 0-d tensor
        assert_close_to_ref(torch.tensor(bad), torch.tensor(1.0),
                            torch.tensor(1.0, dtype=torch.float64))


# --- Property: honest results pass, any single corrupted element of a result fails. ---

@st.composite
def honest_cases(draw):
    """1-3 entries, each a small matmul of inputs in ``dtype``: ``ref64`` the float64 product
    of those inputs, ``plain`` torch's product in ``dtype``, and ``got`` one of two results
    the rule must accept: plain itself, or the float64 product correctly rounded."""
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    got, plain, ref = [], [], []
    for _ in range(draw(st.integers(1, 3))):
        m, k, n = (draw(st.integers(1, 6)) for _ in range(3))
        scale = 2.0 ** draw(st.integers(-12, 12))
        a = (torch.randn(m, k, generator=gen, dtype=torch.float64) * scale).to(dtype)
        b = torch.randn(k, n, generator=gen, dtype=torch.float64).to(dtype)
        r = a.double() @ b.double()
        p = a @ b
        ref.append(r)
        plain.append(p)
        got.append(p.clone() if draw(st.booleans()) else r.to(dtype))
    return dtype, got, plain, ref


def _margin_bounds(plain, ref, dtype):
    """The rule's bounds, computed here from the formula: per entry (absolute) and joint
    (in units of each entry's magnitude)."""
    eps = torch.finfo(dtype).eps
    each = [2 * (p.double() - r).abs().max().item() + eps * r.abs().max().item()
            for p, r in zip(plain, ref)]
    joint = 2 * max((p.double() - r).abs().max().item() / r.abs().max().item()
                    for p, r in zip(plain, ref)) + eps
    return each, joint


@settings(max_examples=80, deadline=None, derandomize=True)
@given(case=honest_cases(), data=st.data())
def test_property_honest_passes_and_any_corrupted_element_fails(case, data):
    dtype, got, plain, ref = case
    names = [f"e{i}" for i in range(len(got))]
    assert_jointly_close_to_ref(got, plain, ref, names)
    assert_all_close_to_ref(got, plain, ref, names)

    kinds = ["nan", "inf", "-inf", "sign flip"] + (["bf16"] if dtype == torch.float32 else [])
    kind = data.draw(st.sampled_from(kinds), label="kind")
    e = data.draw(st.integers(0, len(got) - 1), label="entry")
    g, r = got[e].double().reshape(-1), ref[e].reshape(-1)
    each, joint = _margin_bounds(plain, ref, dtype)
    if kind in ("nan", "inf", "-inf"):
        i = data.draw(st.integers(0, g.numel() - 1), label="element")
        value = float(kind)
        message = rf"^e{e}: got holds 1 non-finite"
    else:
        # The corrupted element's error, well beyond both bounds, so the rule must refuse it.
        if kind == "sign flip":
            wrong = (-got[e]).reshape(-1)
        else:
            wrong = got[e].to(torch.bfloat16).to(dtype).reshape(-1)
        off = (wrong.double() - r).abs()
        scale = r.abs().max().item()
        eligible = ((off > 4 * each[e]) & (off / scale > 4 * joint)).nonzero().flatten()
        assume(eligible.numel() > 0)
        i = int(eligible[data.draw(st.integers(0, eligible.numel() - 1), label="pick")])
        value = wrong[i].item()
        message = rf"^e{e}: error against float64"
    bad = got[e].clone()
    bad.view(-1)[i] = value
    corrupted = got[:e] + [bad] + got[e + 1:]
    with pytest.raises(AssertionError, match=message):
        assert_jointly_close_to_ref(corrupted, plain, ref, names)
    with pytest.raises(AssertionError, match=message):
        assert_all_close_to_ref(corrupted, plain, ref, names)
    with pytest.raises(AssertionError, match=message.replace(f"e{e}", "t")):
        assert_close_to_ref(bad, plain[e], ref[e], "t")
