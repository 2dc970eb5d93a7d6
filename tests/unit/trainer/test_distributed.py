"""The pieces of data parallel training that need no second process: how a batch is split among ranks, and
sampling whose rows do not depend on the batch they are sampled in (the ranks' runs are in
tests/e2e/test_data_parallel.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from trainer.builtin_models.tiny_arith import build_tokenizer
from trainer.generation.distributed import World
from trainer.generation.rollout import generate, left_pad, row_uniforms


@pytest.mark.parametrize(("n", "size"), [(12, 2), (13, 2), (5, 3), (2, 4), (0, 2)])
def test_blocks_are_contiguous_cover_every_item_once_and_differ_by_at_most_one(n: int, size: int) -> None:
    blocks = [World(rank=r, size=size, launched=True).block(n) for r in range(size)]
    assert blocks[0][0] == 0 and blocks[-1][1] == n
    assert all(blocks[r][1] == blocks[r + 1][0] for r in range(size - 1))
    sizes = [hi - lo for lo, hi in blocks]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_a_world_alone_gathers_and_broadcasts_its_own_values() -> None:
    alone = World()
    assert alone.gather({"a": 1}) == [{"a": 1}] and alone.broadcast(7) == 7 and alone.sum_floats([1.5]) == [1.5]


def test_row_uniforms_come_from_each_rows_own_seed() -> None:
    a = row_uniforms([5, 6, 7], 4, torch.device("cpu"))
    b = row_uniforms([7, 5], 4, torch.device("cpu"))
    assert torch.equal(a[2], b[0]) and torch.equal(a[0], b[1]) and not torch.equal(a[0], a[1])
    assert bool(((a >= 0) & (a < 1)).all())


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_a_seeded_row_samples_the_same_tokens_in_any_batch(random_model_dir: Path, top_p: float) -> None:
    tok = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(random_model_dir).eval()
    prompts = [tok.encode(t) for t in ("12+3=", "1+1=", "123+456=", "9+9=")]

    def sample(rows: list[int], seeds: list[int]) -> list[list[int]]:
        ids, mask = left_pad([prompts[r] for r in rows], tok.pad_token_id)
        ro = generate(model, ids, mask, max_new_tokens=6, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                      temperature=1.0, top_p=top_p, row_seeds=seeds)  # fmt: skip
        return [ro.completion_ids[i, : ro.lengths[i]].tolist() for i in range(len(rows))]

    whole = sample([0, 1, 2, 3], [10, 11, 12, 13])
    assert sample([0, 1], [10, 11]) + sample([2, 3], [12, 13]) == whole  # two ranks' blocks: the same rows
    assert sample([3, 0], [13, 10]) == [whole[3], whole[0]]  # another order, other neighbours
    assert sample([0], [99]) != [whole[0]] or sample([0], [98]) != [whole[0]]  # the seed decides


def test_inverse_cdf_sampling_follows_the_distribution() -> None:
    """The per-row draw picks token k with probability p_k: 20 000 rows of one distribution, one draw each."""
    from trainer.generation.rollout import _sample_next

    p = torch.tensor([0.5, 0.0, 0.3, 0.2])
    logits = p.clamp_min(1e-30).log().expand(20_000, 4)
    u = torch.rand(20_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tok = _sample_next(logits, temperature=1.0, top_p=1.0, generator=None, uniform=u)
    freq = torch.bincount(tok, minlength=4).float() / 20_000
    assert freq[1] == 0  # a zero-probability token is never drawn
    torch.testing.assert_close(freq, p, atol=0.015, rtol=0)
