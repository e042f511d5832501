"""Convert a Hugging Face MoE model with moe_fn and train it with gradient checkpointing.

A small Qwen3-MoE is built from a config with random weights (no download). One copy is
converted with ``moe_fn.hf.convert``, which runs every sparse MoE block on a MoELayer in
place, keeping HF's parameter names and shapes; the other stays as transformers wrote it.
Both train the same steps on the same batches under HF's reentrant gradient
checkpointing, and the example checks that their losses and final parameters agree (the
batches are random tokens, so the loss stays near ln 256 = 5.55: the point is the
agreement, not learning).

    python examples/hf_convert.py            # needs transformers (pip install -e ".[hf]")
    python examples/hf_convert.py --steps 10

It exits non-zero if the converted model does not match the original.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import transformers

import moe_fn.hf

VOCAB, SEQ, LR = 256, 32, 1e-3
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
              norm_topk_prob=True, max_position_embeddings=SEQ, tie_word_embeddings=False)
# float32 runs of the same function differ by rounding only: the losses agree to ~1e-6;
# one AdamW step can turn a rounding-level gradient difference on an element whose
# gradient is near AdamW's eps into a visible fraction of lr, hence 0.1 * lr on parameters.
TOL_LOSS, TOL_PARAM = 5e-5, 0.1 * LR


def build(seed: int) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(**CONFIG)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        # Routers with N(0, 1) weights choose their top-2 experts by clear margins, so
        # rounding never flips a token's route between the two models.
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
    return model


def enable_checkpointing(model) -> None:
    # Reentrant, as moe_fn's recompute skip needs; pass use_reentrant explicitly, since
    # without it transformers picks the non-reentrant mode.
    kwargs = {"use_reentrant": True}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def train(model, batches) -> list[float]:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    # The matrices here are tiny: on a CPU, more threads cost more than they save.
    torch.set_num_threads(1)
    reference = build(args.seed)
    model = copy.deepcopy(reference)
    # Any MoEConfig option that does not change what is computed can be passed here.
    moe_fn.hf.convert(model, skip_recompute_combine=True)
    blocks = moe_fn.hf.converted_blocks(model)
    print(f"converted {len(blocks)} Qwen3MoeSparseMoeBlock(s) to MoELayers: "
          f"{', '.join(name for name, _ in blocks)}")
    same = {k: v.shape for k, v in model.state_dict().items()} == \
        {k: v.shape for k, v in reference.state_dict().items()}
    print(f"state_dict: {len(model.state_dict())} tensors, HF's names and shapes: {same}")
    for m in (model, reference):
        enable_checkpointing(m)

    g = torch.Generator().manual_seed(args.seed + 1)
    batches = [torch.randint(0, VOCAB, (args.batch, SEQ), generator=g)
               for _ in range(args.steps)]
    print(f"training both models {args.steps} steps with HF reentrant gradient checkpointing")
    ours, theirs = train(model, batches), train(reference, batches)
    print(f"{'step':>4}  {'moe_fn':>11}  {'transformers':>12}")
    for i, (a, b) in enumerate(zip(ours, theirs)):
        print(f"{i + 1:>4}  {a:>11.7f}  {b:>12.7f}")

    d_loss = max(abs(a - b) for a, b in zip(ours, theirs))
    final, ref_final = model.state_dict(), reference.state_dict()
    d_param = max((final[k] - ref_final[k]).abs().max().item() for k in final)
    ok = same and d_loss <= TOL_LOSS and d_param <= TOL_PARAM
    print(f"converted vs transformers: max |d loss| {d_loss:.2e} (tol {TOL_LOSS:.0e}), "
          f"max |d param| {d_param:.2e} (tol {TOL_PARAM:.0e})  {'MATCH' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
