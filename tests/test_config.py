"""Configuration fails closed: every unsupported option or combination names the fix, and
exchange problems surface before any collective runs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_fn import MoEConfig, MoELayer
from moe_fn.comm import deepep
from tests.dist_utils import run_distributed

BASE = dict(hidden_size=16, intermediate_size=8, num_experts=8, top_k=2)


@pytest.mark.parametrize("kw,match", [
    (dict(top_k=9), "top_k"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(activation="relu"), "activation"),
    (dict(activation="swiglu", activation_alpha=1.0),
     "activation_alpha is only used by 'swiglu_oai'.*activation_alpha=None"),
    (dict(activation="swiglu_oai", activation_limit=-1.0), "activation_limit must be"),
    # Past float32's range the float32 activation math overflows (a clamp refused it).
    (dict(activation="swiglu_clamped", activation_limit=1e300),
     "activation_limit must be.*at most"),
    (dict(activation="swiglu_oai", activation_alpha=-1e39), "activation_alpha must be.*at most"),
    (dict(gate_up_layout="rows"), "gate_up_layout"),
    (dict(score_func="relu"), "score_func"),
    (dict(n_group=3), "n_group"),
    (dict(n_group=4, topk_group=5), "topk_group"),
    (dict(n_group=4, topk_group=1, top_k=3), "top_k"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    (dict(ep_size=3), "ep_size"),
    (dict(comm_backend="local", ep_size=2), "comm_backend='local'"),
    (dict(all_to_all_dedup=True), "'all_to_all_dedup' was removed.*use comm_backend="),
    (dict(comm_backend="all_to_all", ep_size=2, all_to_all_dedup=False),
     "'all_to_all_dedup' was removed"),
    (dict(all_to_all_transport="symm_mem"),
     "'all_to_all_transport' was removed.*'symm_mem' is now comm_backend='symm_mem'"),
    (dict(all_to_all_transport="registered"), "'registered' and 'copy_engine' were removed"),
    (dict(comm_backend="symm_mem", ep_size=64), "at most 63 ranks.*use comm_backend='all_to_all'"),
    (dict(comm_backend="deepep", ep_size=3, num_experts=9), "ep_size in"),
    (dict(comm_backend="deepep", ep_size=2, comm_num_sm=21), "comm_num_sm must be even"),
    (dict(comm_backend="deepep", ep_size=2, hidden_size=9000), "DeepEP cannot carry"),
    (dict(comm_backend="deepep", ep_size=2, hidden_size=12), "DeepEP cannot carry"),
    (dict(row_weighting_impl="fused"), "'row_weighting_impl' was removed: use impl.*impl='fused'"),
    (dict(combine_impl="eager"), "'combine_impl' was removed: use impl.*impl='reference'"),
    (dict(impl="eager"), "impl='eager' was removed: use impl='reference'"),
    (dict(impl="triton"), r"impl must be one of \('fused', 'reference'\)"),
    (dict(overlap_weight_grad=True), "ep_size=1"),
    (dict(expert_bias=True, score_apply="pre"), "expert_bias"),
    (dict(norm_topk_prob=1), "norm_topk_prob"),
    (dict(skip_recompute_combine=True, recompute_in_checkpoint=False),
     "set skip_recompute_combine=False"),
    (dict(recompute_in_checkpoint=0), "recompute_in_checkpoint must be a bool"),
    (dict(activation="swiglu_oai", activation_limit=True), "activation_limit must be a number"),
    (dict(activation="swiglu_oai", activation_alpha="1.5"), "activation_alpha must be a number"),
    (dict(activation="swiglu_oai", activation_alpha=torch.tensor(1.0)),
     "activation_alpha must be a number"),
    (dict(comm_backend="deepep", ep_size=2, num_experts=512),
     r"at most 128 experts per rank, got 256.*up to 8\) or use comm_backend='all_to_all'"),
])
def test_invalid_options_name_the_option(kw, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**BASE, **kw})


def test_deepep_missing_says_how_to_get_it(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_deep_ep(name, *a, **kw):
        if name == "deep_ep":
            raise ImportError("No module named 'deep_ep'")
        return real_import(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_deep_ep)
    with pytest.raises(ImportError, match="build DeepEP from its source"):
        deepep.import_deep_ep()


def test_layer_rejects_a_non_config():
    with pytest.raises(TypeError, match="MoEConfig"):
        MoELayer(dict(BASE))


def _group_size_mismatch(rank, world):
    cfg = MoEConfig(**BASE, comm_backend="all_to_all", ep_size=4)
    with pytest.raises(ValueError, match="process group has 2 ranks but ep_size is 4: pass "
                       "a process group of 4 ranks, or set ep_size=2"):
        MoELayer(cfg)
    # The local exchange over a group of several ranks: the fix is ep_size, not only the
    # backend (which alone would fail on ep_size next).
    with pytest.raises(ValueError, match="process group of 2 ranks: for expert parallelism "
                       "over it set ep_size=2 and comm_backend='all_to_all', 'symm_mem' or "
                       "'deepep'"):
        MoELayer(MoEConfig(**BASE), dist.group.WORLD)
    # No rank was left inside a collective: the group still works.
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world


@pytest.mark.multiproc
def test_group_size_mismatch_fails_before_any_collective():
    run_distributed(_group_size_mismatch, 2)


@pytest.mark.parametrize("value,want", [(None, "default"), ("off", False), ("NO", False),
                                        ("False", False), ("0", False), ("", False),
                                        ("1", True), ("yes", True)])
def test_environment_switches_parse_alike(monkeypatch, value, want):
    """MOE_FN_DEBUG, MOE_FN_AUTOTUNE and MOE_FN_FAST_LAUNCH read off/no/false the same way
    (MOE_FN_DEBUG=off turns the checks off, not on as any non-empty string would)."""
    from moe_fn._checks import env_flag
    if value is None:
        monkeypatch.delenv("MOE_FN_TEST_SWITCH", raising=False)
    else:
        monkeypatch.setenv("MOE_FN_TEST_SWITCH", value)
    for default in (True, False):
        expected = default if want == "default" else want
        assert env_flag("MOE_FN_TEST_SWITCH", default) is expected


def test_debug_switch_takes_a_bool():
    import moe_fn
    with pytest.raises(TypeError, match="takes a bool"):
        moe_fn.set_debug_checks("False")


def test_layer_dtype_and_input_must_be_floating_point():
    with pytest.raises(TypeError, match="dtype must be float16, bfloat16, float32 or float64"):
        MoELayer(MoEConfig(**BASE), dtype=torch.complex64)
    layer = MoELayer(MoEConfig(**BASE))
    for dtype in (torch.int64, torch.float8_e4m3fn):  # float8: no kernel or pair takes it
        with pytest.raises(TypeError, match=f"x must be float16, bfloat16, float32 or "
                                            f"float64, got {dtype}"):
            layer(torch.ones(3, 16).to(dtype))


def test_process_group_must_be_a_group():
    with pytest.raises(TypeError, match="process_group must be a torch.distributed "
                                        "ProcessGroup.*device=..."):
        MoELayer(MoEConfig(**BASE), "cpu")


def test_comm_num_sm_must_leave_sms_for_the_gemms():
    """Checked against the GPU's SM count at the first expert-parallel call on CUDA."""
    from moe_fn.layer_checks import check_comm_num_sm
    check_comm_num_sm(24, 132)
    with pytest.raises(ValueError, match="comm_num_sm=132 leaves none of this GPU's 132 SMs"):
        check_comm_num_sm(132, 132)


def test_only_what_takes_sms_reads_comm_num_sm():
    """The first CUDA forward checks that comm_num_sm leaves SMs to the GEMMs only where
    something takes them: a GPU with few SMs (a MIG slice) runs the NCCL exchanges,
    which never read it."""
    from moe_fn.layer_checks import takes_comm_sms

    ep = dict(BASE, comm_backend="all_to_all", ep_size=2)
    assert not takes_comm_sms(MoEConfig(**BASE))
    assert not takes_comm_sms(MoEConfig(**ep))
    assert takes_comm_sms(MoEConfig(**dict(ep, comm_backend="symm_mem")))
    assert takes_comm_sms(MoEConfig(**ep, overlap_weight_grad=True))
    assert takes_comm_sms(MoEConfig(**dict(ep, comm_backend="deepep")))


def test_every_option_is_documented_in_its_group_and_in_help():
    import pydoc

    import attrs

    from moe_fn.config import GROUPS

    text = pydoc.render_doc(MoEConfig, renderer=pydoc.plaintext)
    for f in attrs.fields(MoEConfig):
        assert f.metadata["group"] in GROUPS and f.metadata["doc"].strip(), f.name
        assert f"``{f.name}``" in text, f.name
    assert all(title in text for title in GROUPS.values())


def test_docs_config_md_is_generated_from_the_options():
    """docs/config.md is what options_markdown() writes (regenerate it after changing an
    option: the command is in its first lines)."""
    import os

    from moe_fn.config import options_markdown

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                        "config.md")
    with open(path) as f:
        assert f.read() == options_markdown()


def test_an_option_needs_a_known_group_and_documentation():
    import attrs

    from moe_fn.config import _documented, option

    with pytest.raises(ValueError, match="group must be one of"):
        option(1, group="no such group", doc="x")

    @attrs.frozen(kw_only=True)
    class Partial:
        a: int = option(1, group="routing", doc="documented")
        b: int = 2

    with pytest.raises(TypeError, match=r"without a group and documentation.*\['b'\]"):
        _documented(Partial)


@pytest.mark.parametrize("name,value,replacement", [
    ("row_weighting_impl", "fused", "impl='fused'"),
    ("combine_impl", "eager", "impl='reference'"),
    ("all_to_all_transport", "symm_mem", "comm_backend='symm_mem'"),
    ("all_to_all_dedup", True, "comm_backend="),
])
def test_a_removed_option_names_its_replacement_in_moe_config_and_convert(name, value,
                                                                          replacement):
    from moe_fn.hf.convert import _check_options
    from moe_fn.hf.presets import PRESETS

    with pytest.raises(ValueError, match=f"{name}' was removed: use .*{replacement}"):
        MoEConfig(**BASE, **{name: value})
    with pytest.raises(ValueError, match=f"{name}' was removed: use .*{replacement}"):
        _check_options({name: value}, None, next(iter(PRESETS.values())))
