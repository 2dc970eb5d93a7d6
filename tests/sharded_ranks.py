"""Run by ``torch.distributed.run`` from tests/e2e/test_data_parallel.py: each rank shards a LoRA policy's frozen base
(``trainer.generation.distributed.shard_frozen_base``) and checks it against the same policy unsharded, writing what it
found to ``<out>/rank<N>.json``. Arguments: model folder, precision, out folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from trainer.builtin_models.tiny_arith import build_tokenizer
from trainer.generation import distributed
from trainer.generation.models import autocast
from trainer.generation.rollout import generate, left_pad
from trainer.generation.rollout_engine import HFRolloutEngine, SamplingParams
from trainer.loops.engine import load_policy
from trainer.spec.lora import LoraSpec


def main(model: str, precision: str, out: Path) -> None:
    world = distributed.from_environment()
    distributed.initialise(world)
    cpu = torch.device("cpu")
    whole = load_policy(model, LoraSpec(), device=cpu, precision=precision, seed=0).model  # type: ignore[arg-type]
    sharded = load_policy(model, LoraSpec(), device=cpu, precision=precision, seed=0).model  # type: ignore[arg-type]
    with torch.no_grad():  # LoRA B starts at 0: move it, alike in both, so that the adapter counts
        for a, b in zip(whole.parameters(), sharded.parameters(), strict=True):
            if a.requires_grad:
                a.add_(0.05)
                b.add_(0.05)
    sharding = distributed.shard_frozen_base(sharded, world, cpu)
    # Loaded by rank 0 alone: the other rank holds the structure on the meta device and receives its shard
    received = load_policy(model, LoraSpec(), device=cpu, precision=precision, seed=0, weights=world.main).model  # type: ignore[arg-type]  # fmt: skip
    with torch.no_grad():
        for p in received.parameters():
            if p.requires_grad and not p.is_meta:
                p.add_(0.05)
    received_sharding = distributed.shard_frozen_base(received, world, cpu)
    tok = build_tokenizer()
    texts = ["12+3=", "1+1=", "123+456="] if world.rank == 0 else ["9+9="]  # uneven shares
    ids, mask = left_pad([tok.encode(t) for t in texts], tok.pad_token_id)
    with autocast(precision, cpu):  # type: ignore[arg-type]
        a = whole(input_ids=ids, attention_mask=mask).logits.float()
        b = sharded(input_ids=ids, attention_mask=mask).logits.float()
        with torch.no_grad():
            c = received(input_ids=ids, attention_mask=mask).logits.float()
    a.logsumexp(-1).sum().backward()
    b.logsumexp(-1).sum().backward()
    grads = [(p.grad, q.grad) for p, q in zip(whole.parameters(), sharded.parameters(), strict=True) if p.requires_grad]
    # Rank 1's row ends at its first token (every token stops it), rank 0's run on: rank 1 decodes on with them.
    stop = list(range(len(tok))) if world.rank == 1 else None
    with torch.no_grad():
        kw = {"max_new_tokens": 24, "eos_id": tok.eos_token_id, "pad_id": tok.pad_token_id, "temperature": 1.0,
              "precision": precision, "row_seeds": list(range(len(texts))), "stop_ids": stop}  # fmt: skip
        alone = generate(whole, ids, mask, **kw)  # type: ignore[call-overload]
        together = generate(sharded, ids, mask, lockstep=world.any, **kw)  # type: ignore[call-overload]
    # A rank with no prompts (fewer validation prompts than ranks) decodes a padding row for the others and gets none
    engine = HFRolloutEngine(
        sharded, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, device=cpu, precision=precision, lockstep=world.any
    )
    mine = [tok.encode("12+3=")] if world.rank == 0 else []
    with torch.no_grad():
        greedy = engine.generate(mine, SamplingParams(max_new_tokens=8, temperature=0.0), generator=None)
        alone_greedy = generate(whole, *left_pad(mine or [[0]], tok.pad_token_id), max_new_tokens=8,
                                eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, temperature=0.0,
                                precision=precision)  # type: ignore[call-overload]  # fmt: skip
    with distributed.gathered(sharded):  # the whole base on each rank for a generation: one gather, no lockstep
        whole_inside = not any(isinstance(p, DTensor) for p in sharded.parameters())
        with torch.no_grad():
            at_once = generate(sharded, ids, mask, **kw)  # type: ignore[call-overload]
    result = {
        "whole_inside_gathered": whole_inside,
        "gathered_completions_equal": torch.equal(alone.completion_ids, at_once.completion_ids),
        "rows_of_no_prompts": len(greedy.rollout) if not mine else None,
        "greedy_equal": not mine or torch.equal(greedy.rollout.completion_ids, alone_greedy.completion_ids),
        "held": sharding.held,
        "total": sharding.total,
        "layers": sharding.layers,
        "base_is_sharded": all(isinstance(p, DTensor) for p in sharded.parameters() if not p.requires_grad),
        "lora_is_whole": not any(isinstance(p, DTensor) for p in sharded.parameters() if p.requires_grad),
        "logits_max_diff": float((a - b).abs().max().detach()),
        "received_logits_max_diff": float((a.detach() - c).abs().max()),
        "from_rank0": [sharding.from_rank0, received_sharding.from_rank0],
        "logits_scale": float(a.abs().max().detach()),
        "grad_max_diff": max(float((g - h).abs().max()) for g, h in grads),
        "grad_scale": max(float(g.abs().max()) for g, _ in grads),
        "completions_equal": torch.equal(alone.completion_ids, together.completion_ids),
        "lengths": alone.lengths.tolist(),
    }
    (out / f"rank{world.rank}.json").write_text(json.dumps(result))
    distributed.shut_down()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
