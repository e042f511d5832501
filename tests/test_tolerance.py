"""The tolerance rule's helpers (moe_fn.testing): the bound they enforce and what they refuse."""

import pytest
import torch

from moe_fn.testing import (
    assert_all_close_to_ref,
    assert_close_to_ref,
    assert_jointly_close_to_ref,
    error_bound,
    value_and_grads,
)


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
