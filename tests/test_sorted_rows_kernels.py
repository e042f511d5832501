"""The row all_to_all's moves through their Triton kernels (the interpreter on the CPU):
every row placed straight at its expert-major position, the own rows while the others are
in flight. Each rank's float32 output and gradients must match one float64 layer holding
every expert and every rank's tokens, over gloo."""

from __future__ import annotations

import pytest
import torch

from moe_fn.kernels.activation import interpreting
from tests.dist_utils import run_distributed
from tests.test_layer import EP_CASES, _ep_case

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TOKENS = {2: [6, 4], 3: [5, 0, 7]}  # world 3: a rank without tokens of its own


def _body(rank, world, tokens):
    import moe_fn.kernels as kernels
    from moe_fn.kernels import gather_sum

    calls = []
    real_copy, real_bwd = gather_sum.launch_copy_rows, gather_sum.launch_weighted_gather_sum_bwd

    def copy_rows(*a, **kw):
        calls.append("copy_rows")
        return real_copy(*a, **kw)

    def weighted_bwd(*a, **kw):
        calls.append("weighted_bwd" if kw.get("hi_index") is None else "weighted_bwd_scatter")
        return real_bwd(*a, **kw)
    gather_sum.launch_copy_rows = copy_rows
    gather_sum.launch_weighted_gather_sum_bwd = weighted_bwd
    kernels.use_triton = lambda t: t.dtype in KERNEL_DTYPES
    # Plain routing, fused weighting, top-k = E/ep, and the route steered off expert 0 and
    # off the last rank (which then keeps and receives no row).
    cases = [EP_CASES[0], EP_CASES[1], EP_CASES[3], EP_CASES[4]]
    for combine_impl in ("eager", "fused"):
        for n, kw in enumerate(cases):
            kw = dict(kw, num_experts=4 * world)  # divisible by the world
            if kw["top_k"] == "E/ep":
                kw["top_k"] = kw["num_experts"] // world
            calls.clear()
            _ep_case(rank, world, kw, tokens, 99 + n, dict(combine_impl=combine_impl),
                     dtype=torch.float32)
            if combine_impl == "fused" and kw.get("score_apply", "post") == "post":
                # The dispatch places own rows and arrivals; the weighted combine's backward
                # writes the own rows' gradients in place and places the arrivals.
                assert calls == ["copy_rows", "copy_rows", "weighted_bwd_scatter",
                                 "copy_rows"], calls
            elif combine_impl == "eager" and "row_weighting_impl" not in kw:
                # The routing weights travel packed with the dispatch (its gather path); the
                # combine's backward, a dispatch of the output gradient, places its rows.
                assert calls == ["copy_rows", "copy_rows"], calls


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 3])
def test_row_moves_through_kernels_match_one_float64_layer(world):
    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported")
    run_distributed(_body, world, TOKENS[world])
