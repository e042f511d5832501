"""The suite catches deliberate wrong changes: under each mutation of ``tests/mutations.py``
(monkeypatched in this process, undone after) the chosen tests fail, and without one they
all pass."""

from __future__ import annotations

import pytest

from tests import test_balance, test_fused_combine, test_layer
from tests.mutations import MUTATIONS


def _layer(_mp):
    """tests/test_layer.py::test_layer_matches_the_reference[kw0]: float64 against the
    naive reference."""
    test_layer.test_layer_matches_the_reference({})


def _fused(mp):
    """tests/test_fused_combine.py::test_fused_combine_matches_the_reference_single_rank:
    float32 by the tolerance rule."""
    test_fused_combine.test_fused_combine_matches_the_reference_single_rank(mp)


def _balance(_mp):
    """tests/test_balance.py::test_losses_train_as_the_naive_objective[shape0-None-kw0]:
    the balancing losses' gradients against the naive objective's."""
    test_balance.test_losses_train_as_the_naive_objective({}, (2, 5, test_balance.H), None)


# Each mutation, and the tests that must fail under it.
CATCHES = {
    "negated_output": [_layer, _fused],
    "bf16_float32_path": [_fused],
    "dropped_balance_term": [_balance],
    "nan_in_tolerance_input": [_fused],
    "lowest_experts_route": [_layer],
}
CHOSEN = [_layer, _fused, _balance]


def test_every_mutation_has_tests_that_catch_it():
    assert set(CATCHES) == set(MUTATIONS)


@pytest.mark.parametrize("check", CHOSEN, ids=lambda f: f.__name__.strip("_"))
def test_the_chosen_tests_pass_unmutated(check):
    with pytest.MonkeyPatch.context() as mp:
        check(mp)


@pytest.mark.parametrize("mutation", sorted(CATCHES))
def test_the_chosen_tests_fail_under_each_mutation(mutation):
    for check in CATCHES[mutation]:
        with pytest.MonkeyPatch.context() as mp:
            MUTATIONS[mutation](mp.setattr)
            with pytest.raises(AssertionError):
                check(mp)
