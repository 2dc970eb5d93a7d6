"""trainer.loops.reward_model and the reward_model grader: the score read at the last real token (rl-algorithms §5.28),
a saved reward model reloaded and scored in batches, normalisation, and the errors for folders that are not one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerBase

from trainer.generation.encoding import completion_batch, encode_completion
from trainer.generation.models import add_lora, load_base_model, load_tokenizer
from trainer.generation.rollout import Rollout
from trainer.grading.graders import grade
from trainer.loops.evaluate import grade_batch
from trainer.loops.reward_model import (
    RewardModelInfo,
    build_reward_model,
    check_reward_models,
    last_token_index,
    load_reward_model,
    sequence_scores,
)
from trainer.spec import graders
from trainer.spec.config import parse_spec
from trainer.spec.data import PromptItem
from trainer.spec.lora import LoraSpec

PROMPTS = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in [(1, 2), (23, 58), (9, 9), (40, 4)]]
REPLIES = ["3", "81", "", "4444"]


def rm_grader(model: Path, **extra: object) -> graders.Grader:
    return graders.parse_grader({"type": "reward_model", "name": "rm", "model": str(model), **extra})


@pytest.fixture(scope="module")
def reward_model_dir(random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job-output-like folder whose adapter/ is a reward model with non-trivial LoRA weights and statistics."""
    out = tmp_path_factory.mktemp("rm-run")
    tok = load_tokenizer(str(random_model_dir))
    model = build_reward_model(
        str(random_model_dir),
        LoraSpec.model_validate({"r": 4}),
        pad_token_id=tok.pad_token_id,
        seed=0,
        device=torch.device("cpu"),
    )
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(out / "adapter"))
    RewardModelInfo(str(random_model_dir), 64, score_mean=0.5, score_std=2.0, scored_on="validation").write(
        out / "adapter"
    )
    return out


def batch_of(tok: PreTrainedTokenizerBase, prompts: list[list[dict[str, str]]], replies: list[str]) -> Rollout:
    enc = [encode_completion(tok, p, r) for p, r in zip(prompts, replies, strict=True)]
    return completion_batch([p for p, _ in enc], [c for _, c in enc], tok.pad_token_id)


def test_last_token_index_is_the_last_kept_position_for_any_padding() -> None:
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [2, 4, 2, 0]


def test_score_is_unchanged_by_appended_padding_and_batch_neighbours(reward_model_dir: Path) -> None:
    rm = load_reward_model(reward_model_dir, precision="fp32")
    tok, model = rm.tokenizer, rm.model
    batch = batch_of(tok, PROMPTS, REPLIES)
    with torch.no_grad():
        scores = sequence_scores(model, batch, precision="fp32")
        pad = tok.pad_token_id
        wider = Rollout(
            torch.nn.functional.pad(batch.prompt_ids, (3, 0), value=pad),
            torch.nn.functional.pad(batch.prompt_mask, (3, 0)),
            torch.nn.functional.pad(batch.completion_ids, (0, 5), value=pad),
            torch.nn.functional.pad(batch.completion_mask, (0, 5)),
            batch.lengths,
            batch.truncated,
        )
        torch.testing.assert_close(sequence_scores(model, wider, precision="fp32"), scores, rtol=0, atol=1e-5)
        for i in range(len(REPLIES)):
            alone = sequence_scores(model, batch_of(tok, PROMPTS[i : i + 1], REPLIES[i : i + 1]), precision="fp32")
            torch.testing.assert_close(alone, scores[i : i + 1], rtol=0, atol=1e-5)
    assert scores.std() > 1e-4  # the replies really score differently


def test_mean_pooling_scores_the_mean_of_the_reply_states_whatever_the_padding(reward_model_dir: Path) -> None:
    """pooling "mean": head(mean of the final hidden states over the reply's tokens, EOS included), computed here by
    hand from one unpadded forward per row; padding on either side and batch neighbours change nothing."""
    rm = load_reward_model(reward_model_dir, precision="fp32")
    tok, model = rm.tokenizer, rm.model
    backbone = getattr(model, model.base_model_prefix)
    with torch.no_grad():
        scores = sequence_scores(model, batch_of(tok, PROMPTS, REPLIES), precision="fp32", pooling="mean")
        for i, (prompt, reply) in enumerate(zip(PROMPTS, REPLIES, strict=True)):
            p, c = encode_completion(tok, prompt, reply)
            hidden = backbone(input_ids=torch.tensor([p + c]))[0][0]  # [T, H]
            by_hand = model.score(hidden[len(p) :].mean(0))
            torch.testing.assert_close(scores[i : i + 1], by_hand, rtol=0, atol=1e-5)
        last = sequence_scores(model, batch_of(tok, PROMPTS, REPLIES), precision="fp32")
    assert not torch.allclose(scores, last)  # a different reading of the same states


def test_score_is_read_at_the_eos_even_when_pad_equals_eos(reward_model_dir: Path) -> None:
    rm = load_reward_model(reward_model_dir, precision="fp32")
    tok = rm.tokenizer
    enc = [encode_completion(tok, p, r) for p, r in zip(PROMPTS, REPLIES, strict=True)]
    prompts, replies = [p for p, _ in enc], [c for _, c in enc]
    with torch.no_grad():
        distinct = sequence_scores(rm.model, completion_batch(prompts, replies, tok.pad_token_id), precision="fp32")
        same = sequence_scores(rm.model, completion_batch(prompts, replies, tok.eos_token_id), precision="fp32")
    torch.testing.assert_close(same, distinct, rtol=0, atol=1e-5)


def test_saved_reward_model_reloads_with_peft_and_scores_batched_as_one_by_one(
    reward_model_dir: Path, random_model_dir: Path
) -> None:
    from transformers import AutoModelForSequenceClassification

    rm = load_reward_model(reward_model_dir, precision="fp32")
    batched = rm.score(PROMPTS, REPLIES, batch_size=3)
    single = torch.cat([rm.score(PROMPTS[i : i + 1], REPLIES[i : i + 1], batch_size=1) for i in range(4)])
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-5)
    assert load_reward_model(reward_model_dir / "adapter", precision="fp32") is rm  # loaded once per process

    # The folder is a plain PEFT adapter: the score head comes back with it.
    base = AutoModelForSequenceClassification.from_pretrained(random_model_dir, num_labels=1)
    peft = PeftModel.from_pretrained(base, str(reward_model_dir / "adapter")).eval()
    with torch.no_grad():
        again = sequence_scores(peft, batch_of(rm.tokenizer, PROMPTS, REPLIES), precision="fp32")
    torch.testing.assert_close(again, batched, rtol=0, atol=1e-5)


def test_grade_batch_scores_reward_model_leaves_alone_and_inside_multi_with_normalisation(
    reward_model_dir: Path,
) -> None:
    items = [PromptItem(p, {"messages": p, "answer": "3"}) for p in PROMPTS]
    raw = grade_batch(rm_grader(reward_model_dir), REPLIES, items)
    expected = load_reward_model(reward_model_dir).score(PROMPTS, REPLIES, batch_size=32)
    torch.testing.assert_close(raw.rewards, expected)
    assert set(raw.sub) == {"rm"}

    multi = graders.parse_grader(
        {
            "type": "multi",
            "name": "total",
            "graders": {
                "acc": {
                    "type": "string_check",
                    "name": "acc",
                    "input": "{{sample.output_text}}",
                    "reference": "{{item.answer}}",
                    "operation": "eq",
                },
                "quality": {
                    "type": "multi",
                    "name": "q",
                    "graders": {
                        "rm": {"type": "reward_model", "name": "rm", "model": str(reward_model_dir), "normalize": True}
                    },
                    "calculate_output": "rm",
                },
            },
            "calculate_output": "acc + 0.5 * quality",
        }
    )
    assert [k for k, _ in graders.model_graders(multi)] == ["quality.rm"]
    scores = grade_batch(multi, REPLIES, items)
    normalised = (expected - 0.5) / 2.0
    torch.testing.assert_close(scores.sub["quality.rm"], normalised)
    torch.testing.assert_close(scores.rewards, torch.tensor([1.0, 0, 0, 0]) + 0.5 * normalised)


def test_reward_model_grader_prompt_template_replaces_the_item_messages(reward_model_dir: Path) -> None:
    g = rm_grader(reward_model_dir, prompt=[{"role": "user", "content": "What is {{item.q}}?"}])
    assert graders.template_fields(g) == {"q"}
    items = [PromptItem(PROMPTS[1], {"q": "23 + 58", "messages": [{"role": "user", "content": "ignored"}]})]
    expected = load_reward_model(reward_model_dir).score(PROMPTS[1:2], ["81"], batch_size=1)
    torch.testing.assert_close(grade_batch(g, ["81"], items).rewards, expected)


def test_pure_grade_of_a_reward_model_grader_is_a_clear_grader_error() -> None:
    g = rm_grader(Path("runs/rm"))
    with pytest.raises(graders.GraderError, match="'rm': reward_model graders run a model over batches"):
        grade(g, output_text="5", item={"prompt": "q"})
    assert grade(g, output_text="5", item={}, model_scores={"rm": 1.5}).score == 1.5


def test_reward_model_grader_parse_errors() -> None:
    with pytest.raises(graders.GraderError, match=r"grader.prompt: .*prompt\[0\].content: the sample is the reply"):
        rm_grader(Path("x"), prompt=[{"role": "user", "content": "{{sample.output_text}}"}])
    with pytest.raises(graders.GraderError, match=r"grader\.model: "):
        graders.parse_grader({"type": "reward_model", "name": "rm", "model": ""})
    with pytest.raises(graders.GraderError, match=r"grader\.batch_size: "):
        rm_grader(Path("x"), batch_size=0)
    assert graders.check_item(rm_grader(Path("x")), {"answer": "1"}) == (
        "grader 'rm' takes its prompt from the item's 'messages' or 'prompt', and it has neither"
    )


def test_check_reward_models_names_what_is_wrong_with_the_folder(
    reward_model_dir: Path, random_model_dir: Path, tmp_path: Path
) -> None:
    check_reward_models(rm_grader(reward_model_dir, normalize=True))  # the job's output folder
    check_reward_models(rm_grader(reward_model_dir / "adapter"))  # or the adapter itself

    with pytest.raises(graders.GraderError, match=r"grader 'rm': model '.*nowhere' does not exist"):
        check_reward_models(rm_grader(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(graders.GraderError, match="holds no adapter"):
        check_reward_models(rm_grader(tmp_path / "empty"))
    policy = add_lora(
        load_base_model(str(random_model_dir), torch.device("cpu")), LoraSpec.model_validate({"r": 2}), seed=0
    )
    policy.save_pretrained(str(tmp_path / "policy"))
    with pytest.raises(graders.GraderError, match="not the output of a reward_model job"):
        check_reward_models(rm_grader(tmp_path / "policy"))

    unfinished = tmp_path / "unfinished"
    shutil.copytree(reward_model_dir / "adapter", unfinished)
    RewardModelInfo(str(random_model_dir), 64).write(unfinished)  # an intermediate checkpoint: no statistics
    check_reward_models(rm_grader(unfinished))
    with pytest.raises(graders.GraderError, match="normalize needs the score statistics"):
        check_reward_models(rm_grader(unfinished, normalize=True))

    moved = tmp_path / "moved"
    shutil.copytree(reward_model_dir / "adapter", moved)
    RewardModelInfo(str(tmp_path / "no-base"), 64).write(moved)
    with pytest.raises(graders.GraderError, match=r"the base model .*no-base.* cannot be loaded"):
        check_reward_models(rm_grader(moved))


def test_rl_spec_with_a_missing_reward_model_fails_before_any_weights_load(tmp_path: Path) -> None:
    from trainer.spec.callbacks import BaseCallback
    from trainer.train import build_trainer

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "What is 1 + 1?"}\n')
    spec = parse_spec(
        {
            "model": str(tmp_path / "no-such-model"),
            "training_file": str(data),
            "method": {"type": "grpo", "grpo": {"grader": {"type": "reward_model", "name": "rm", "model": "gone"}}},
        }
    )
    with pytest.raises(graders.GraderError, match="grader 'rm': model 'gone' does not exist"):
        build_trainer(spec, output_dir=tmp_path / "run", callback=BaseCallback())


def test_loaded_reward_model_is_merged_and_scores_as_the_adapter(reward_model_dir: Path) -> None:
    """Scoring merges the LoRA weights into the base: the same scores as the PEFT adapter on the base."""
    rm = load_reward_model(reward_model_dir, precision="fp32")
    assert not isinstance(rm.model, PeftModel)
    base = AutoModelForSequenceClassification.from_pretrained(rm.info.base_model, num_labels=1, dtype=torch.float32)
    base.config.pad_token_id = rm.tokenizer.pad_token_id
    unmerged = PeftModel.from_pretrained(base, str(rm.adapter_dir)).eval()
    batch = batch_of(rm.tokenizer, PROMPTS, REPLIES)
    with torch.no_grad():
        merged_scores = sequence_scores(rm.model, batch, precision="fp32")
        adapter_scores = sequence_scores(unmerged, batch, precision="fp32")
    torch.testing.assert_close(merged_scores, adapter_scores, rtol=0, atol=1e-5)
    assert adapter_scores.std() > 1e-4


# -- the likelihood head ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def likelihood_model_dir(random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A likelihood-head reward model: a CAUSAL_LM LoRA adapter with non-trivial weights, scale 2.5."""
    out = tmp_path_factory.mktemp("rm-likelihood") / "adapter"
    model = add_lora(load_base_model(str(random_model_dir), torch.device("cpu")), LoraSpec(r=4), seed=0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(out))
    RewardModelInfo(str(random_model_dir), 64, score_mean=0.1, score_std=3.0, head="likelihood", scale=2.5).write(out)
    return out


def test_likelihood_head_scores_the_scaled_mean_log_probability_of_the_reply(
    likelihood_model_dir: Path, random_model_dir: Path
) -> None:
    """r = s · mean over the reply's tokens and its EOS of log p(token | everything before), by hand from the
    unmerged adapter's logits of one unpadded row at a time; the loaded (merged) model scores the same in a batch."""
    from transformers import AutoModelForCausalLM

    rm = load_reward_model(likelihood_model_dir, precision="fp32")
    assert rm.info.head == "likelihood" and rm.info.scale == 2.5
    scores = rm.score(PROMPTS, REPLIES, batch_size=3)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(random_model_dir), str(likelihood_model_dir))
    for i, (prompt, reply) in enumerate(zip(PROMPTS, REPLIES, strict=True)):
        p, c = encode_completion(rm.tokenizer, prompt, reply)
        with torch.no_grad():
            logits = peft.eval()(input_ids=torch.tensor([p + c])).logits[0]
        logp = torch.log_softmax(logits[len(p) - 1 : -1], -1)[torch.arange(len(c)), torch.tensor(c)]
        assert len(c) == len(rm.tokenizer(reply, add_special_tokens=False).input_ids) + 1  # the reply and its EOS
        torch.testing.assert_close(scores[i], 2.5 * logp.mean(), rtol=0, atol=1e-4)
    grader = rm_grader(likelihood_model_dir, normalize=True)
    normalised = grade_batch(grader, REPLIES, [PromptItem(p, {"messages": p}) for p in PROMPTS]).rewards
    # The grader loads the model at the machine's precision (bf16 where bf16 is fast): its raw scores, normalised.
    raw = load_reward_model(likelihood_model_dir).score(PROMPTS, REPLIES, batch_size=grader.batch_size)
    torch.testing.assert_close(normalised, (raw - 0.1) / 3.0)


def test_a_likelihood_reward_model_is_refused_with_the_wrong_adapter_task(
    likelihood_model_dir: Path, reward_model_dir: Path, tmp_path: Path
) -> None:
    mixed = tmp_path / "mixed"
    shutil.copytree(reward_model_dir / "adapter", mixed)  # a SEQ_CLS adapter
    shutil.copy(likelihood_model_dir / "reward_model.json", mixed)  # that says it is a likelihood head
    with pytest.raises(graders.GraderError, match="task CAUSAL_LM"):
        check_reward_models(rm_grader(mixed))
