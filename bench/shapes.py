"""The benchmarks' shapes and the moe_fn option sets their arms run (named here only).

GPU shapes (bf16): the Qwen3-30B-A3B layer, Mixtral-8x7B's, and DeepSeek-V3's as one rank
of eight holds it; CPU shapes (float32): small ones, so that ``pytest bench
--benchmark-only`` runs in minutes on two cores.
"""

from __future__ import annotations

import attrs

from moe_fn import MoEConfig

from .harness import HAS_CUDA


@attrs.frozen
class Model:
    """One MoE layer's sizes and routing.

    name: readable id. hidden H, inter I (per expert), experts E, top_k k; routing: the
    MoEConfig routing options. tokens: tokens per benchmark call (router, layout, combine,
    layer). local_experts / expert_rows: the experts one GPU holds and the rows they
    receive in the per-rank expert benchmarks (grouped linear, expert MLP).
    """

    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    routing: dict = attrs.field(factory=dict)
    tokens: int = 8192
    local_experts: int = 0
    expert_rows: int = 0
    family: str = ""

    @property
    def weights_key(self) -> str:
        """Models that differ only in their token count share weights."""
        return self.family or self.name

    @property
    def rows(self) -> int:
        """(token, k) rows of one call: the activation's and the combine's."""
        return self.tokens * self.top_k

    def config(self, **options) -> MoEConfig:
        return MoEConfig(hidden_size=self.hidden, intermediate_size=self.inter,
                         num_experts=self.experts, top_k=self.top_k,
                         **{**self.routing, **options})

    def with_tokens(self, tokens: int) -> Model:
        return attrs.evolve(self, name=f"{self.name}-t{tokens}", tokens=tokens,
                            family=self.weights_key)


SOFTMAX = dict(score_func="softmax", norm_topk_prob=True)
DEEPSEEK = dict(score_func="sigmoid", norm_topk_prob=True, n_group=8, topk_group=4,
                score_correction_bias=True, routed_scaling_factor=2.5)

QWEN3 = Model("qwen3-30b-a3b", 2048, 768, 128, 8, SOFTMAX, local_experts=16,
              expert_rows=131072)
# The experts of the one-GPU Qwen3-30B-A3B layer at 8192 tokens: all 128, 65,536 rows.
QWEN3_ONE_GPU = Model("qwen3-30b-a3b-e128", 2048, 768, 128, 8, SOFTMAX, local_experts=128,
                      expert_rows=65536)
MIXTRAL = Model("mixtral-8x7b", 4096, 14336, 8, 2, SOFTMAX, local_experts=8,
                expert_rows=16384)
DEEPSEEK_V3 = Model("deepseek-v3", 7168, 2048, 256, 8, DEEPSEEK, local_experts=32,
                    expert_rows=65536)
# A one-GPU layer holding the 32 experts one rank of EP8 holds, routed among themselves
# with DeepSeek-V3's rule (8 groups of 4, the best 4 groups).
DEEPSEEK_V3_RANK = Model("deepseek-v3-32e", 7168, 2048, 32, 8, DEEPSEEK)

SMALL = Model("small", 256, 128, 16, 4, SOFTMAX, tokens=512, local_experts=8,
              expert_rows=2048)
SMALL_GROUPED = Model("small-grouped", 256, 128, 32, 4,
                      dict(DEEPSEEK, n_group=4, topk_group=2), tokens=512, local_experts=8,
                      expert_rows=2048)

if HAS_CUDA:
    KERNEL_MODELS = (QWEN3, MIXTRAL, DEEPSEEK_V3)
    # The expert MLP also at the one-GPU layer's shape, where FP8 gains least.
    EXPERT_MODELS = (*KERNEL_MODELS, QWEN3_ONE_GPU)
    LAYER_MODELS = (*(QWEN3.with_tokens(t) for t in (2048, 4096, 8192, 16384)), MIXTRAL,
                    DEEPSEEK_V3_RANK)
    CHECKPOINT_MODELS = (QWEN3,)
else:
    KERNEL_MODELS = (SMALL, SMALL_GROUPED)
    EXPERT_MODELS = KERNEL_MODELS
    LAYER_MODELS = (SMALL, SMALL_GROUPED)
    CHECKPOINT_MODELS = (SMALL,)

# The moe_fn arms of the layer benchmarks: the default config (the fastest), the reference
# path (impl="reference": the eager weighting and combine, the oracle), and the FP8 experts.
MOE_FN_ARMS = {"moe_fn": {}, "moe_fn-reference": dict(impl="reference"),
               "moe_fn-fp8": dict(expert_precision="fp8_rowwise")}
# The recompute-combine skip.
SKIP = dict(skip_recompute_combine=True)


def names(models) -> list[str]:
    """Parametrize benchmarks by name: pytest-benchmark's JSON records params as they are."""
    return [m.name for m in models]


def get(name: str) -> Model:
    return _BY_NAME[name]


_BY_NAME = {m.name: m for m in (*EXPERT_MODELS, *LAYER_MODELS, *CHECKPOINT_MODELS)}


def layer_flops(model: Model) -> int:
    """Forward FLOPs of the experts' GEMMs: 2 * T * k * H * 3I (backward: twice that)."""
    return 2 * model.tokens * model.top_k * model.hidden * 3 * model.inter
