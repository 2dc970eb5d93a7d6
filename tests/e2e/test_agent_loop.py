"""Agent episodes in the RL loop, on a random Llama with tiny-calc's tokenizer and chat template and the
built-in calculator served over real HTTP:

- a scripted policy calls the calculator on even rows and answers directly (wrong) on odd ones: the rows hold the
  calls, the tool's messages and the answers token for token, only the policy's tokens are in the policy mask, the
  grader sees the final answer and the calls, and the metrics count turns, calls and the tool-call rate;
- the gradient of the loss with respect to the logits that predict tool-output tokens is exactly zero, and an episode
  of one turn trains exactly as the single-turn loop does;
- a tool server that is slow, down or answers garbage ends no job: the episodes record the error, the metrics show it;
- a sandboxed Python environment answers the calls instead of a server.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import PreTrainedTokenizerBase

from tests.e2e.test_rl_loop import make_spec
from trainer.agents import calculator_server
from trainer.algorithms.core_algos import LossScale
from trainer.builtin_models import tiny_calc
from trainer.generation.encoding import completion_batch
from trainer.generation.rollout_engine import Generation, SamplingParams
from trainer.grading.remote_graders import RemoteConfig
from trainer.grading.remote_process import configure_remote, remote_config
from trainer.loops.rl import RLTrainer
from trainer.spec import metrics as M
from trainer.spec.callbacks import BaseCallback
from trainer.spec.config import parse_spec

EXACT = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
RESPONSE = re.compile(re.escape(tiny_calc.RESPONSE_OPEN) + r"(.*?)" + re.escape(tiny_calc.RESPONSE_CLOSE), re.S)
QUESTION = re.compile(r"What is (\d+) \+ (\d+) \+ (\d+)\?")


# -- fixtures ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def calc_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("calc-data")
    tiny_calc.write_calculator_datasets(out, n_train=64)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(autouse=True)
def local_tools() -> Iterator[None]:
    """Tool servers on loopback allowed (the deployment's policy refuses them by default), short limits."""
    before = remote_config()
    configure_remote(
        RemoteConfig(url_schemes=("http",), allow_networks=("127.0.0.0/8",), timeout_s=1.0, max_retries=1, backoff_s=0)
    )
    yield
    configure_remote(before)


# -- a scripted policy -------------------------------------------------------------------------------------------


class CalcScript:
    """A rollout engine that plays the policy from a script: on a first turn where ``call(row)`` (by default, the even
    rows of the batch: half of each group) it calls the calculator with the question's sum, and answers with the
    tool's result on the turn after; elsewhere it answers a wrong sum at once. No log-probs: the loop computes the
    behaviour policy's itself."""

    exact_logprobs = False

    def __init__(self, tok: PreTrainedTokenizerBase, *, call: Callable[[int], bool] = lambda row: row % 2 == 0):
        self.tok, self.call = tok, call
        self.turn_prompts: list[list[list[int]]] = []

    def push_weights(self, policy: torch.nn.Module, version: int) -> None:
        pass

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, generator: torch.Generator | None
    ) -> Generation:
        self.turn_prompts.append([list(p) for p in prompts])
        replies = []
        for row, p in enumerate(prompts):
            text = self.tok.decode(list(p), skip_special_tokens=False)
            numbers = [int(x) for x in QUESTION.findall(text)[-1]]
            results = RESPONSE.findall(text)
            if results:
                reply = results[-1]
            elif self.call(row):
                reply = tiny_calc.tool_call_text(tiny_calc.expression_text(numbers))
            else:
                reply = str(sum(numbers) + 1)
            ids = self.tok.encode(reply, add_special_tokens=False)[: params.max_new_tokens - 1]
            replies.append([*ids, self.tok.eos_token_id])
        return Generation(completion_batch([list(p) for p in prompts], replies, self.tok.pad_token_id), None, 0.0)


def scripted(**kw: Any) -> Callable[[PeftModel, PreTrainedTokenizerBase], CalcScript]:
    return lambda policy, tok: CalcScript(tok, **kw)


def agent_spec(model: Path, data: Path, tools: list[dict[str, Any]] | None, method: str = "grpo", **hp: Any) -> dict:
    raw = make_spec(model, data, method, max_completion_tokens=40, eval_interval=0, **hp)
    raw["training_file"] = str(data / "train.jsonl")
    raw["validation_file"] = str(data / "validation.jsonl")
    body = raw["method"][method]
    body["grader"] = EXACT
    if tools is not None:
        body["tools"] = tools
        body["max_episode_steps"] = 3
    return raw


# -- the rows, the grading and the metrics ----------------------------------------------------------------------


def test_episodes_hold_calls_results_and_answers_and_only_the_policy_tokens_are_trained(
    random_calc_model_dir: Path, calc_data: Path, calculator: str, tmp_path: Path
) -> None:
    spec = parse_spec(agent_spec(random_calc_model_dir, calc_data, [calculator_server.calculator_tool(calculator)]))
    t = RLTrainer(spec, output_dir=tmp_path, callback=BaseCallback(), rollout_engine=scripted())
    tok = t.prompts.tokenizer
    batch = t.collect()
    ro, samples = batch.rollout.to("cpu"), batch.samples
    assert samples.episodes is not None and len(samples.episodes) == len(batch) == 16
    for i, ep in enumerate(samples.episodes):
        numbers = [int(x) for x in QUESTION.findall(samples.items[i].messages[-1]["content"])[0]]
        total = str(sum(numbers))
        n = int(ro.lengths[i])
        row = ro.completion_ids[i, :n].tolist()
        policy = ro.policy_mask[i, :n].tolist()
        if i % 2 == 0:  # call, tool message, answer: exactly these tokens, in this order
            call = tok.encode(tiny_calc.tool_call_text(tiny_calc.expression_text(numbers)), add_special_tokens=False)
            env = tok.encode(tiny_calc.tool_response_text(total), add_special_tokens=False)
            answer = tok.encode(total, add_special_tokens=False)
            eos = tok.eos_token_id
            assert row == [*call, eos, *env, *answer, eos]
            assert policy == [1] * (len(call) + 1) + [0] * len(env) + [1] * (len(answer) + 1)
            assert ro.turn_ids[i, :n].tolist() == [0] * (len(call) + 1) + [1] * len(env) + [2] * (len(answer) + 1)
            assert (ep.turns, ep.output_text, ep.tool_calls_by_name) == (2, total, {"calculator": 1})
            [c] = ep.output_tools
            assert c["type"] == "function" and c["function"]["name"] == "calculator"
            assert json.loads(c["function"]["arguments"]) == {"expression": tiny_calc.expression_text(numbers)}
            assert [m["role"] for m in ep.messages] == ["assistant", "tool", "assistant"]
            assert ep.messages[1] == {"role": "tool", "tool_call_id": c["id"], "content": total}
            assert float(samples.grader_rewards[i]) == 1.0
        else:  # one turn, the wrong sum: a single-turn row
            assert policy == [1] * n and ep.turns == 1 and ep.output_tools == []
            assert ep.output_text == str(int(total) + 1) and float(samples.grader_rewards[i]) == 0.0
    # the loss mask is the policy mask: tool output is never trained
    assert torch.equal(batch.loss_mask.cpu(), ro.policy_mask.float())
    m = t.step(1)  # a step draws its own batch: by the script, half the rows call, and exactly those are right
    assert m[M.EPISODE_TOOL_CALL_RATE] == m[M.REWARD_MEAN] == 0.5
    assert m[M.TOOL_CALLS_OF.name("calculator")] == pytest.approx(m[M.EPISODE_TOOL_CALL_RATE])
    assert m[M.EPISODE_TURNS_MEAN] == pytest.approx(1 + m[M.EPISODE_TOOL_CALL_RATE])
    assert m[M.TOOL_ERROR_RATE] == 0.0 and m[M.TOOL_ERRORS_OF.name("calculator")] == 0.0
    assert m[M.EPISODE_FORMAT_ERROR_FRAC] == 0.0


@pytest.mark.parametrize("share_prompts", [False, True])
def test_the_loss_gradient_on_tool_output_logits_is_exactly_zero(
    random_calc_model_dir: Path, calc_data: Path, calculator: str, tmp_path: Path, share_prompts: bool
) -> None:
    """With whole rows (one forward: logits[:, j] predicts completion token j) and with each group's prompt run once
    (its forward gives the logits that predict token 0, the completions' forward those of tokens 1 …)."""
    spec = parse_spec(
        agent_spec(random_calc_model_dir, calc_data, [calculator_server.calculator_tool(calculator)], beta=0.1)
    )
    t = RLTrainer(spec, output_dir=tmp_path, callback=BaseCallback(), rollout_engine=scripted())
    t.engine.share_prompts = share_prompts
    batch = t.collect()
    t.score(batch)
    adv = t.advantages(batch)
    captured: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
        out.retain_grad()
        captured.append(out)

    head = t.models.model.get_output_embeddings()
    handle = head.register_forward_hook(keep)
    try:
        idx = torch.arange(len(batch))
        scale = LossScale(float(batch.loss_mask.sum()), len(batch), t.hp.max_completion_tokens)
        t.engine.zero_grad()
        t.updater.micro_batch(batch, adv, idx, scale, first_pass=True)
    finally:
        handle.remove()
    ro = batch.rollout
    c = ro.completion_ids.shape[1]
    if share_prompts:
        prompts, completions = captured  # [distinct prompts, 1, V], then [B, C − 1, V]
        assert prompts.shape[:2] == (len(set(map(tuple, ro.prompt_ids.tolist()))), 1) < (len(batch), 1)
        assert prompts.grad is not None and completions.grad is not None
        assert completions.shape[:2] == (len(batch), c - 1)
        per_position = torch.cat(
            [prompts.grad.abs().sum(-1).new_ones(len(batch), 1), completions.grad.abs().sum(-1)], 1
        )
    else:
        [logits] = captured
        assert logits.grad is not None
        assert logits.grad.shape[:2] == (len(batch), c + 1)  # logits[:, j] predicts completion token j
        per_position = logits.grad[:, :c].abs().sum(-1)
    per_position = per_position.cpu()
    env = (ro.completion_mask.bool() & ~ro.policy_mask.bool()).cpu()
    assert env.any()  # the batch has tool output to test
    assert not env[:, 0].any()  # token 0 is the policy's: what the prompts' forward predicts is not at stake
    assert per_position[env].eq(0).all()  # exactly zero, not small
    assert per_position[~ro.completion_mask.bool().cpu()].eq(0).all()
    assert per_position[ro.policy_mask.bool().cpu()].gt(0).any()


def test_an_episode_of_one_turn_trains_exactly_as_a_single_reply(
    random_calc_model_dir: Path, calc_data: Path, calculator: str, tmp_path: Path
) -> None:
    """Nobody calls: every episode is one turn. The agent job's metrics and trained weights equal the plain job's. (An
    environment job that offers no tools: the prompts are the plain job's token for token, which a tool list in the
    template would change.)"""
    never = scripted(call=lambda row: False)
    raw = agent_spec(random_calc_model_dir, calc_data, None)
    raw["method"]["grpo"]["environment"] = {"type": "python", "source": ENVIRONMENT}
    with_tools = parse_spec(raw)
    assert with_tools.method.agent is not None
    plain = parse_spec(agent_spec(random_calc_model_dir, calc_data, None))
    runs = []
    for spec in (with_tools, plain):
        t = RLTrainer(spec, output_dir=tmp_path / str(len(runs)), callback=BaseCallback(), rollout_engine=never)
        m = t.step(1)
        runs.append((m, [p.detach().clone() for p in t.models.params]))
    (m_tools, p_tools), (m_plain, p_plain) = runs
    shared = {k for k in m_plain if k not in M.TIMING_METRICS}
    assert {k: m_tools[k] for k in shared} == {k: m_plain[k] for k in shared}
    assert all(torch.equal(a, b) for a, b in zip(p_tools, p_plain, strict=True))
    assert m_tools[M.EPISODE_TURNS_MEAN] == 1.0 and m_tools[M.EPISODE_TOOL_CALL_RATE] == 0.0


def test_sampled_agent_validation_leaves_the_training_as_it_is(
    random_calc_model_dir: Path, calc_data: Path, calculator: str, tmp_path: Path
) -> None:
    """eval_samples 3 samples the validation episodes at the job's temperature from the validation's own RNG: with
    LoRA dropout on (which draws from torch's global RNG), the training's metrics and adapter equal those of a run
    validating with one greedy episode a prompt."""
    runs = []
    for k in (3, 1):
        hp = {"max_steps": 2, "batch_size": 2, "group_size": 2, "eval_prompts": 2}
        raw = agent_spec(
            random_calc_model_dir, calc_data, [calculator_server.calculator_tool(calculator)], eval_samples=k, **hp
        )
        raw["method"]["grpo"].update(max_episode_steps=2, lora={"r": 4, "dropout": 0.5})
        raw["method"]["grpo"]["hyperparameters"].update(max_completion_tokens=8, eval_interval=1)
        t = RLTrainer(parse_spec(raw), output_dir=tmp_path / str(k), callback=BaseCallback())
        steps = [t.step(1), t.step(2)]
        assert all(M.VAL_REWARD_MEAN in m for m in steps)
        runs.append(([_training_metrics(m) for m in steps], [p.detach().clone() for p in t.models.params]))
    (m_sampled, p_sampled), (m_greedy, p_greedy) = runs
    assert m_sampled == m_greedy
    assert all(torch.equal(a, b) for a, b in zip(p_sampled, p_greedy, strict=True))


def _training_metrics(m: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in m.items() if not k.startswith("val/") and k not in M.TIMING_METRICS}


# -- faults: a tool server that is slow, down or answers garbage --------------------------------------------------


class _Garbage(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = b"<html>not json</html>"
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the slow case: the client gave up (its timeout)
            pass

    def log_message(self, *args: Any) -> None:
        pass


class _Slow(_Garbage):
    def do_POST(self) -> None:
        time.sleep(3.0)
        super().do_POST()


@pytest.mark.alone  # a slow server's calls are timed (cut at once, side by side)
@pytest.mark.parametrize("fault", ["down", "slow", "garbage"])
def test_a_faulty_tool_server_ends_no_job_and_the_metrics_show_it(
    fault: str, random_calc_model_dir: Path, calc_data: Path, tmp_path: Path
) -> None:
    server = None
    if fault == "down":
        url = f"http://127.0.0.1:{_free_port()}/"  # nothing listens there
    else:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Slow if fault == "slow" else _Garbage)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        raw = agent_spec(random_calc_model_dir, calc_data, [calculator_server.calculator_tool(url)], max_steps=2)
        t = RLTrainer(parse_spec(raw), output_dir=tmp_path, callback=BaseCallback(), rollout_engine=scripted())
        start = time.monotonic()
        result = t.run()
        elapsed = time.monotonic() - start
    finally:
        if server is not None:
            server.shutdown()
    m = result.final_metrics
    assert m[M.TOOL_ERROR_RATE] == 1.0  # every call failed ...
    assert m[M.TOOL_ERRORS_OF.name("calculator")] > 0 and m[M.EPISODE_TOOL_CALL_RATE] > 0
    assert m[M.REWARD_MEAN] == 0.0  # ... the model saw the error and could not answer from it
    # a slow server is cut at the timeout (1 s, one retry) for every call of a turn at once, not one after another
    assert elapsed < 60, elapsed


# -- a sandboxed Python environment -----------------------------------------------------------------------------

ENVIRONMENT = """
import json

def reset(item):
    return None

def step(tool_call):
    expression = json.loads(tool_call["arguments"])["expression"]
    return str(sum(int(x) for x in expression.split("+"))), False
"""


def test_a_python_environment_answers_the_calls_in_a_sandbox(
    random_calc_model_dir: Path, calc_data: Path, tmp_path: Path
) -> None:
    raw = agent_spec(random_calc_model_dir, calc_data, None)
    body = raw["method"]["grpo"]
    body["tools"] = [{"name": "calculator", "description": calculator_server.DESCRIPTION}]
    body["environment"] = {"type": "python", "source": ENVIRONMENT}
    t = RLTrainer(parse_spec(raw), output_dir=tmp_path, callback=BaseCallback(), rollout_engine=scripted())
    batch = t.collect()
    eps = batch.samples.episodes
    assert eps is not None
    for i, ep in enumerate(eps):
        if ep.tool_calls_by_name:
            assert ep.messages[1]["role"] == "tool" and ep.output_text == ep.messages[1]["content"]
            assert float(batch.samples.grader_rewards[i]) == 1.0
    assert any(ep.tool_calls_by_name for ep in eps)
