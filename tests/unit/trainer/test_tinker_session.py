"""trainer.serving.tinker_session on a tiny random Llama: Tinker's losses against their documented formulas computed by
hand on plain unpadded forwards (values and gradients), AdamW against a hand-written step, exact save/restore across
sessions, and sampling's stops, log-probs and weights against independent forwards."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel
from torch import Tensor
from transformers import LlamaForCausalLM

from trainer.generation.models import Precision, load_tokenizer
from trainer.serving.tinker_session import (
    STATE_FILE,
    LossInputError,
    SessionInputError,
    TrainingSession,
    saved_lora_choice,
)
from trainer.spec.tinker_types import AdamParams, Datum, LoraChoice, SampleParams

CPU = torch.device("cpu")
EOS = 1
LORA = LoraChoice(rank=4, seed=3)


def new_session(model_dir: Path, lora: LoraChoice = LORA, **kwargs: int) -> TrainingSession:
    return TrainingSession(str(model_dir), lora, device=CPU, precision="fp32", **kwargs)


@pytest.fixture
def session(random_model_dir: Path) -> TrainingSession:
    return new_session(random_model_dir)


@pytest.fixture(scope="module")
def base(random_model_dir: Path) -> LlamaForCausalLM:
    """The saved base model on its own: no LoRA, no session code."""
    return LlamaForCausalLM.from_pretrained(random_model_dir).eval()


def perturb(session: TrainingSession, scale: float = 0.05) -> None:
    """Move the LoRA weights off B = 0, so that the policy differs from the base and every weight has a gradient."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in session.trainable.values():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def plain_logits(model: torch.nn.Module, tokens: list[int] | np.ndarray) -> Tensor:
    """[T, V] fp32 logits of one unpadded sequence."""
    return model(input_ids=torch.tensor([list(tokens)])).logits[0].float()


def plain_logprobs(model: torch.nn.Module, tokens: np.ndarray, targets: np.ndarray) -> Tensor:
    """log p(targets[i] | tokens[:i+1]) from one unpadded forward: [T], or [T, K] for [T, K] targets."""
    logp = torch.log_softmax(plain_logits(model, tokens), dim=-1)
    idx = torch.as_tensor(targets)
    return logp.gather(-1, idx.reshape(len(idx), -1)).reshape(idx.shape)


def grads(session: TrainingSession) -> dict[str, Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in session.trainable.items()}


# -- cross-entropy ---------------------------------------------------------------------------------------------------

TOKENS = [np.array([7, 8, 4, 5, 9, 6, 10, 11]), np.array([7, 8, 12, 5, 3])]  # two lengths: the batch is padded


def ce_datum(tokens: np.ndarray, weights: np.ndarray) -> Datum:
    targets = np.concatenate([tokens[1:], [EOS]])
    return Datum(tokens, {"target_tokens": targets, "weights": weights.astype(np.float32)})


def test_cross_entropy_loss_is_minus_weighted_logprobs_of_a_plain_forward_of_the_base(
    session: TrainingSession, base: LlamaForCausalLM
) -> None:
    weights = [np.array([0, 0, 1, 1, 1, 0.5, -2, 1]), np.array([0, 1, 1, 3, 1])]  # any sign, as custom losses send
    data = [ce_datum(t, w) for t, w in zip(TOKENS, weights, strict=True)]

    out = session.forward_backward(data, "cross_entropy", {}, backward=False)

    total = 0.0
    with torch.no_grad():
        for d, o in zip(data, out.outputs, strict=True):
            logp = plain_logprobs(base, d.tokens, d.inputs["target_tokens"])
            elementwise = -torch.tensor(d.inputs["weights"]) * logp
            np.testing.assert_allclose(o["logprobs"], logp.numpy(), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(o["elementwise_loss"], elementwise.numpy(), rtol=1e-5, atol=1e-5)
            assert o["logprobs"].dtype == np.float32 and o["elementwise_loss"].dtype == np.float32
            total += float(elementwise.sum())
    assert set(out.metrics) == {"loss:sum"}
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    assert all(p.grad is None for p in session.trainable.values())  # backward=False: no gradient


def test_cross_entropy_with_k_candidates_per_position_gives_their_logprobs(
    session: TrainingSession, base: LlamaForCausalLM
) -> None:
    tokens = np.array([7, 8, 4, 5])
    targets = np.array([[8, 4, 0], [4, 9, 1], [5, 5, 2], [9, 1, 3]])
    weights = np.array([[0.5, 0.25, 0.25], [1, 0, 0], [0, 0, 0], [0.2, 0.3, 0.5]], np.float32)
    other = ce_datum(TOKENS[0], np.ones(8))  # a [T] datum in the same batch

    out = session.forward_backward(
        [Datum(tokens, {"target_tokens": targets, "weights": weights}), other], "cross_entropy", {}, backward=False
    )

    with torch.no_grad():
        logp = plain_logprobs(base, tokens, targets)
    assert out.outputs[0]["logprobs"].shape == (4, 3)
    assert out.outputs[1]["logprobs"].shape == (8,)
    np.testing.assert_allclose(out.outputs[0]["logprobs"], logp.numpy(), rtol=1e-5, atol=1e-5)
    expected = (-torch.tensor(weights) * logp).sum(-1)
    np.testing.assert_allclose(out.outputs[0]["elementwise_loss"], expected.numpy(), rtol=1e-5, atol=1e-5)


def test_micro_batches_give_the_same_loss_and_gradient_as_one_batch(random_model_dir: Path) -> None:
    data = [ce_datum(t, np.ones(len(t))) for t in TOKENS] * 2
    whole, parts = new_session(random_model_dir), new_session(random_model_dir, micro_batch_size=1)
    perturb(whole)
    perturb(parts)
    a = whole.forward_backward(data, "cross_entropy", {}, backward=True)
    b = parts.forward_backward(data, "cross_entropy", {}, backward=True)
    assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-5)
    for n, g in grads(whole).items():
        torch.testing.assert_close(grads(parts)[n], g, rtol=1e-4, atol=1e-5)


# -- every loss against Tinker's documented implementation -----------------------------------------------------------


def tinker_reference(name: str, lp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float]) -> Tensor:
    """Per-token loss as tinker-docs "Loss functions" writes each one (``target_logprobs`` = lp)."""
    if name == "cross_entropy":
        return -lp * inputs["weights"]
    a, q = inputs["advantages"], inputs["logprobs"]
    lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
    ratio = torch.exp(lp - q)
    if name == "importance_sampling":
        return -(ratio * a)
    if name == "ppo":
        return -torch.min(ratio * a, torch.clamp(ratio, lo, hi) * a)
    if name == "cispo":
        return -(torch.clamp(ratio, lo, hi).detach() * lp * a)
    if name == "dro":
        return -(lp * a - 0.5 * cfg["beta"] * (lp - q) ** 2)
    assert name == "gspo"
    in_ratio = inputs["sequence_ratio_mask"] != 0
    log_ratio = (lp.detach() - q)[in_ratio].mean()
    ratio = torch.exp(log_ratio + lp - lp.detach())
    return -torch.min(ratio * a, torch.clamp(ratio, lo, hi) * a)


# Chosen ratios p/q and advantages: every clip region of both signs; the first two positions are "prompt" (A = 0). No
# ratio sits on a threshold of CASES, where the clipped gradient would hang on the last bit of the log-probs.
RATIOS = [np.array([1.0, 1.0, 0.5, 0.9, 1.1, 1.5, 3.0, 0.7]), np.array([1.0, 2.0, 0.85, 1.3, 0.6])]
ADVANTAGES = [np.array([0, 0, 1, -1, 2, -2, 1, -1.0]), np.array([0, 1.5, -1, 1, 0.5])]

CASES = [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {}),
    ("ppo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}),
    ("cispo", {}),
    ("cispo", {"clip_low_threshold": 0.55, "clip_high_threshold": 2.5}),
    ("dro", {"beta": 0.3}),
    ("gspo", {}),
    ("gspo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}),
]


def rl_data(session: TrainingSession, name: str) -> list[Datum]:
    """Datums whose sampling log-probs are the session's own minus log(chosen ratio)."""
    data = []
    for tokens, ratios, adv in zip(TOKENS, RATIOS, ADVANTAGES, strict=True):
        targets = np.concatenate([tokens[1:], [EOS]])
        if name == "cross_entropy":
            data.append(Datum(tokens, {"target_tokens": targets, "weights": adv.astype(np.float32)}))
            continue
        with torch.no_grad():
            lp = plain_logprobs(session.model, tokens, targets).numpy()
        inputs = {"target_tokens": targets, "logprobs": (lp - np.log(ratios)).astype(np.float32)}
        inputs["advantages"] = adv.astype(np.float32)
        if name == "gspo":
            inputs["sequence_ratio_mask"] = (np.arange(len(tokens)) >= 2).astype(np.float32)
        data.append(Datum(tokens, inputs))
    return data


@pytest.mark.parametrize(("name", "config"), CASES)
def test_loss_value_and_gradient_match_tinkers_formula_on_plain_forwards(
    session: TrainingSession, name: str, config: dict[str, float]
) -> None:
    perturb(session)
    data = rl_data(session, name)

    out = session.forward_backward(data, name, config, backward=True)
    got = grads(session)

    session.optimizer.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for d, o in zip(data, out.outputs, strict=True):
        lp = plain_logprobs(session.model, d.tokens, d.inputs["target_tokens"])
        inputs = {k: torch.tensor(v) for k, v in d.inputs.items() if k != "target_tokens"}
        per_token = tinker_reference(name, lp, inputs, config)
        np.testing.assert_allclose(o["elementwise_loss"], per_token.detach().numpy(), rtol=1e-5, atol=1e-5)
        total = total + per_token.sum()
    total.backward()
    assert out.metrics["loss:sum"] == pytest.approx(float(total.detach()), rel=1e-5, abs=1e-6)
    for n, g in grads(session).items():
        torch.testing.assert_close(got[n], g, rtol=1e-4, atol=1e-5)
    assert any(g.abs().sum() > 0 for g in got.values())


def test_ppo_clips_at_tinkers_default_thresholds_0_8_and_1_2(session: TrainingSession) -> None:
    data = rl_data(session, "ppo")
    out = session.forward_backward(data[:1], "ppo", {}, backward=False)
    r, a = RATIOS[0], ADVANTAGES[0]
    # by hand: −min(rA, clip(r, 0.8, 1.2)·A) per position
    hand = [-min(ri * ai, min(max(ri, 0.8), 1.2) * ai) for ri, ai in zip(r, a, strict=True)]
    assert hand == pytest.approx([0, 0, -0.5, 0.9, -2.2, 3.0, -1.2, 0.8])
    np.testing.assert_allclose(out.outputs[0]["elementwise_loss"], hand, rtol=1e-5, atol=1e-6)
    assert out.metrics["loss:sum"] == pytest.approx(sum(hand), rel=1e-5)


def test_importance_sampling_loss_is_minus_ratio_times_advantage(session: TrainingSession) -> None:
    out = session.forward_backward(rl_data(session, "importance_sampling"), "importance_sampling", {}, backward=False)
    hand = sum(-(r * a).sum() for r, a in zip(RATIOS, ADVANTAGES, strict=True))
    assert out.metrics["loss:sum"] == pytest.approx(hand, rel=1e-5)


# -- bad input -------------------------------------------------------------------------------------------------------


def test_an_unknown_loss_is_refused_listing_the_valid_ones(session: TrainingSession) -> None:
    data = [ce_datum(TOKENS[0], np.ones(8))]
    with pytest.raises(LossInputError, match=r"unknown loss 'nll'; valid: cispo, cross_entropy, dro, gspo, .*ppo"):
        session.forward_backward(data, "nll", {}, backward=True)


@pytest.mark.parametrize("name", ["stable_reinforce", "custom"])
def test_losses_this_server_does_not_run_are_refused_by_name(session: TrainingSession, name: str) -> None:
    with pytest.raises(LossInputError, match=rf"loss '{name}' is not supported by this server"):
        session.forward_backward([ce_datum(TOKENS[0], np.ones(8))], name, {}, backward=True)


def test_cross_entropy_without_weights_names_the_input_and_the_datum(session: TrainingSession) -> None:
    good = ce_datum(TOKENS[0], np.ones(8))
    bad = Datum(TOKENS[1], {"target_tokens": TOKENS[1]})
    with pytest.raises(LossInputError, match=r"^datum 1: loss 'cross_entropy' needs loss_fn_inputs 'weights'$"):
        session.forward_backward([good, bad], "cross_entropy", {}, backward=True)
    assert all(p.grad is None for p in session.trainable.values())  # nothing ran


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"advantages": np.zeros(7, np.float32)}, r"datum 0: 'advantages' has shape \[7\], the loss needs \[8\]"),
        ({"logprobs": np.full(8, np.nan, np.float32)}, r"datum 0: 'logprobs' holds a NaN or an infinity"),
        ({"target_tokens": np.full(8, 99)}, r"datum 0: target_tokens holds a token id outside the vocabulary"),
        ({"target_tokens": np.zeros((8, 2), np.int64)}, r"target_tokens has shape \[8, 2\]; loss 'ppo' needs \[T\]"),
        ({"mask": np.ones(8, np.float32)}, r"datum 0: loss 'ppo' does not take loss_fn_inputs 'mask'"),
    ],
)
def test_malformed_loss_inputs_are_refused_naming_them(
    session: TrainingSession, inputs: dict[str, np.ndarray], message: str
) -> None:
    datum = rl_data(session, "ppo")[0]
    datum = Datum(datum.tokens, {**datum.inputs, **inputs})
    with pytest.raises(LossInputError, match=message):
        session.forward_backward([datum], "ppo", {}, backward=True)


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        ("ppo", {"epsilon": 0.2}, r"loss 'ppo' does not take loss_fn_config epsilon; it takes: clip_high_threshold"),
        ("dro", {}, r"loss 'dro' needs loss_fn_config 'beta'"),
        ("ppo", {"clip_low_threshold": "x"}, r"must be a finite number"),
        ("ppo", {"clip_low_threshold": 1.3}, r"need 0 ≤ clip_low_threshold ≤ clip_high_threshold"),
        ("cross_entropy", {"beta": 1.0}, r"loss 'cross_entropy' does not take loss_fn_config beta; it takes: none"),
    ],
)
def test_bad_loss_config_is_refused(
    session: TrainingSession, name: str, config: dict[str, float | str], message: str
) -> None:
    with pytest.raises(LossInputError, match=message):
        session.forward_backward(rl_data(session, name if name != "dro" else "ppo"), name, config, backward=True)


# -- the optimiser ---------------------------------------------------------------------------------------------------


def test_optim_step_is_one_clipped_adamw_step_with_the_requested_settings(session: TrainingSession) -> None:
    perturb(session)
    session.forward_backward([ce_datum(t, np.ones(len(t))) for t in TOKENS], "cross_entropy", {}, backward=True)
    g = grads(session)
    before = {n: p.detach().clone() for n, p in session.trainable.items()}
    norm = math.sqrt(sum(float((x**2).sum()) for x in g.values()))
    adam = AdamParams(learning_rate=0.01, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1, grad_clip_norm=norm / 4)

    metrics = session.optim_step(adam)

    assert metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-5)
    assert all(k.count(":") == 1 for k in metrics)
    coef = adam.grad_clip_norm / (norm + 1e-6)  # torch's clip_grad_norm_
    for n, p in session.trainable.items():
        gc = g[n] * coef
        m_hat = (1 - adam.beta1) * gc / (1 - adam.beta1)
        v_hat = (1 - adam.beta2) * gc**2 / (1 - adam.beta2)
        expected = before[n] * (1 - adam.learning_rate * adam.weight_decay) - adam.learning_rate * m_hat / (
            v_hat.sqrt() + adam.eps
        )
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-7, msg=n)
        assert p.grad is None  # gradients are cleared for the next forward_backward
    assert (session.optimizer_steps, session.weights_version) == (1, 1)


def test_a_step_without_clipping_leaves_the_gradient_unscaled(session: TrainingSession) -> None:
    perturb(session)
    session.forward_backward([ce_datum(TOKENS[0], np.ones(8))], "cross_entropy", {}, backward=True)
    g = grads(session)
    before = {n: p.detach().clone() for n, p in session.trainable.items()}
    session.optim_step(AdamParams(learning_rate=0.01, eps=1e-8))
    for n, p in session.trainable.items():  # first Adam step: Δ = −lr·g/(|g| + eps)
        torch.testing.assert_close(p.detach(), before[n] - 0.01 * g[n] / (g[n].abs() + 1e-8), rtol=1e-5, atol=1e-7)


# -- save and restore ------------------------------------------------------------------------------------------------


def train_steps(session: TrainingSession, n: int) -> list[dict[str, float]]:
    out = []
    for i in range(n):
        data = [ce_datum(t, np.ones(len(t)) * (1 + i)) for t in TOKENS]
        session.forward_backward(data, "cross_entropy", {}, backward=True)
        out.append(session.optim_step(AdamParams(learning_rate=0.02, weight_decay=0.01, grad_clip_norm=5.0)))
    return out


def test_a_saved_state_resumes_exactly_in_a_new_session(
    session: TrainingSession, random_model_dir: Path, tmp_path: Path
) -> None:
    train_steps(session, 2)
    session.save_state(tmp_path / "state")
    assert {p.name for p in (tmp_path / "state").iterdir()} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
        STATE_FILE,
    }

    resumed = new_session(random_model_dir, LoraChoice(rank=4, seed=99))  # another init: everything comes from the file
    resumed.load_state(tmp_path / "state", optimizer=True)
    assert resumed.optimizer_steps == 2

    probe = [ce_datum(t, np.ones(len(t))) for t in TOKENS]
    a = session.forward_backward(probe, "cross_entropy", {}, backward=False)
    b = resumed.forward_backward(probe, "cross_entropy", {}, backward=False)
    for x, y in zip(a.outputs, b.outputs, strict=True):
        np.testing.assert_array_equal(x["logprobs"], y["logprobs"])
    assert train_steps(session, 1) == train_steps(resumed, 1)  # the optimiser's moments came back too
    for n, p in session.trainable.items():
        torch.testing.assert_close(resumed.trainable[n], p, rtol=0, atol=0)


def test_waiting_gradients_are_saved_only_when_asked_and_come_back_with_the_optimizer(
    session: TrainingSession, random_model_dir: Path, tmp_path: Path
) -> None:
    """An idle unload between forward_backward and optim_step (gradients=True) loses nothing; a client's save_state
    carries no gradients."""
    train_steps(session, 1)
    session.forward_backward([ce_datum(t, np.ones(len(t))) for t in TOKENS], "cross_entropy", {}, backward=True)
    assert session.has_gradients()
    session.save_state(tmp_path / "idle", gradients=True)
    session.save_state(tmp_path / "client")

    resumed = new_session(random_model_dir)
    resumed.load_state(tmp_path / "idle", optimizer=True)
    assert resumed.has_gradients()
    for n, p in session.trainable.items():
        assert p.grad is not None
        torch.testing.assert_close(resumed.trainable[n].grad, p.grad, rtol=0, atol=0)
    step = AdamParams(learning_rate=1e-2)
    assert resumed.optim_step(step) == session.optim_step(step)
    for n, p in session.trainable.items():
        torch.testing.assert_close(resumed.trainable[n], p, rtol=0, atol=0)

    plain = new_session(random_model_dir)
    plain.load_state(tmp_path / "client", optimizer=True)
    assert not plain.has_gradients()
    without = new_session(random_model_dir)
    without.load_state(tmp_path / "idle", optimizer=False)  # the optimiser reset: the gradients go with it
    assert not without.has_gradients()


def test_loading_without_the_optimizer_resets_it(
    session: TrainingSession, random_model_dir: Path, tmp_path: Path
) -> None:
    train_steps(session, 2)
    session.save_state(tmp_path / "state")
    other = new_session(random_model_dir)
    train_steps(other, 1)
    version = other.weights_version

    other.load_state(tmp_path / "state", optimizer=False)

    assert other.optimizer_steps == 0 and not other.optimizer.state
    assert other.weights_version == version + 1
    for n, p in session.trainable.items():
        torch.testing.assert_close(other.trainable[n], p, rtol=0, atol=0)


def test_a_saved_adapter_is_a_peft_adapter_of_the_trained_policy(
    session: TrainingSession, random_model_dir: Path, tmp_path: Path
) -> None:
    train_steps(session, 2)
    session.save_adapter(tmp_path / "adapter")
    peft = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(random_model_dir), str(tmp_path / "adapter"))
    with torch.no_grad():
        torch.testing.assert_close(plain_logits(peft.eval(), TOKENS[0]), plain_logits(session.model, TOKENS[0]))
    assert saved_lora_choice(tmp_path / "adapter") == LoraChoice(rank=4)

    sampler = new_session(random_model_dir, saved_lora_choice(tmp_path / "adapter"))
    sampler.load_adapter_weights(tmp_path / "adapter")
    for n, p in session.trainable.items():
        torch.testing.assert_close(sampler.trainable[n], p, rtol=0, atol=0)


def test_an_adapter_of_another_rank_or_modules_is_refused(
    session: TrainingSession, random_model_dir: Path, tmp_path: Path
) -> None:
    session.save_adapter(tmp_path / "adapter")
    for lora in (LoraChoice(rank=8), LoraChoice(rank=4, train_unembed=False)):
        with pytest.raises(SessionInputError, match="the adapter in adapter has LoRA"):
            new_session(random_model_dir, lora).load_state(tmp_path / "adapter", optimizer=False)


def test_lora_targets_follow_the_choice(random_model_dir: Path) -> None:
    attn_only = new_session(random_model_dir, LoraChoice(rank=2, train_mlp=False, train_unembed=False))
    assert {n.split(".")[-4] for n in attn_only.trainable} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    everything = new_session(random_model_dir, LoraChoice(rank=2))
    layers = {n.split(".")[-4] for n in everything.trainable}
    assert layers == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}
    lora_a = next(p for n, p in everything.trainable.items() if "lora_A" in n)
    assert lora_a.shape[0] == 2
    assert all(float(p.abs().sum()) == 0 for n, p in everything.trainable.items() if "lora_B" in n)


# -- sampling --------------------------------------------------------------------------------------------------------

PROMPT = [7, 8, 4, 5, 9, 6]


def greedy(session: TrainingSession, stop: list[str] | list[int] | None, max_tokens: int = 12) -> tuple[list[int], str]:
    seq = session.sample(PROMPT, SampleParams(max_tokens=max_tokens, temperature=0.0, stop=stop)).sequences[0]
    return seq.tokens, seq.stop_reason


def test_an_empty_stop_list_runs_to_max_tokens(session: TrainingSession) -> None:
    tokens, reason = greedy(session, [], max_tokens=12)
    assert (len(tokens), reason) == (12, "length")


def test_stop_token_ids_stop_on_the_first_and_include_it(session: TrainingSession) -> None:
    full, _ = greedy(session, [])
    stop = full[4]
    cut = next(i for i, t in enumerate(full) if t in (stop, EOS)) + 1
    assert greedy(session, [stop]) == (full[:cut], "stop")


def test_a_stop_string_stops_on_the_token_that_completes_it(session: TrainingSession, random_model_dir: Path) -> None:
    full, _ = greedy(session, [])
    tok = load_tokenizer(str(random_model_dir))
    text = tok.decode(full[3:5])  # a string across two tokens
    cut = next(k for k in range(1, len(full) + 1) if text in tok.decode(full[:k]) or full[k - 1] == EOS)
    assert greedy(session, [text]) == (full[:cut], "stop")


def test_default_stop_is_the_eos_token_and_it_is_returned(session: TrainingSession) -> None:
    # teach the policy to say EOS at once, then compare stop=None with no stop at all
    eos_everywhere = Datum(np.array(PROMPT), {"target_tokens": np.full(6, EOS), "weights": np.ones(6, np.float32)})
    for _ in range(20):
        session.forward_backward([eos_everywhere], "cross_entropy", {}, backward=True)
        session.optim_step(AdamParams(learning_rate=0.05))
    assert greedy(session, None) == ([EOS], "stop")
    tokens, reason = greedy(session, [], max_tokens=5)  # no stop at all: EOS does not end it
    assert (tokens[0], len(tokens), reason) == (EOS, 5, "length")
    assert greedy(session, ["7"]) == ([EOS], "stop")  # stop strings keep EOS


def test_sampled_logprobs_are_a_teacher_forced_forward_at_the_temperature(
    session: TrainingSession, base: LlamaForCausalLM
) -> None:
    params = SampleParams(max_tokens=10, temperature=0.7, seed=5, num_samples=4, stop=[])
    result = session.sample(PROMPT, params)
    assert len(result.sequences) == 4 and result.prompt_logprobs is None
    for seq in result.sequences:
        with torch.no_grad():
            logits = plain_logits(base, PROMPT + seq.tokens)[len(PROMPT) - 1 : -1] / 0.7
            expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq.tokens).unsqueeze(-1)).squeeze(-1)
        np.testing.assert_allclose(seq.logprobs, expected.numpy(), rtol=1e-5, atol=1e-5)
    assert len({tuple(s.tokens) for s in result.sequences}) > 1  # the rows are sampled independently


def test_rows_that_stop_end_and_the_others_keep_their_own_context(
    session: TrainingSession, base: LlamaForCausalLM
) -> None:
    # top-2 sampling: every token must be one of the two likeliest after its own prefix, which a row continuing
    # another row's cache would break
    params = SampleParams(max_tokens=12, temperature=1.0, top_k=2, seed=2, num_samples=8, stop=[14])
    result = session.sample(PROMPT, params)
    lengths = {len(s.tokens) for s in result.sequences}
    assert len(lengths) > 2 and {s.stop_reason for s in result.sequences} == {"stop", "length"}
    for seq in result.sequences:
        assert (seq.stop_reason == "stop") == (seq.tokens[-1] in (14, EOS))
        with torch.no_grad():
            logits = plain_logits(base, PROMPT + seq.tokens)[len(PROMPT) - 1 : -1]
        top2 = torch.topk(logits, 2, dim=-1).indices
        assert all(t in top2[j].tolist() for j, t in enumerate(seq.tokens))


def test_greedy_logprobs_are_the_models_own(session: TrainingSession, base: LlamaForCausalLM) -> None:
    seq = session.sample(PROMPT, SampleParams(max_tokens=4, temperature=0.0, stop=[])).sequences[0]
    with torch.no_grad():
        logp = torch.log_softmax(plain_logits(base, PROMPT + seq.tokens)[len(PROMPT) - 1 : -1], -1)
    assert seq.tokens == logp.argmax(-1).tolist()
    np.testing.assert_allclose(seq.logprobs, logp.max(-1).values.numpy(), rtol=1e-5, atol=1e-5)


def test_the_seed_makes_sampling_reproducible_and_top_k_1_is_greedy(session: TrainingSession) -> None:
    params = SampleParams(max_tokens=8, seed=123, num_samples=3, stop=[])
    assert session.sample(PROMPT, params) == session.sample(PROMPT, params)
    top1 = session.sample(PROMPT, SampleParams(max_tokens=8, top_k=1, seed=1, stop=[])).sequences[0].tokens
    assert top1 == greedy(session, [], max_tokens=8)[0]


def test_prompt_logprobs_are_none_first_then_a_forwards(session: TrainingSession, base: LlamaForCausalLM) -> None:
    result = session.sample(PROMPT, SampleParams(max_tokens=1, prompt_logprobs=True))
    assert result.prompt_logprobs is not None and result.prompt_logprobs[0] is None
    with torch.no_grad():
        expected = plain_logprobs(base, np.array(PROMPT[:-1]), np.array(PROMPT[1:]))
    np.testing.assert_allclose(np.array(result.prompt_logprobs[1:], float), expected.numpy(), rtol=1e-5, atol=1e-5)
    assert session.sample([7], SampleParams(max_tokens=1, prompt_logprobs=True)).prompt_logprobs == [None]


def test_sampling_with_a_snapshot_equals_sampling_with_it_current_and_leaves_the_weights(
    session: TrainingSession,
) -> None:
    params = SampleParams(max_tokens=8, seed=9, num_samples=2, stop=[])
    perturb(session, scale=0.3)
    old = session.snapshot()
    perturb(session, scale=0.3)
    current = session.snapshot()
    session.forward_backward([ce_datum(TOKENS[0], np.ones(8))], "cross_entropy", {}, backward=True)
    pending = grads(session)

    with_old = session.sample(PROMPT, params, weights=old)

    for n, p in session.trainable.items():  # the current weights and the waiting gradients are untouched
        torch.testing.assert_close(p.detach(), current[n], rtol=0, atol=0)
        torch.testing.assert_close(grads(session)[n], pending[n], rtol=0, atol=0)
    assert with_old != session.sample(PROMPT, params)
    with torch.no_grad():
        for n, p in session.trainable.items():
            p.copy_(old[n])
    assert with_old == session.sample(PROMPT, params)


def test_a_saved_adapter_reads_back_as_its_snapshot_without_touching_the_session(
    session: TrainingSession, tmp_path: Path
) -> None:
    perturb(session, scale=0.3)
    saved = session.snapshot()
    session.save_adapter(tmp_path / "adapter")
    perturb(session, scale=0.3)
    current = session.snapshot()
    session.forward_backward([ce_datum(TOKENS[0], np.ones(8))], "cross_entropy", {}, backward=True)
    pending = grads(session)

    read = session.read_adapter_snapshot(tmp_path / "adapter")

    assert set(read) == set(saved)
    for n, p in session.trainable.items():
        torch.testing.assert_close(read[n], saved[n], rtol=0, atol=0)
        torch.testing.assert_close(p.detach(), current[n], rtol=0, atol=0)
        torch.testing.assert_close(grads(session)[n], pending[n], rtol=0, atol=0)


def test_sampling_the_base_turns_the_adapter_off(session: TrainingSession, random_model_dir: Path) -> None:
    params = SampleParams(max_tokens=8, seed=4, num_samples=2, stop=[], prompt_logprobs=True)
    fresh = new_session(random_model_dir).sample(PROMPT, params)
    perturb(session, scale=0.3)
    assert session.sample(PROMPT, params, weights="base") == fresh
    assert session.sample(PROMPT, params) != fresh


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SampleParams(), "the prompt is empty"),
        ([99], SampleParams(), "outside the vocabulary"),
        (PROMPT, SampleParams(max_tokens=60), "exceed the model's context of 64 tokens"),
        (PROMPT, SampleParams(stop=[""]), "a stop string must not be empty"),
        (PROMPT, SampleParams(top_p=0.0), "0 < top_p"),
    ],
)
def test_bad_sampling_requests_are_refused(
    session: TrainingSession, prompt: list[int], params: SampleParams, message: str
) -> None:
    with pytest.raises(SessionInputError, match=message):
        session.sample(prompt, params)


def test_bad_sampling_requests_are_refused_by_check_sample_too(session: TrainingSession) -> None:
    with pytest.raises(SessionInputError, match="a stop string must not be empty"):
        session.check_sample(PROMPT, SampleParams(stop=[""]))
    session.check_sample(PROMPT, SampleParams(stop=["x"]))  # a good one passes


def test_requests_sampled_together_get_what_each_gets_alone(session: TrainingSession) -> None:
    """Three greedy requests of different prompts and counts in one generation (left-padded together): each gets its
    own completions, log-probs and prompt log-probs, as when sampled alone."""
    perturb(session, scale=0.3)
    prompts = [PROMPT, [7, 8, 12], [9, 6, 10, 11, 4, 5, 3, 2]]
    params = [
        SampleParams(max_tokens=7, temperature=0.0, stop=[14], num_samples=n, prompt_logprobs=n == 2) for n in (1, 2, 3)
    ]
    together = session.sample_many(list(zip(prompts, params, strict=True)))
    assert [len(r.sequences) for r in together] == [1, 2, 3]
    for prompt, p, got in zip(prompts, params, together, strict=True):
        alone = session.sample(prompt, p)
        assert [s.tokens for s in got.sequences] == [s.tokens for s in alone.sequences]
        assert [s.stop_reason for s in got.sequences] == [s.stop_reason for s in alone.sequences]
        for a, b in zip(got.sequences, alone.sequences, strict=True):
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-4)  # padded vs unpadded rounding
        assert (got.prompt_logprobs is None) == (alone.prompt_logprobs is None) == (not p.prompt_logprobs)
    assert {s.stop_reason for r in together for s in r.sequences} >= {"length"}


def test_requests_whose_settings_differ_or_that_are_seeded_are_not_sampled_together(session: TrainingSession) -> None:
    hot, cold = SampleParams(temperature=1.0), SampleParams(temperature=0.5)
    with pytest.raises(ValueError, match="settings differ"):
        session.sample_many([(PROMPT, hot), (PROMPT, cold)])
    with pytest.raises(ValueError, match="seeded"):
        session.sample_many([(PROMPT, SampleParams(seed=1)), (PROMPT, SampleParams(seed=1))])


def test_a_bf16_session_trains_and_samples_within_bf16_rounding_of_fp32(random_model_dir: Path) -> None:
    data = [ce_datum(t, np.ones(len(t))) for t in TOKENS]
    params = SampleParams(max_tokens=6, seed=1, num_samples=2, prompt_logprobs=True, stop=[])
    results = []
    precisions: tuple[Precision, ...] = ("fp32", "bf16")
    for precision in precisions:
        s = TrainingSession(str(random_model_dir), LORA, device=CPU, precision=precision)
        out = s.forward_backward(data, "cross_entropy", {}, backward=True)
        s.optim_step(AdamParams(learning_rate=0.01))
        assert all(p.dtype == torch.float32 for p in s.trainable.values())  # the master weights stay fp32
        results.append((out, s.sample(PROMPT, params, weights=s.snapshot())))
    (fp32, fp32_sample), (bf16, bf16_sample) = results
    assert bf16.metrics["loss:sum"] == pytest.approx(fp32.metrics["loss:sum"], rel=1e-2)
    for a, b in zip(fp32.outputs, bf16.outputs, strict=True):
        np.testing.assert_allclose(b["logprobs"], a["logprobs"], atol=0.05)
    assert len(bf16_sample.sequences) == 2
    assert bf16_sample.prompt_logprobs is not None and fp32_sample.prompt_logprobs is not None
    bf16_prompt, fp32_prompt = bf16_sample.prompt_logprobs[1:], fp32_sample.prompt_logprobs[1:]
    np.testing.assert_allclose(np.array(bf16_prompt, float), np.array(fp32_prompt, float), atol=0.05)
