"""trainer.generation.rollout on a tiny random Llama: greedy decoding against full forward passes done by hand, EOS and
padding handling, seeded sampling, and batched log-probs against each sequence alone (rl-algorithms.md §5, items
1–5)."""

import copy
import math
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.unit.trainer.conftest import EOS, PAD, VOCAB
from trainer.algorithms.core_algos import entropy_from_logits
from trainer.generation.rollout import (
    Rollout,
    StaticDecoder,
    _sample_next,
    completion_logprobs,
    generate,
    left_pad,
    position_ids,
)


class EosAt(torch.nn.Module):
    """The model with its EOS logit forced: −1e4 while a row has fewer than ``at`` real tokens (attention-mask sum,
    prompt included), +1e4 from then on. So EOS is never chosen early and always chosen (greedy) at a known step."""

    def __init__(self, inner: torch.nn.Module, at: int) -> None:
        super().__init__()
        self.inner = inner
        self.at = at

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: Any) -> Any:
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        n_real = attention_mask.sum(-1, keepdim=True)  # [N, 1]
        logits = out.logits.clone()
        logits[..., EOS] = torch.where(n_real >= self.at, 1e4, -1e4).to(logits.dtype)
        out.logits = logits
        return out


def greedy_by_hand(model: torch.nn.Module, prompt: list[int], steps: int, *, ban_eos: bool = False) -> list[int]:
    """Argmax decoding with a full forward pass per step (no KV cache, no padding); stops after EOS."""
    seq = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.tensor([seq])
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0, -1]
            if ban_eos:
                logits[EOS] = float("-inf")
            tok = int(logits.argmax())
            out.append(tok)
            seq.append(tok)
            if tok == EOS:
                break
    return out


def greedy(model: torch.nn.Module, prompts: list[list[int]], steps: int, **kw: Any) -> Rollout:
    ids, mask = left_pad(prompts, PAD)
    return generate(
        model, ids, mask, max_new_tokens=steps, eos_id=EOS, pad_id=kw.pop("pad_id", PAD), temperature=0.0, **kw
    )


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]


# ---------------------------------------------------------------------------------------------------------------
# left_pad, position_ids
# ---------------------------------------------------------------------------------------------------------------


def test_left_pad_by_hand() -> None:
    ids, mask = left_pad([[5, 6], [7], [8, 9, 10], []], pad_id=3)
    assert ids.tolist() == [[3, 5, 6], [3, 3, 7], [8, 9, 10], [3, 3, 3]]
    assert mask.tolist() == [[0, 1, 1], [0, 0, 1], [1, 1, 1], [0, 0, 0]]
    assert ids.dtype == mask.dtype == torch.long


def test_position_ids_ignore_left_padding() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0]])
    assert position_ids(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 1, 1, 1]]


# ---------------------------------------------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------------------------------------------


def test_greedy_generation_equals_argmax_decoding_by_hand(model: LlamaForCausalLM) -> None:
    no_eos = EosAt(model, at=10**6)
    ro = greedy(no_eos, [PROMPTS[1]], 6)
    assert ro.completion_ids[0].tolist() == greedy_by_hand(no_eos, PROMPTS[1], 6)
    assert ro.lengths.tolist() == [6]
    assert ro.truncated.tolist() == [True]
    assert ro.completion_mask.tolist() == [[1] * 6]
    again = greedy(no_eos, [PROMPTS[1]], 6)
    assert torch.equal(again.completion_ids, ro.completion_ids)


def test_left_padded_batch_gives_each_prompt_its_own_greedy_tokens(any_model: torch.nn.Module) -> None:
    no_eos = EosAt(any_model, at=10**6)
    batch = greedy(no_eos, PROMPTS, 6)
    assert batch.prompt_ids.shape == (3, 5)
    for i, prompt in enumerate(PROMPTS):
        alone = greedy(no_eos, [prompt], 6)
        assert batch.completion_ids[i].tolist() == alone.completion_ids[0].tolist()
        assert batch.completion_ids[i].tolist() == greedy_by_hand(no_eos, prompt, 6)
    # the rows really differ: the test would see a row decoded from another row's context
    assert len({tuple(r) for r in batch.completion_ids.tolist()}) == 3


@pytest.mark.parametrize("pad_id", [PAD, EOS])
def test_eos_ends_a_row_and_only_pad_follows(model: LlamaForCausalLM, pad_id: int) -> None:
    stop = EosAt(model, at=7)  # 5-token prompt: EOS is the 3rd new token; 3-token prompt: the 5th
    ro = greedy(stop, [PROMPTS[1], PROMPTS[0]], 8, pad_id=pad_id)
    assert ro.lengths.tolist() == [3, 5]
    assert ro.truncated.tolist() == [False, False]
    assert ro.completion_ids.shape == (2, 5)  # trimmed to the longest completion
    first = greedy_by_hand(stop, PROMPTS[1], 8)
    second = greedy_by_hand(stop, PROMPTS[0], 8)
    assert first[-1] == EOS and len(first) == 3
    assert second[-1] == EOS and len(second) == 5
    assert ro.completion_ids.tolist() == [[*first, pad_id, pad_id], second]
    assert EOS not in first[:-1] and EOS not in second[:-1]
    # the mask comes from the lengths: up to and including the first EOS, even where pad == EOS
    assert ro.completion_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]


def test_row_without_eos_is_truncated(model: LlamaForCausalLM) -> None:
    stop = EosAt(model, at=7)
    ro = greedy(stop, [PROMPTS[1], PROMPTS[0]], 4)
    assert ro.lengths.tolist() == [3, 4]
    assert ro.truncated.tolist() == [False, True]
    assert ro.completion_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert ro.completion_ids[0, 2].item() == EOS
    assert ro.completion_ids[0, 3].item() == PAD
    assert EOS not in ro.completion_ids[1].tolist()


def test_eos_on_the_last_allowed_step_is_not_truncated(model: LlamaForCausalLM) -> None:
    ro = greedy(EosAt(model, at=7), [PROMPTS[1]], 3)  # EOS is the 3rd new token, the last one allowed
    assert ro.lengths.tolist() == [3]
    assert ro.truncated.tolist() == [False]
    assert ro.completion_ids[0, -1].item() == EOS


def test_min_new_tokens_holds_eos_off(model: LlamaForCausalLM) -> None:
    always_eos = EosAt(model, at=0)
    assert greedy(always_eos, PROMPTS, 8).completion_ids.tolist() == [[EOS]] * 3
    ro = greedy(always_eos, PROMPTS, 8, min_new_tokens=3)
    assert ro.lengths.tolist() == [4, 4, 4]
    assert ro.truncated.tolist() == [False] * 3
    for i, prompt in enumerate(PROMPTS):
        held = greedy_by_hand(always_eos, prompt, 3, ban_eos=True)
        assert ro.completion_ids[i].tolist() == [*held, EOS]


def test_sampling_is_reproducible_with_a_seeded_generator(model: LlamaForCausalLM) -> None:
    ids, mask = left_pad(PROMPTS * 4, PAD)

    def sample(seed: int) -> Rollout:
        return generate(
            model,
            ids,
            mask,
            max_new_tokens=6,
            eos_id=EOS,
            pad_id=PAD,
            temperature=1.0,
            generator=torch.Generator().manual_seed(seed),
        )

    a, b, c = sample(11), sample(11), sample(12)
    for x, y in zip(a.tensors(), b.tensors(), strict=True):
        assert torch.equal(x, y)
    assert not torch.equal(a.completion_ids, c.completion_ids)


def test_generated_rollout_can_be_scored_with_gradients(model: LlamaForCausalLM) -> None:
    ro = greedy(EosAt(model, at=7), [PROMPTS[1], PROMPTS[0]], 6)
    logp, _ = completion_logprobs(model, ro, temperature=1.0, precision="fp32")
    (logp * ro.completion_mask).sum().backward()
    assert any(p.grad is not None for p in model.parameters())
    model.zero_grad(set_to_none=True)


def test_generated_rollout_can_be_edited_in_place(model: LlamaForCausalLM) -> None:
    ro = greedy(EosAt(model, at=7), [PROMPTS[1], PROMPTS[0]], 4)
    ro.completion_mask[ro.truncated] = 0
    assert ro.completion_mask.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]


def first_token_probs(model: torch.nn.Module, prompt: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    return torch.softmax(logits / temperature, -1)


def sample_first_tokens(model: torch.nn.Module, prompt: list[int], n: int, **kw: Any) -> torch.Tensor:
    ids = torch.tensor([prompt] * n)
    ro = generate(
        model,
        ids,
        torch.ones_like(ids),
        max_new_tokens=1,
        eos_id=EOS,
        pad_id=PAD,
        generator=torch.Generator().manual_seed(0),
        **kw,
    )
    return torch.bincount(ro.completion_ids[:, 0], minlength=VOCAB).float() / n


def test_sampling_follows_softmax_of_logits_over_temperature(model: LlamaForCausalLM) -> None:
    n = 2000
    probs = first_token_probs(model, PROMPTS[0], 0.7)
    freq = sample_first_tokens(model, PROMPTS[0], n, temperature=0.7)
    tol = 5 * (probs * (1 - probs) / n).sqrt() + 1e-3
    assert ((freq - probs).abs() <= tol).all()
    # and not the T = 1 distribution
    assert (freq - first_token_probs(model, PROMPTS[0], 1.0)).abs().max() > 0.1


def test_top_p_samples_only_from_the_nucleus(model: LlamaForCausalLM) -> None:
    probs = first_token_probs(model, PROMPTS[0], 1.0)
    sorted_p, order = probs.sort(descending=True)
    top_p = float(sorted_p[:2].sum() - 0.5 * sorted_p[1])  # strictly between the top-1 and top-2 mass
    nucleus = order[:2]  # the smallest prefix whose mass reaches top_p
    freq = sample_first_tokens(model, PROMPTS[0], 1000, temperature=1.0, top_p=top_p)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[nucleus] = False
    assert freq[outside].sum().item() == 0.0
    renormalised = sorted_p[:2] / sorted_p[:2].sum()
    assert freq[nucleus].tolist() == pytest.approx(renormalised.tolist(), abs=0.05)


def test_top_p_nucleus_is_the_smallest_prefix_reaching_top_p() -> None:
    logits = torch.tensor([[math.log(0.5), math.log(0.25), math.log(0.25)]])  # softmax exactly [0.5, 0.25, 0.25]
    g = torch.Generator().manual_seed(0)
    picks = {int(_sample_next(logits, temperature=1.0, top_p=0.5, generator=g)) for _ in range(200)}
    assert picks == {0}


# ---------------------------------------------------------------------------------------------------------------
# completion_logprobs
# ---------------------------------------------------------------------------------------------------------------

COMPLETIONS = [[20, 21, EOS], [22], [23, 24, 25, 26]]


def make_rollout(prompts: list[list[int]], completions: list[list[int]], *, width: int | None = None) -> Rollout:
    prompt_ids, prompt_mask = left_pad(prompts, PAD)
    c = width or max(len(x) for x in completions)
    completion_ids = torch.full((len(completions), c), PAD, dtype=torch.long)
    for i, comp in enumerate(completions):
        completion_ids[i, : len(comp)] = torch.tensor(comp)
    lengths = torch.tensor([len(x) for x in completions])
    completion_mask = (torch.arange(c).unsqueeze(0) < lengths.unsqueeze(-1)).long()
    truncated = torch.tensor([x[-1] != EOS for x in completions])
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, lengths, truncated)


def logps_by_hand(model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """One unpadded forward pass; the logits at position t score the token at t + 1."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0]
    logp = torch.log_softmax(logits / temperature, -1)
    p = len(prompt)
    return [float(logp[p - 1 + j, tok]) for j, tok in enumerate(completion)]


def valid(logp: torch.Tensor, lengths: list[int]) -> list[float]:
    """The log-probs of the valid tokens, row after row, flattened."""
    return [x for i, n in enumerate(lengths) for x in logp[i, :n].tolist()]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_batched_logprobs_equal_each_sequence_alone_and_by_hand(any_model: torch.nn.Module, temperature: float) -> None:
    model = any_model
    batch = make_rollout(PROMPTS, COMPLETIONS)
    with torch.no_grad():
        logp, entropy = completion_logprobs(model, batch, temperature=temperature, precision="fp32")
    assert entropy is None
    assert logp.shape == (3, 4) and logp.dtype == torch.float32
    for i, (prompt, comp) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True)):
        with torch.no_grad():
            alone, _ = completion_logprobs(
                model, make_rollout([prompt], [comp]), temperature=temperature, precision="fp32"
            )
        expected = logps_by_hand(model, prompt, comp, temperature)
        assert alone[0].tolist() == pytest.approx(expected, abs=1e-5)
        assert logp[i, : len(comp)].tolist() == pytest.approx(expected, abs=1e-5)


def test_temperature_changes_the_logprobs(model: LlamaForCausalLM) -> None:
    batch = make_rollout(PROMPTS, COMPLETIONS)
    with torch.no_grad():
        t1, _ = completion_logprobs(model, batch, temperature=1.0, precision="fp32")
        t07, _ = completion_logprobs(model, batch, temperature=0.7, precision="fp32")
    lengths = [len(c) for c in COMPLETIONS]
    diffs = [abs(a - b) for a, b in zip(valid(t1, lengths), valid(t07, lengths), strict=True)]
    assert min(diffs) > 1e-3


def test_pad_values_and_extra_padding_do_not_change_valid_logprobs(any_model: torch.nn.Module) -> None:
    model = any_model
    lengths = [len(c) for c in COMPLETIONS]
    batch = make_rollout(PROMPTS, COMPLETIONS)
    with torch.no_grad():
        base, _ = completion_logprobs(model, batch, temperature=1.0, precision="fp32")

    g = torch.Generator().manual_seed(0)
    scrambled = make_rollout(PROMPTS, COMPLETIONS, width=7)
    pad_left = torch.full((3, 2), PAD)
    scrambled.prompt_ids = torch.cat([pad_left, scrambled.prompt_ids], dim=1)
    scrambled.prompt_mask = torch.cat([torch.zeros_like(pad_left), scrambled.prompt_mask], dim=1)
    noise_p = torch.randint(2, VOCAB, scrambled.prompt_ids.shape, generator=g)
    noise_c = torch.randint(2, VOCAB, scrambled.completion_ids.shape, generator=g)
    scrambled.prompt_ids = torch.where(scrambled.prompt_mask.bool(), scrambled.prompt_ids, noise_p)
    scrambled.completion_ids = torch.where(scrambled.completion_mask.bool(), scrambled.completion_ids, noise_c)
    assert not torch.equal(scrambled.prompt_ids[:, 2:], batch.prompt_ids)
    with torch.no_grad():
        other, _ = completion_logprobs(model, scrambled, temperature=1.0, precision="fp32")
    assert other.shape == (3, 7)
    assert valid(other, lengths) == pytest.approx(valid(base, lengths), abs=1e-5)


def test_entropy_is_that_of_the_temperature_scaled_distribution(model: LlamaForCausalLM) -> None:
    batch = make_rollout([PROMPTS[1]], [COMPLETIONS[2]])
    _, entropy = completion_logprobs(model, batch, temperature=0.5, precision="fp32", with_entropy=True)
    assert entropy is not None and not entropy.requires_grad
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPTS[1] + COMPLETIONS[2]])).logits[0]
    p = len(PROMPTS[1])
    expected = entropy_from_logits(logits[p - 1 : p - 1 + 4] / 0.5)
    torch.testing.assert_close(entropy[0], expected, atol=1e-5, rtol=0)


def test_logprobs_are_differentiable_under_grad(model: LlamaForCausalLM) -> None:
    batch = make_rollout(PROMPTS, COMPLETIONS)
    model.zero_grad()
    logp, _ = completion_logprobs(model, batch, temperature=1.0, precision="fp32")
    assert logp.requires_grad
    (logp * batch.completion_mask).sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().max() > 0 for g in grads)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("cache", ["growing", "static"])
def test_rows_sharing_a_prompt_share_its_prefill_and_sample_what_they_sample_alone(
    any_model: torch.nn.Module, cache: str
) -> None:
    """generate(share_prompts=True), on the growing cache and on a static decoder's: the distinct prompts prefilled
    once (3 rows, not 7), and each row's seeded samples and their log-probs as without sharing."""
    model = any_model
    decoder = StaticDecoder(model, compiled=False) if cache == "static" else None
    ids, mask = left_pad([PROMPTS[i] for i in (0, 1, 0, 2, 0, 1, 2)], PAD)
    seen: list[int] = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: seen.append(kw["input_ids"].shape[0]), with_kwargs=True)
    try:
        runs = []
        for share in (False, True):
            seen.clear()
            runs.append(
                generate(
                    model,
                    ids,
                    mask,
                    max_new_tokens=5,
                    eos_id=EOS,
                    pad_id=PAD,
                    temperature=1.0,
                    row_seeds=list(range(7)),
                    with_logprobs=True,
                    share_prompts=share,
                    decoder=decoder,
                )
            )
            assert seen[0] == (3 if share else 7) and set(seen[1:]) == {7}
    finally:
        hook.remove()
    (whole, whole_lp), (shared, shared_lp) = runs
    for x, y in zip(whole.tensors(), shared.tensors(), strict=True):
        assert torch.equal(x, y)
    torch.testing.assert_close(shared_lp, whole_lp, atol=1e-5, rtol=1e-5)


def test_rows_sharing_a_prompt_run_it_once_and_score_what_their_whole_rows_do(any_model: torch.nn.Module) -> None:
    """share_prompts (a GRPO group's rows): one forward of each distinct prompt, one of the completions on its
    cached keys and values; the log-probs, entropy, hidden states and gradients are the whole rows' forward's."""
    model = any_model
    rows = [0, 1, 0, 2, 1, 0]  # three distinct prompts, two of them repeated, completions of 1 to 4 tokens
    batch = make_rollout([PROMPTS[i] for i in rows], [COMPLETIONS[i % 3] for i in range(len(rows))])
    lengths = batch.lengths.tolist()
    seen: list[tuple[int, ...]] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    try:
        outs, grads = [], []
        for share in (False, True):
            seen.clear()
            logp, entropy, hidden = completion_logprobs(
                model,
                batch,
                temperature=0.7,
                precision="fp32",
                with_entropy=True,
                with_hidden=True,
                share_prompts=share,
            )
            grads.append(torch.autograd.grad((logp * batch.completion_mask).sum(), list(model.parameters())))
            outs.append((logp.detach(), entropy, hidden.detach()))
            assert seen == ([(6, 9)] if not share else [(3, 5), (6, 3)])  # P = 5, C = 4: the last token not run
        (whole_lp, whole_ent, whole_h), (lp, ent, h) = outs
        assert valid(lp, lengths) == pytest.approx(valid(whole_lp, lengths), abs=1e-5)
        assert valid(ent, lengths) == pytest.approx(valid(whole_ent, lengths), abs=1e-5)
        keep = batch.completion_mask.bool()
        torch.testing.assert_close(h[keep], whole_h[keep], atol=1e-5, rtol=1e-5)
        for g_shared, g_whole in zip(grads[1], grads[0], strict=True):
            torch.testing.assert_close(g_shared, g_whole, atol=1e-5, rtol=1e-4)

        seen.clear()  # one-token completions: the prompts' forward alone
        ones = make_rollout([PROMPTS[0], PROMPTS[0], PROMPTS[2]], [[22], [23], [24]])
        with torch.no_grad():
            lp1, _ = completion_logprobs(model, ones, temperature=1.0, precision="fp32", share_prompts=True)
            want, _ = completion_logprobs(model, ones, temperature=1.0, precision="fp32")
        assert seen == [(2, 3), (3, 4)] and lp1.flatten().tolist() == pytest.approx(want.flatten().tolist(), abs=1e-5)

        seen.clear()  # every prompt its own, or dropout on (train mode): the whole rows, one forward
        with torch.no_grad():
            completion_logprobs(
                model, make_rollout(PROMPTS, COMPLETIONS), temperature=1.0, precision="fp32", share_prompts=True
            )
            model.train()
            try:
                completion_logprobs(model, batch, temperature=1.0, precision="fp32", share_prompts=True)
            finally:
                model.eval()
        assert seen == [(3, 9), (6, 9)]
    finally:
        hook.remove()


def test_bf16_logprobs_are_fp32_and_close(model: LlamaForCausalLM) -> None:
    batch = make_rollout(PROMPTS, COMPLETIONS)
    with torch.no_grad():
        fp32, _ = completion_logprobs(model, batch, temperature=1.0, precision="fp32")
        bf16, _ = completion_logprobs(model, batch, temperature=1.0, precision="bf16")
    assert bf16.dtype == torch.float32
    mask = batch.completion_mask.bool()
    assert (bf16 - fp32)[mask].abs().max() < 0.1


# ---------------------------------------------------------------------------------------------------------------
# Rollout.concat / select
# ---------------------------------------------------------------------------------------------------------------


def test_concat_repads_prompts_left_and_completions_right(model: LlamaForCausalLM) -> None:
    first = make_rollout([PROMPTS[0]], [COMPLETIONS[1]])  # P = 3, C = 1
    second = make_rollout(PROMPTS[1:], [COMPLETIONS[2], COMPLETIONS[0]])  # P = 5, C = 4
    both = Rollout.concat([first, second], pad_id=PAD)
    assert both.prompt_ids.tolist() == [[PAD, PAD, 5, 6, 7], [8, 9, 10, 11, 12], [PAD] * 4 + [13]]
    assert both.prompt_mask.tolist() == [[0, 0, 1, 1, 1], [1] * 5, [0, 0, 0, 0, 1]]
    assert both.completion_ids.tolist() == [[22, PAD, PAD, PAD], [23, 24, 25, 26], [20, 21, EOS, PAD]]
    assert both.completion_mask.tolist() == [[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]]
    assert both.lengths.tolist() == [1, 4, 3]
    assert both.truncated.tolist() == [True, True, False]
    assert len(both) == 3

    with torch.no_grad():
        joined, _ = completion_logprobs(model, both, temperature=1.0, precision="fp32")
        a, _ = completion_logprobs(model, first, temperature=1.0, precision="fp32")
        b, _ = completion_logprobs(model, second, temperature=1.0, precision="fp32")
    assert valid(joined, [1, 4, 3]) == pytest.approx(valid(a, [1]) + valid(b, [4, 3]), abs=1e-5)

    picked = both.select(torch.tensor([2, 0]))
    assert picked.lengths.tolist() == [3, 1]
    assert picked.prompt_ids.tolist() == [[PAD] * 4 + [13], [PAD, PAD, 5, 6, 7]]


class EosBias(torch.nn.Module):
    """The model with a constant added to its EOS logit at every position (causal, unlike :class:`EosAt`), so that
    sampled rows end at different steps."""

    def __init__(self, inner: torch.nn.Module, bias: float) -> None:
        super().__init__()
        self.inner, self.bias = inner, bias

    def forward(self, **kwargs: Any) -> Any:
        out = self.inner(**kwargs)
        logits = out.logits.clone()
        logits[..., EOS] += self.bias
        out.logits = logits
        return out


@pytest.mark.parametrize("temperature,top_p,min_new", [(1.0, 1.0, 0), (0.7, 0.8, 2)])
def test_sampling_logprobs_equal_a_full_forward_in_fp32(
    any_model: torch.nn.Module, temperature: float, top_p: float, min_new: int
) -> None:
    """The sampler's own log-probs (the RL loop's old log-probs when the fp32 policy samples itself) are the full
    forward's: of the T-scaled distribution, before EOS is held off and before the top-p cut; 0 past a row's end."""
    ids, mask = left_pad(PROMPTS * 4, PAD)
    sampler = EosBias(any_model, 4.0)
    ro, logp = generate(
        sampler,
        ids,
        mask,
        max_new_tokens=7,
        eos_id=EOS,
        pad_id=PAD,
        temperature=temperature,
        top_p=top_p,
        min_new_tokens=min_new,
        generator=torch.Generator().manual_seed(5),
        with_logprobs=True,
    )
    assert logp.dtype == torch.float32 and logp.shape == ro.completion_ids.shape
    assert bool(ro.completion_mask.bool().any()) and not bool(ro.completion_mask.bool().all())  # some rows end early
    full, _ = completion_logprobs(sampler, ro, temperature=temperature, precision="fp32")
    m = ro.completion_mask.bool()
    torch.testing.assert_close(logp[m], full[m], rtol=0, atol=1e-5)
    assert bool((logp[~m] == 0).all())
    assert bool((logp[m] < 0).all())


def test_any_stop_id_ends_a_row_and_is_kept_and_an_empty_stop_list_runs_to_the_limit(model: LlamaForCausalLM) -> None:
    free = greedy(model, [PROMPTS[0]], 6, stop_ids=[])  # nothing stops it: EOS too is just a token
    tokens = free.completion_ids[0].tolist()
    assert free.lengths.tolist() == [6] and free.truncated.tolist() == [True]
    hand = greedy_by_hand(model, PROMPTS[0], 6)  # stops at an EOS, which the free row runs past
    assert tokens[: len(hand)] == hand
    third = tokens[2]  # a stop on the third token's id ends the row at its first occurrence
    stopped = greedy(model, [PROMPTS[0]], 6, stop_ids=[third, 31])
    first = tokens.index(third) + 1
    assert stopped.lengths.tolist() == [first] and stopped.truncated.tolist() == [False]
    assert stopped.completion_ids[0, :first].tolist() == tokens[:first]


def test_stop_text_ends_a_row_on_the_token_it_accepts(model: LlamaForCausalLM) -> None:
    tokens = greedy(model, [PROMPTS[1]], 6, stop_ids=[]).completion_ids[0].tolist()
    seen: list[list[int]] = []

    def stop_after_four(ids: list[int]) -> bool:
        seen.append(ids)
        return len(ids) == 4

    ro = greedy(model, [PROMPTS[1]], 6, stop_ids=[], stop_text=stop_after_four)
    assert ro.lengths.tolist() == [4] and ro.truncated.tolist() == [False]
    assert ro.completion_ids[0].tolist() == tokens[:4]
    assert seen == [tokens[: i + 1] for i in range(4)]  # asked once per token, with the row so far


def test_top_k_samples_only_among_the_k_likeliest(model: LlamaForCausalLM) -> None:
    ids, mask = left_pad([PROMPTS[0]] * 64, PAD)
    g = torch.Generator().manual_seed(0)
    ro = generate(model, ids, mask, max_new_tokens=1, eos_id=EOS, pad_id=PAD, temperature=5.0, top_k=3, generator=g)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPTS[0]])).logits[0, -1]
    allowed = set(torch.topk(logits, 3).indices.tolist())
    picked = set(ro.completion_ids[:, 0].tolist())
    assert picked <= allowed and len(picked) >= 2  # at T=5 the three are near-uniform; 64 draws see more than one
    one = generate(model, ids[:2], mask[:2], max_new_tokens=4, eos_id=EOS, pad_id=PAD, temperature=5.0, top_k=1)
    assert one.completion_ids.tolist() == greedy(model, [PROMPTS[0]] * 2, 4).completion_ids.tolist()


def test_inverse_cdf_draws_never_land_on_a_zero_weight_token_at_either_end() -> None:
    from trainer.generation.rollout import _draw

    w = torch.tensor([[0.0, 0.2, 0.3, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    ends = torch.tensor([0.0, 0.0], dtype=torch.float64), torch.tensor([1.0, 1.0], dtype=torch.float64)
    assert _draw(w, None, ends[0]).tolist() == [1, 2]  # the first of positive weight
    assert _draw(w, None, ends[1]).tolist() == [3, 2]  # a draw rounding up to the total: the last of positive weight
    assert _draw(w, None, torch.tensor([0.45, 0.7], dtype=torch.float64)).tolist() == [2, 2]  # 0.2 ≤ 0.45 < 0.5


def _sample_with(model: torch.nn.Module, decoder: StaticDecoder | None, seed: int) -> tuple[Rollout, torch.Tensor]:
    ids, mask = left_pad(PROMPTS * 3, PAD)
    return generate(
        EosBias(model, 3.0) if decoder is None else decoder.model,
        ids,
        mask,
        max_new_tokens=9,
        eos_id=EOS,
        pad_id=PAD,
        temperature=1.0,
        generator=torch.Generator().manual_seed(seed),
        with_logprobs=True,
        decoder=decoder,
    )


@pytest.mark.parametrize("compiled", [False, True])
def test_a_static_cache_decoder_samples_what_the_growing_cache_samples(model: LlamaForCausalLM, compiled: bool) -> None:
    """The static cache (mask as long as the cache from the start, a 0 for every position to come) and its compiled
    step sample the same tokens with the same log-probs as the growing cache, rows ending early included; after the
    weights change in place (a merged sampler's sync) it samples from the new weights, and a second generation of
    the same shape compiles nothing more."""
    model = copy.deepcopy(model)
    biased = EosBias(model, 3.0)
    biased.config = model.config  # type: ignore[assignment]
    decoder = StaticDecoder(biased, compiled=compiled)
    for seed in (3, 4):
        if seed == 4:
            with torch.no_grad():
                for w in model.parameters():
                    w.mul_(1.1)
        want, want_lp = _sample_with(model, None, seed)
        got, got_lp = _sample_with(model, decoder, seed)
        assert bool(want.completion_mask.bool().any()) and not bool(want.completion_mask.bool().all())
        for x, y in zip(got.tensors(), want.tensors(), strict=True):
            assert torch.equal(x, y)
        torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=1e-5)
        if seed == 3:
            first = decoder.compile_s
    assert (first > 0) == compiled and decoder.compile_s == first


def test_compile_decode_auto_compiles_only_a_fast_bf16_cpu_sampler_of_a_long_enough_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import trainer.generation.rollout_engine as generation

    cpu, long = torch.device("cpu"), generation.COMPILE_MIN_DECODE_STEPS
    monkeypatch.setattr(generation, "fast_bf16_available", lambda device: True)
    assert generation.decode_mode("auto", device=cpu, bf16_sampler=True, decode_steps=long) == "compiled"
    assert generation.decode_mode("auto", device=cpu, bf16_sampler=True, decode_steps=long - 1) == "dynamic"
    assert generation.decode_mode("auto", device=cpu, bf16_sampler=False, decode_steps=long) == "dynamic"
    assert generation.decode_mode("on", device=cpu, bf16_sampler=False, decode_steps=1) == "compiled"
    assert generation.decode_mode("off", device=cpu, bf16_sampler=True, decode_steps=long) == "dynamic"
    monkeypatch.setattr(generation, "fast_bf16_available", lambda device: False)
    assert generation.decode_mode("auto", device=cpu, bf16_sampler=True, decode_steps=long) == "dynamic"


def test_a_decode_step_that_cannot_be_compiled_decodes_uncompiled(
    model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A machine where torch.compile fails (no C++ compiler for inductor's CPU code): the generation goes on eagerly
    on the static cache, samples what the growing cache samples, and the decoder says why."""
    import trainer.generation.rollout as rollout

    def cannot_compile(fn: Any) -> Any:
        def compiled(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

        return compiled

    monkeypatch.setattr(rollout.torch, "compile", cannot_compile)
    biased = EosBias(model, 3.0)
    biased.config = model.config  # type: ignore[assignment]
    decoder = StaticDecoder(biased, compiled=True)
    want, want_lp = _sample_with(model, None, 3)
    got, got_lp = _sample_with(model, decoder, 3)
    for x, y in zip(got.tensors(), want.tensors(), strict=True):
        assert torch.equal(x, y)
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=1e-5)
    assert decoder.compile_error is not None and "C++ compiler" in decoder.compile_error
    assert not decoder.compiled and decoder.compile_s == 0.0
