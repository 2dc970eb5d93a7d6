"""PPO end to end on a small random model: the value model (second adapter or separate base), its metrics, the
adaptive KL controller, resume with the critic's state, and a policy adapter that loads alone with PEFT."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.test_rl_loop import StopAfter, deterministic, make_spec, read_metrics
from trainer.loops.checkpoint import list_checkpoints
from trainer.loops.critic import CRITIC_ADAPTER
from trainer.loops.rl import RLTrainer
from trainer.spec import metrics as M
from trainer.spec.callbacks import BaseCallback, Callbacks, JsonlFiles
from trainer.spec.config import SpecError, parse_spec
from trainer.train import train


def ppo_spec(model: Path, data: Path, **hp: Any) -> dict[str, Any]:
    return make_spec(model, data, "ppo", **{"group_size": 2, "batch_size": 8, "iterations_per_batch": 2, **hp})


def test_ppo_records_value_metrics_and_trains_policy_and_critic_on_one_base(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    spec = parse_spec(ppo_spec(random_model_dir, arithmetic_data, max_steps=2))
    t = RLTrainer(spec, output_dir=tmp_path, callback=JsonlFiles(tmp_path))
    assert t.models.critic is not None and t.models.critic.shared
    assert set(t.models.model.peft_config) == {"default", CRITIC_ADAPTER}  # one base, two adapters
    frozen = {n: p.detach().clone() for n, p in t.models.model.named_parameters() if "lora_" not in n}
    policy_before = [p.detach().clone() for p in t.models.params]
    critic_before = [p.detach().clone() for p in t.models.critic_params]
    assert not {id(p) for p in t.models.params} & {id(p) for p in t.models.critic_params}
    res = t.run()

    last = read_metrics(tmp_path)[-1]
    for key in (
        M.LOSS_VALUE,
        M.VALUE_MEAN,
        M.RETURNS_MEAN,
        M.EXPLAINED_VARIANCE,
        M.VALUE_CLIP_FRAC,
        M.NON_SCORE_REWARD,
        M.KL_COEF,
        M.KL_MEAN,
        M.CLIP_FRAC_HIGH,
        M.ENTROPY_MEAN,
        M.REWARD_MEAN,
    ):
        assert key in last, key
    assert last[M.KL_COEF] == pytest.approx(0.05)  # TRL's kl_coef, fixed without target_kl
    assert last[M.LOSS_VALUE] > 0 and 0 <= last[M.VALUE_CLIP_FRAC] <= 1
    # the non-score reward is −β·(sequence KL), the KL metric its per-token mean: same sign, β apart
    assert (last[M.NON_SCORE_REWARD] <= 0) == (last[M.KL_MEAN] >= 0)
    for n, p in t.models.model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, frozen[n]), n  # the base is shared and frozen
    assert any(not torch.equal(a, b) for a, b in zip(policy_before, t.models.params, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(critic_before, t.models.critic_params, strict=True))
    assert t.models.model.active_adapter == "default"  # the critic's forward switched back

    # The result is the policy's adapter alone: it loads with PEFT and reproduces the policy.
    assert res.adapter_dir is not None
    assert not (res.adapter_dir / CRITIC_ADAPTER).exists()
    cfg = json.loads((res.adapter_dir / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA"
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.generation.rollout import completion_logprobs, generate, left_pad

    ids, mask = left_pad(t.prompts.train_ids[:4], t.prompts.tokenizer.pad_token_id)
    ro = generate(
        t.models.model,
        ids,
        mask,
        max_new_tokens=6,
        eos_id=t.prompts.tokenizer.eos_token_id,
        pad_id=t.prompts.tokenizer.pad_token_id,
        temperature=1.0,
        generator=torch.Generator().manual_seed(0),
    )
    with torch.no_grad():
        mine, _ = completion_logprobs(t.models.model, ro, temperature=1.0, precision="fp32")
        base = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32).eval()
        reloaded = PeftModel.from_pretrained(base, str(res.adapter_dir)).eval()
        again, _ = completion_logprobs(reloaded, ro, temperature=1.0, precision="fp32")
    m = ro.completion_mask.bool()
    torch.testing.assert_close(again[m], mine[m], rtol=0, atol=1e-5)


def test_ppo_resume_restores_critic_and_kl_controller_exactly(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    raw = ppo_spec(random_model_dir, arithmetic_data, max_steps=4, target_kl=0.01, kl_horizon=50, mini_batches=2)
    full = tmp_path / "full"
    train(parse_spec(raw), output_dir=full, callback=JsonlFiles(full))
    coefs = [r[M.KL_COEF] for r in read_metrics(full) if M.KL_COEF in r]
    assert len(set(coefs)) == 4 and coefs[0] == pytest.approx(0.05)  # the adaptive controller moved β every step

    part = tmp_path / "part"
    first = train(parse_spec(raw), output_dir=part, callback=Callbacks(JsonlFiles(part), StopAfter(3)))
    assert first.stopped and [c.step for c in list_checkpoints(part)] == [2, 3]
    train(parse_spec(raw), output_dir=part, callback=JsonlFiles(part, resume_step=3), resume=True)

    assert deterministic(read_metrics(part)) == deterministic(read_metrics(full))
    a = torch.load(full / "checkpoints/step-000004/trainer_state.pt", weights_only=False)
    b = torch.load(part / "checkpoints/step-000004/trainer_state.pt", weights_only=False)
    assert a["kl_coef"] == b["kl_coef"] != 0.05
    for name in a["trainable"]:
        assert torch.equal(a["trainable"][name], b["trainable"][name]), name
    for part_name in ("lora", "head"):
        for name, tensor in a["critic"][part_name].items():
            assert torch.equal(tensor, b["critic"][part_name][name]), name
    assert any(CRITIC_ADAPTER in n for n in a["critic"]["lora"])


def test_ppo_with_a_separate_value_model(random_model_dir: Path, arithmetic_data: Path, tmp_path: Path) -> None:
    spec = parse_spec(ppo_spec(random_model_dir, arithmetic_data, max_steps=1, value_model=str(random_model_dir)))
    t = RLTrainer(spec, output_dir=tmp_path, callback=BaseCallback())
    assert t.models.critic is not None and not t.models.critic.shared
    assert set(t.models.model.peft_config) == {"default"}
    head_before = t.models.critic.head.weight.detach().clone()
    m = t.run().final_metrics
    assert M.LOSS_VALUE in m and not torch.equal(head_before, t.models.critic.head.weight)


def test_ppo_refuses_a_value_model_with_another_vocabulary(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    small = tmp_path / "small-vocab"
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=8,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    ).save_pretrained(small)
    spec = parse_spec(ppo_spec(random_model_dir, arithmetic_data, max_steps=1, value_model=str(small)))
    with pytest.raises(SpecError) as err:
        RLTrainer(spec, output_dir=tmp_path / "run", callback=BaseCallback())
    assert err.value.param == "method.ppo.hyperparameters.value_model"
    assert "vocabulary" in str(err.value)

    spec = parse_spec(ppo_spec(random_model_dir, arithmetic_data, max_steps=1, value_model=str(tmp_path / "nope")))
    with pytest.raises(SpecError) as err:
        RLTrainer(spec, output_dir=tmp_path / "run2", callback=BaseCallback())
    assert err.value.param == "method.ppo.hyperparameters.value_model"


def _distinct_adapters(t: RLTrainer) -> None:
    """Random LoRA B's and head, different for the policy and the critic: zero-initialised B's make both adapters
    the identity, where routing a row through the wrong one would go unseen."""
    assert t.models.critic is not None
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in t.models.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        t.models.critic.head.weight.copy_(torch.randn(t.models.critic.head.weight.shape, generator=g))


def test_the_adapter_critic_shares_the_policys_passes_with_the_same_results(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    """The rollout's old log-probs, reference log-probs and V from one pass over three copies of the rows (each
    through its adapter) equal the three separate passes, micro-batched or not; the update's one forward and one
    backward give the policy's and the critic's gradients of two separate forwards and backwards."""
    spec = parse_spec(ppo_spec(random_model_dir, arithmetic_data, max_steps=1))
    t = RLTrainer(spec, output_dir=tmp_path, callback=BaseCallback())
    assert t.models.critic is not None and t.models.critic.can_fuse
    _distinct_adapters(t)
    ro = t.collect().rollout
    m = ro.completion_mask.bool()
    with torch.no_grad():
        old = t.engine.logprobs(ro, temperature=1.0, micro_batch_size=None)
        ref = t.engine.logprobs(ro, temperature=1.0, micro_batch_size=None, reference=True)
        values = t.models.critic.rollout_values(ro, precision="fp32", micro_batch_size=None)
    assert (old - ref)[m].abs().max() > 1e-2 and values[m].std() > 1e-2  # the three passes differ
    for mbs in (None, 3):
        f_old, f_ref, f_values = t.models.critic.rollout_scores(
            ro, policy=True, reference=True, temperature=1.0, precision="fp32", micro_batch_size=mbs
        )
        torch.testing.assert_close(f_old[m], old[m], rtol=0, atol=1e-5)
        torch.testing.assert_close(f_ref[m], ref[m], rtol=0, atol=1e-5)
        torch.testing.assert_close(f_values[m], values[m], rtol=0, atol=1e-5)
    (only_v,) = t.models.critic.rollout_scores(
        ro, policy=False, reference=False, temperature=1.0, precision="fp32", micro_batch_size=None
    )
    torch.testing.assert_close(only_v[m], values[m], rtol=0, atol=1e-5)

    weights = torch.randn(ro.completion_ids.shape, generator=torch.Generator().manual_seed(3)) * m
    params = [*t.models.params, *t.models.critic_params]

    def grads() -> list[torch.Tensor]:
        out = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        t.engine.zero_grad()
        for p in t.models.critic_params:
            p.grad = None
        return out

    t.engine.zero_grad()
    logp, _, _ = t.engine.forward(ro, temperature=1.0)
    (logp * weights).sum().backward()
    (t.models.critic.values(ro, precision="fp32") * weights).sum().backward()
    separate = grads()
    f_logp, ent, v = t.models.critic.forward_with_policy(ro, temperature=1.0, precision="fp32", with_entropy=True)
    assert ent is not None and ent.shape == ro.completion_ids.shape
    torch.testing.assert_close(f_logp[m], logp.detach()[m], rtol=0, atol=1e-5)
    ((f_logp + v) * weights).sum().backward()
    fused = grads()
    assert sum(int(g.abs().sum() > 0) for g in separate) == len(params)  # every LoRA matrix and the head
    for a, b in zip(separate, fused, strict=True):
        # Float32 rounding of the two orders of summation, relative to each gradient's own scale (up to 7e-7 of its
        # largest entry on a Xeon with AMX, where an absolute 1e-6 failed an entry of a gradient whose largest is 4).
        torch.testing.assert_close(b, a, rtol=1e-4, atol=2e-6 * float(a.abs().max()))
    assert t.models.model.active_adapter == "default"
    assert not any(mod._forward_pre_hooks for mod in t.models.model.modules())  # the routing is gone after the pass
    again, _, _ = t.engine.forward(ro, temperature=1.0)
    assert torch.equal(again, logp)


def test_ppo_with_the_passes_shared_trains_as_with_separate_passes(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    """Three PPO steps (two iterations of two mini-batches each, the adaptive β) with the critic's passes joined to
    the policy's and with them apart: the same metrics and adapters, to float rounding."""
    raw = ppo_spec(random_model_dir, arithmetic_data, max_steps=3, mini_batches=2, target_kl=0.01, kl_horizon=50)
    runs = []
    for fuses in (True, False):
        out = tmp_path / str(fuses)
        t = RLTrainer(parse_spec(raw), output_dir=out, callback=JsonlFiles(out))
        critic = t.models.critic
        assert critic is not None and critic.can_fuse and not critic.fuses  # joined on CUDA only
        critic.fuses = fuses
        t.engine.share_prompts = False  # the joined passes run whole rows: the separate ones too (same rounding)
        t.run()
        trained = (*t.models.params, *t.models.critic_params)
        runs.append((deterministic(read_metrics(out)), [p.detach().clone() for p in trained]))
    (m_fused, w_fused), (m_apart, w_apart) = runs
    assert len(m_fused) == len(m_apart) == 4  # the validation before step 1, then the 3 steps
    for a, b in zip(m_fused, m_apart, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-5), k
    for a, b in zip(w_fused, w_apart, strict=True):
        assert float((a - b).norm()) <= 1e-3 * max(float(b.norm()), 1e-6)


def count_scoring_passes(t: RLTrainer) -> dict[str, int]:
    """Counts of the rollout's scoring passes ``t`` runs from now on, by what they score: the policy's and the
    reference's log-probs, a critic's V_old (a pass that scores several counts for each)."""
    calls = {"policy": 0, "reference": 0, "critic": 0}
    logprobs = t.engine.logprobs

    def counted_logprobs(*a: Any, reference: bool = False, **kw: Any) -> Any:
        calls["reference" if reference else "policy"] += 1
        return logprobs(*a, reference=reference, **kw)

    t.engine.logprobs = counted_logprobs  # type: ignore[method-assign]
    if t.models.critic is None:
        return calls
    critic = t.models.critic
    values, both, fused = critic.rollout_values, critic.rollout_logprobs_and_values, critic.rollout_scores

    def counted_values(*a: Any, **kw: Any) -> Any:
        calls["critic"] += 1
        return values(*a, **kw)

    def counted_both(*a: Any, **kw: Any) -> Any:
        calls["policy"] += 1
        calls["critic"] += 1
        return both(*a, **kw)

    def counted_fused(*a: Any, policy: bool, reference: bool, **kw: Any) -> Any:
        calls["policy"] += policy
        calls["reference"] += reference
        calls["critic"] += 1
        return fused(*a, policy=policy, reference=reference, **kw)

    critic.rollout_values = counted_values  # type: ignore[method-assign]
    critic.rollout_logprobs_and_values = counted_both  # type: ignore[method-assign]
    critic.rollout_scores = counted_fused  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize(
    ("method", "critic", "iterations"),
    [
        ("ppo", "adapter", 1),
        ("ppo", "adapter", 2),
        ("ppo", "fused", 2),
        ("ppo", "policy_trunk", 1),
        ("rloo", None, 1),
        ("grpo", None, 2),
    ],
)
def test_old_logprobs_from_the_updates_first_forward_train_as_a_scoring_pass(
    random_model_dir: Path,
    arithmetic_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    method: str,
    critic: str | None,
    iterations: int,
) -> None:
    """Over one mini-batch in one micro-batch the update's first forward gives the old log-probs (a trunk's V_old
    too): no scoring pass of the policy runs, the reference's and an adapter critic's still do. Three steps train
    the metrics and adapters of a run whose policy scores the rollout first, to float rounding: PPO with μ = 1 (the
    KL in the reward needs the old log-probs) and μ = 2 with the adaptive β, with the critic's passes apart, joined
    to the policy's and on its trunk; RLOO's KL in the reward; GRPO's μ = 2 ratio."""
    from trainer.generation.rollout_engine import HFRolloutEngine

    # the fp32 sampler's log-probs are the trainer's and would be the old ones: off, as a bf16 sampler's are
    monkeypatch.setattr(HFRolloutEngine, "exact_logprobs", property(lambda self: False))
    hp: dict[str, Any] = {"max_steps": 3, "iterations_per_batch": iterations}
    if method == "ppo":
        raw = ppo_spec(random_model_dir, arithmetic_data, target_kl=0.01, kl_horizon=50, **hp)
        if critic == "policy_trunk":
            raw["method"]["ppo"]["hyperparameters"]["critic"] = critic
    else:
        raw = make_spec(random_model_dir, arithmetic_data, method, beta=0.05, **hp)
    runs = []
    for from_update in (True, False):
        out = tmp_path / str(from_update)
        t = RLTrainer(parse_spec(raw), output_dir=out, callback=JsonlFiles(out))
        assert not t.models.rollout_engine.exact_logprobs
        if critic == "fused":
            assert t.models.critic is not None and t.models.critic.can_fuse
            t.models.critic.fuses = True
        t.scorer.old_from_update = from_update
        t.engine.share_prompts = False  # the scoring passes and the update's forward round alike
        calls = count_scoring_passes(t)
        t.run()
        policy = 0 if from_update else 3
        expected = {
            "policy": policy,
            "reference": 3,
            "critic": {"adapter": 3, "fused": 3, "policy_trunk": policy, None: 0}[critic],
        }
        assert calls == expected
        trained = (*t.models.params, *t.models.critic_params)
        runs.append((deterministic(read_metrics(out)), [p.detach().clone() for p in trained]))
    (m_in, w_in), (m_apart, w_apart) = runs
    assert len(m_in) == len(m_apart) == 4  # the validation before step 1, then the 3 steps
    for a, b in zip(m_in, m_apart, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            # μ = 2: a clipping decision at its threshold in the second pass may flip with the first pass's rounding
            tolerance = 0.012 if k.endswith("clip_frac") and iterations > 1 else 1e-5
            assert a[k] == pytest.approx(b[k], rel=1e-3, abs=tolerance), k
    for a, b in zip(w_in, w_apart, strict=True):
        assert float((a - b).norm()) <= 1e-3 * max(float(b.norm()), 1e-6)


def test_critic_fits_per_token_targets_through_its_adapter_and_head(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    """Gradient flows through the critic's LoRA and head: on a fixed rollout the value loss against fixed per-token
    targets falls by over 95% in 60 Adam steps, while the policy's adapter stays untouched."""
    from trainer.algorithms.core_algos import masked_mean

    spec = parse_spec(ppo_spec(random_model_dir, arithmetic_data, max_steps=1))
    t = RLTrainer(spec, output_dir=tmp_path, callback=BaseCallback())
    assert t.models.critic is not None
    batch = t.collect()
    t.score(batch)
    ro = batch.rollout
    mask = ro.completion_mask.float()
    # A target V_t can be read from what position t sees: the parity of the previous completion token (0.5 first)
    prev = torch.nn.functional.pad(ro.completion_ids[:, :-1], (1, 0), value=-1)
    targets = torch.where(prev < 0, torch.full_like(mask, 0.5), (prev % 2).float() * 2 - 1) * mask
    policy = [p.detach().clone() for p in t.models.params]
    opt = torch.optim.Adam(t.models.critic_params, lr=3e-3)  # 1e-2 oscillates on some CPUs' rollouts
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = masked_mean((t.models.critic.values(ro, precision="fp32") - targets) ** 2, mask)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.05 * losses[0], (losses[0], losses[-1])
    assert all(p.grad is None or not p.grad.any() for p in t.models.params)
    assert all(torch.equal(a, b) for a, b in zip(policy, t.models.params, strict=True))
    lora_grads = [p.grad for p in t.models.critic_params[:-2]]
    assert any(g is not None and g.abs().sum() > 0 for g in lora_grads)  # not the head alone


def test_ppo_on_the_policy_trunk_has_one_adapter_and_trains_policy_and_head(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    spec = parse_spec(ppo_spec(random_model_dir, arithmetic_data, max_steps=2, critic="policy_trunk"))
    t = RLTrainer(spec, output_dir=tmp_path, callback=JsonlFiles(tmp_path))
    assert t.models.critic is not None and t.models.critic.trunk
    # no critic adapter: the head reads the policy's hidden states
    assert set(t.models.model.peft_config) == {"default"}
    assert t.models.critic_params == list(t.models.critic.head.parameters())
    policy_before = [p.detach().clone() for p in t.models.params]
    t.run()

    last = read_metrics(tmp_path)[-1]
    for key in (M.LOSS_VALUE, M.VALUE_MEAN, M.RETURNS_MEAN, M.EXPLAINED_VARIANCE, M.VALUE_CLIP_FRAC, M.KL_MEAN):
        assert key in last, key
    assert last[M.LOSS_VALUE] > 0
    assert last[M.VALUE_MEAN] != 0  # the zero-initialised head moved after step 1: step 2's V_old is not 0
    assert t.models.critic.head.weight.abs().sum() > 0
    assert any(not torch.equal(a, b) for a, b in zip(policy_before, t.models.params, strict=True))


def test_trunk_value_loss_backpropagates_into_the_policy_lora(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    """The shared trunk: V's gradient reaches the policy's LoRA as well as the head (and matches the critic's
    separate forward, which reads the same hidden state)."""
    from trainer.generation.rollout import completion_logprobs

    spec = parse_spec(ppo_spec(random_model_dir, arithmetic_data, max_steps=1, critic="policy_trunk"))
    t = RLTrainer(spec, output_dir=tmp_path, callback=BaseCallback())
    assert t.models.critic is not None
    torch.nn.init.normal_(t.models.critic.head.weight)
    batch = t.collect()
    t.score(batch)
    ro = batch.rollout
    assert batch.values is not None and batch.values.abs().sum() > 0  # V_old from the policy's no-grad pass
    # PPO's KL goes into the per-token rewards, not into the sequence's
    assert torch.equal(batch.samples.rewards, batch.samples.grader_rewards)
    _, _, hidden = completion_logprobs(t.models.model, ro, temperature=1.0, precision="fp32", with_hidden=True)
    v = t.models.critic.head_values(hidden)
    assert v.shape == ro.completion_ids.shape
    (v * ro.completion_mask).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in t.models.critic_params)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in t.models.params)


def test_ppo_on_the_policy_trunk_resumes_exactly(random_model_dir: Path, arithmetic_data: Path, tmp_path: Path) -> None:
    raw = ppo_spec(random_model_dir, arithmetic_data, max_steps=4, mini_batches=2, critic="policy_trunk")
    full = tmp_path / "full"
    train(parse_spec(raw), output_dir=full, callback=JsonlFiles(full))
    part = tmp_path / "part"
    first = train(parse_spec(raw), output_dir=part, callback=Callbacks(JsonlFiles(part), StopAfter(3)))
    assert first.stopped
    train(parse_spec(raw), output_dir=part, callback=JsonlFiles(part, resume_step=3), resume=True)

    assert deterministic(read_metrics(part)) == deterministic(read_metrics(full))
    a = torch.load(full / "checkpoints/step-000004/trainer_state.pt", weights_only=False)
    b = torch.load(part / "checkpoints/step-000004/trainer_state.pt", weights_only=False)
    for name in a["trainable"]:
        assert torch.equal(a["trainable"][name], b["trainable"][name]), name
    assert a["critic"]["lora"] == {} and set(a["critic"]["head"]) == {"weight", "bias"}
    for name, tensor in a["critic"]["head"].items():
        assert tensor.abs().sum() > 0 and torch.equal(tensor, b["critic"]["head"][name]), name


def test_ppo_refuses_a_trunk_critic_with_a_value_model(random_model_dir: Path, arithmetic_data: Path) -> None:
    raw = ppo_spec(random_model_dir, arithmetic_data, critic="policy_trunk", value_model=str(random_model_dir))
    with pytest.raises(SpecError) as err:
        parse_spec(raw)
    assert err.value.param == "method.ppo.hyperparameters.critic"
    assert "value_model" in str(err.value)
