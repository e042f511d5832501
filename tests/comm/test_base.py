"""The declared Exchange protocol: an abstract base class whose verbs every exchange
implements, one typed capability, and the small records its moves return."""

from __future__ import annotations

import pytest
import torch

from moe_fn.comm.base import (
    Exchange,
    Gathered,
    Pending,
    Summation,
    check_combine_weights,
)
from moe_fn.comm.deepep import DeepEPExchange
from moe_fn.comm.sorted_rows import AllToAllExchange, LocalExchange
from moe_fn.comm.symm_mem import SymmMemExchange

VERBS = ("layout", "dispatch", "dispatch_backward", "combine", "combine_backward")


def test_the_protocol_is_abstract_in_its_verbs():
    assert Exchange.__abstractmethods__ == frozenset(VERBS)
    with pytest.raises(TypeError, match="abstract"):
        Exchange(num_experts=4, ep_size=1, rank=0, group=None, resources=None)

    class Partial(Exchange):
        backend, summation = "partial", Summation.HOME

        def layout(self, plan):
            return plan
    with pytest.raises(TypeError, match="abstract"):
        Partial(num_experts=4, ep_size=1, rank=0, group=None, resources=None)


@pytest.mark.parametrize("cls,backend,summation", [
    (LocalExchange, "local", Summation.HOME),
    (AllToAllExchange, "all_to_all", Summation.HOME),
    (SymmMemExchange, "symm_mem", Summation.EXPERTS),
    (DeepEPExchange, "deepep", Summation.EXPERTS),
])
def test_every_exchange_implements_the_verbs_and_declares_where_it_sums(cls, backend,
                                                                        summation):
    assert not cls.__abstractmethods__
    assert (cls.backend, cls.summation) == (backend, summation)
    for verb in (*VERBS, "combine_backward_gathered"):
        assert callable(getattr(cls, verb))


def test_gathered_rows_read_the_own_rows_behind_the_source():
    src = torch.arange(6.0).reshape(3, 2)
    own = 10 + torch.arange(4.0).reshape(2, 2)
    g = Gathered(src, torch.tensor([4, 0, 3, 2]), own=own, own_index=torch.tensor([1, 0]))
    want = torch.stack([own[0], src[0], own[1], src[2]])
    assert torch.equal(g.materialize(), want)
    assert Gathered(src).materialize() is src


def test_pending_finishes_once():
    calls = []
    p = Pending(lambda: calls.append(1) or "done")
    assert p.wait() == "done" and p.wait() == "done" and calls == [1]


def test_combine_weights_must_be_those_the_summation_takes():
    class Handle:
        class plan:
            num_tokens, top_k = 3, 2

    home = type("Home", (), {"backend": "local", "summation": Summation.HOME})
    experts = type("Experts", (), {"backend": "deepep", "summation": Summation.EXPERTS})
    rows = torch.zeros(5, 4)
    check_combine_weights(home, torch.zeros(3, 2), rows, Handle)
    check_combine_weights(experts, torch.zeros(5), rows, Handle)
    with pytest.raises(ValueError, match=r"sums a token's rows at home: its combine takes "
                                         r"weights of shape \(3, 2\), got \(5,\)"):
        check_combine_weights(home, torch.zeros(5), rows, Handle)
    with pytest.raises(ValueError, match=r"on the expert side.*\(5,\), got \(3, 2\)"):
        check_combine_weights(experts, torch.zeros(3, 2), rows, Handle)
