"""The engine's step parts called one by one, outside any loop (what a Tinker-style server will call per request):
sample, forward with a registry loss and backward, optimiser step, state save and exact restore, checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from trainer.generation.encoding import PromptSampler
from trainer.generation.models import load_tokenizer, trainable_parameters
from trainer.generation.rollout import completion_logprobs
from trainer.generation.rollout_engine import HFRolloutEngine, SamplingParams
from trainer.loops.checkpoint import load_state
from trainer.loops.engine import Engine, ParamGroup, load_policy, seed_everything
from trainer.spec.config import GRPOHyperparameters
from trainer.spec.lora import LoraSpec


@pytest.fixture()
def parts(random_model_dir: Path) -> tuple[Engine, HFRolloutEngine, list[list[int]]]:
    seed_everything(0)
    tok = load_tokenizer(str(random_model_dir))
    device = torch.device("cpu")
    policy = load_policy(str(random_model_dir), LoraSpec(r=4), device=device, precision="fp32", seed=0).model
    params = trainable_parameters(policy)
    hp = GRPOHyperparameters(learning_rate=1e-2)
    engine = Engine(
        policy,
        groups=[ParamGroup(params, hp.learning_rate)],
        hp=hp,
        total_steps=10,
        device=device,
        precision="fp32",
        data_order=PromptSampler(4, seed=0),
        seed=0,
        dropout=False,
    )
    sampler = HFRolloutEngine(policy, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, device=device, precision="fp32")
    prompts = [tok.encode(f"What is {a} + {b}?") for a, b in ((1, 2), (30, 4), (5, 66), (7, 8))]
    return engine, sampler, prompts


def trainable(engine: Engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters() if p.requires_grad}


def test_sample_forward_backward_and_step_called_alone_change_the_policy_as_the_loss_says(
    parts: tuple[Engine, HFRolloutEngine, list[list[int]]],
) -> None:
    engine, sampler, prompts = parts
    sampler.push_weights(engine.model, engine.weights_version)
    gen = sampler.generate(prompts, SamplingParams(6), generator=engine.generator)
    assert gen.logprobs is not None and sampler.exact_logprobs
    batch = gen.rollout
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])

    engine.zero_grad()
    fb = engine.forward_backward(batch, advantages, old_logp=gen.logprobs)
    mask = batch.policy_mask.bool()
    torch.testing.assert_close(fb.logprobs[mask], gen.logprobs[mask], rtol=0, atol=1e-5)  # the sampler's own
    # ratio 1 at the sampling weights: the token-mean clipped loss is −mean(A) over the tokens
    expected = -float((advantages.unsqueeze(-1) * mask).sum() / mask.sum())
    assert fb.loss == pytest.approx(expected, abs=1e-5)
    before = trainable(engine)
    assert engine.optim_step()[0] > 0 and engine.weights_version == 1
    after = trainable(engine)
    assert any(not torch.equal(before[n], after[n]) for n in before)

    # the step moved log-probs up where A > 0 and down where A < 0
    with torch.no_grad():
        new, _ = completion_logprobs(engine.model, batch, temperature=1.0, precision="fp32")
    seq_delta = ((new - fb.logprobs) * mask).sum(-1)
    assert (seq_delta[advantages > 0] > 0).all() and (seq_delta[advantages < 0] < 0).all()


def test_state_saved_alone_restores_the_weights_optimiser_and_rng_exactly(
    parts: tuple[Engine, HFRolloutEngine, list[list[int]]], tmp_path: Path
) -> None:
    engine, sampler, prompts = parts

    def one_step() -> torch.Tensor:
        sampler.push_weights(engine.model, engine.weights_version)
        gen = sampler.generate(prompts, SamplingParams(6), generator=engine.generator)
        engine.zero_grad()
        engine.forward_backward(gen.rollout, torch.tensor([1.0, -1.0, 0.5, -0.5]), old_logp=gen.logprobs)
        engine.optim_step()
        engine.lr_step()
        return gen.rollout.completion_ids

    one_step()
    ckpt = engine.save_checkpoint(tmp_path, step=1, spec={"note": "engine parts"}, metrics={})
    saved = trainable(engine)
    ids_a = one_step()
    weights_a = trainable(engine)

    engine.load_state(load_state(ckpt))
    assert all(torch.equal(saved[n], p) for n, p in trainable(engine).items())
    ids_b = one_step()  # the same sample (the generator's state came back) and the same update (Adam's moments)
    assert torch.equal(ids_a, ids_b)
    assert all(torch.equal(weights_a[n], p) for n, p in trainable(engine).items())

    # the checkpoint's adapter loads with PEFT alone and is the saved policy
    base = AutoModelForCausalLM.from_pretrained(str(Path(engine.model.peft_config["default"].base_model_name_or_path)))
    reloaded = PeftModel.from_pretrained(base, str(ckpt.adapter_dir)).eval()
    named = dict(reloaded.named_parameters())
    for n, t in saved.items():
        assert torch.equal(named[n], t), n
