"""Data parallel training (``trainer.generation.distributed``) through the worker's launcher (``worker.launch``, torch's
elastic launcher with the gloo backend on CPUs): two ranks train exactly what one does on the same global batch, and a
killed rank fails the attempt the way a killed trainer does."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from api.tasks import RUN_JOB, queue_for
from tests.e2e.conftest import Service, grpo_spec
from tests.e2e.test_agent_loop import agent_spec
from tests.e2e.test_rl_loop import make_spec
from tests.e2e.test_worker_faults import messages, start_worker
from tests.waiting import wait_until
from trainer.agents import calculator_server
from trainer.builtin_models import tiny_calc
from trainer.grading.remote_graders import RemoteConfig
from trainer.spec import metrics as M
from worker import messages as msg
from worker.runner import REMOTE_GRADERS_ENV
from worker.trainer_process import Ended, TrainerProcess

pytestmark = pytest.mark.slow


def run_ranks(
    run_dir: Path, spec: dict[str, Any], ranks: int, *, timeout: float = 600, env: dict[str, str] | None = None
) -> list[Any]:
    """Run the spec's trainer as ``ranks`` ranks the way the worker does; its messages, in order."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.json").write_text(json.dumps(spec))
    trainer = TrainerProcess(run_dir, stop_grace_s=30, ranks=ranks, env=env)
    messages: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                m = trainer.get(timeout=0.5)
            except Ended:
                break
            if m is not None:
                messages.append(m)
        rc = trainer.close()
    finally:
        trainer.kill()
    assert rc == 0, (rc, [m for m in messages if isinstance(m, msg.Error)], trainer.stderr_tail(40))
    return messages


def adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "adapter" / "adapter_model.safetensors")


COMPARED = {
    "grpo": (M.LOSS_TOTAL, M.GRAD_NORM, M.KL_MEAN, M.ENTROPY_MEAN, M.ADVANTAGE_STD),
    "ppo": (M.LOSS_TOTAL, M.GRAD_NORM, M.KL_MEAN, M.ENTROPY_MEAN, M.ADVANTAGE_STD, M.LOSS_VALUE),
    "supervised": (M.LOSS_TOTAL, M.GRAD_NORM, M.TOKEN_ACCURACY),
    "dpo": (M.LOSS_TOTAL, M.GRAD_NORM, M.PREFERENCE_ACCURACY, M.PREFERENCE_MARGIN),
}


def method_spec(method: str, model: Path, data: Path) -> dict[str, Any]:
    """3 steps whose batches split unevenly between two ranks (RL: 3 groups, 2 on rank 0; 2 mini-batches of 6 rows,
    their shares 3 and 3; 5 examples or pairs, 3 on rank 0)."""
    if method in ("grpo", "ppo"):
        hp = {"max_steps": 3, "batch_size": 3, "group_size": 4, "beta": 0.05, "mini_batches": 2,
              "micro_batch_size": 2, "checkpoint_interval": 3, "eval_interval": 0}  # fmt: skip
        return make_spec(model, data, method, **hp)
    files = {"supervised": ("supervised", "validation_supervised"), "dpo": ("preferences", "validation_preferences")}
    train, val = files[method]
    hp = {"max_steps": 3, "batch_size": 5, "micro_batch_size": 2, "checkpoint_interval": 3, "eval_interval": 0,
          "precision": "fp32", "learning_rate": 1e-2}  # fmt: skip
    return {
        "model": str(model),
        "training_file": str(data / f"{train}.jsonl"),
        "validation_file": str(data / f"{val}.jsonl"),
        "seed": 3,
        "method": {"type": method, method: {"hyperparameters": hp}},
    }


@pytest.mark.parametrize("method", ["grpo", "ppo", "supervised", "dpo"])
def test_two_ranks_train_what_one_does_on_the_same_global_batch(
    method: str, random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    spec = method_spec(method, random_model_dir, arithmetic_data)
    runs = {n: run_ranks(tmp_path / f"ranks-{n}", spec | {"resources": {"gpus": n}}, n) for n in (1, 2)}
    metrics = {n: {m.step: m.metrics for m in ms if isinstance(m, msg.Metrics)} for n, ms in runs.items()}
    assert sorted(metrics[1]) == sorted(metrics[2]) == [1, 2, 3]
    compared = COMPARED[method]
    for step in (1, 2, 3):
        one, two = metrics[1][step], metrics[2][step]
        if method in ("grpo", "ppo"):
            assert one[M.REWARD_MEAN] == two[M.REWARD_MEAN]  # the same completions were sampled
        # Step 1 starts from the same weights: its loss and gradient agree to float rounding. Later steps start from
        # weights that Adam moved by about ±lr each whatever the gradient's size, float noise included (one rank on
        # one thread differs from one rank on two by as much: measured 8e-5 in PPO's step-3 gradient norm).
        rel = 1e-5 if step == 1 else 2e-3
        for name in compared:
            assert two[name] == pytest.approx(one[name], rel=rel, abs=1e-7), (step, name)
    assert metrics[1][1][M.GRAD_NORM] > 0
    one, two = adapter(tmp_path / "ranks-1"), adapter(tmp_path / "ranks-2")
    assert one.keys() == two.keys()
    assert any(bool(t.abs().max() > 0) for name, t in one.items() if "lora_B" in name)  # B starts at 0: it trained
    for name in one:  # (one thread against two: up to 7e-4 after PPO's 6 optimiser steps)
        assert float((two[name] - one[name]).norm()) <= 1e-2 * float(one[name].norm()) + 1e-7, name
    # one checkpoint, written once (rank 0), at step 3, and every message came from rank 0 alone
    assert [m.step for m in runs[2] if isinstance(m, msg.Checkpoint)] == [3]
    assert sum(isinstance(m, msg.Started) for m in runs[2]) == 1
    assert sum(isinstance(m, msg.Done) for m in runs[2]) == 1


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_sharded_base_computes_what_the_whole_one_does(
    random_model_dir: Path, tmp_path: Path, precision: str
) -> None:
    """Two ranks each hold half of the frozen base (FSDP2, the LoRA weights whole on both; in bf16 the linears are
    bf16 beside fp32 norms): the logits and LoRA gradients of uneven shares of rows equal the unsharded policy's,
    sampling in lockstep gives each rank's rows what they get alone, and a rank with no prompts decodes for the
    other's. A policy loaded by rank 0 alone (rank 1's on the meta device) computes the same once sharded."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         "-m", "tests.sharded_ranks", str(random_model_dir), precision, str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        _, stderr = launcher.communicate(timeout=300)
    finally:  # the ranks too, should they hang (a collective one rank never joins)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 0, stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["base_is_sharded"] and r["lora_is_whole"] and r["layers"] == 2
        assert r["held"] == r["total"] // 2
        assert r["logits_max_diff"] <= 1e-6 * r["logits_scale"]  # the same weights, gathered: the same sums
        # loaded by rank 0 alone (rank 1 on the meta device), rank 1's shard and LoRA weights received: the same
        assert r["from_rank0"] == [False, True] and r["received_logits_max_diff"] <= 1e-6 * r["logits_scale"]
        assert r["grad_max_diff"] <= 1e-6 * r["grad_scale"] and r["grad_scale"] > 0
        assert r["completions_equal"]
    assert ranks[1]["lengths"] == [1] and max(ranks[0]["lengths"]) > 1  # rank 1 decoded on past its row's end
    assert ranks[1]["rows_of_no_prompts"] == 0 and ranks[0]["greedy_equal"]  # a rank with none ran a padding row
    for r in ranks:  # gathered whole for a generation (gather_for_generation), then sharded again
        assert r["whole_inside_gathered"] and r["gathered_completions_equal"] and r["base_is_sharded"]


@pytest.mark.parametrize(
    ("method", "gather", "critic"),
    [("grpo", False, None), ("rloo", True, None), ("ppo", False, "adapter"), ("ppo", True, "policy_trunk")],
)
def test_two_ranks_sharing_a_sharded_base_train_what_one_unsharded_does(
    method: str, gather: bool, critic: str | None, random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    """``resources.shard_base``: each rank holds half the frozen base (FSDP2) and the ranks run every pass in lockstep,
    their shares uneven everywhere: sampling (groups 2 and 1: 6 rows and 3, decoding on while either rank runs),
    the reference pass (9 rows: 5 and 4, a micro-batch a row), the mini-batches (3 rows: shares 2 and 1) and
    validation (5 prompts: 3 and 2); with ``gather_for_generation`` the base is gathered whole for each generation.
    PPO's critic is on the sharded base too: its own LoRA adapter there (whole on each rank, as the policy's) or a
    head on the policy's trunk, its V_old pass and its update's passes in lockstep like the policy's.
    The training is one unsharded rank's on the same global batch, and (PPO with its adapter critic, whose checkpoint
    holds two adapters and their optimiser states) the checkpoint resumes on one rank."""
    hp: dict[str, Any] = {
        "max_steps": 3,
        "batch_size": 3,
        "group_size": 3,
        "beta": 0.05,
        "mini_batches": 3,
        "micro_batch_size": 1,
        "checkpoint_interval": 3,
        "eval_interval": 3,
        "eval_prompts": 5,
        "max_completion_tokens": 32,
    }  # fmt: skip  (the random model's EOS: the ranks' rows end at different steps)
    if critic is not None:  # PPO at μ = 1, as the others: its default μ = 4 makes 12 Adam steps of a step, over which
        # float noise grew past the tolerance (measured: 0.5 % in step 3's loss as one token crossed the clip range)
        hp |= {"critic": critic, "iterations_per_batch": 1}
    spec = make_spec(random_model_dir, arithmetic_data, method, **hp)
    one = run_ranks(tmp_path / "one", spec, 1)
    sharded = {"gpus": 2, "shard_base": True, "gather_for_generation": gather}
    two = run_ranks(tmp_path / "sharded", spec | {"resources": sharded}, 2)
    metrics = {n: {m.step: m.metrics for m in ms if isinstance(m, msg.Metrics)} for n, ms in ((1, one), (2, two))}
    assert sorted(metrics[1]) == sorted(metrics[2]) == [0, 1, 2, 3]
    for step in (0, 3):  # greedy validation: the same completions, graded alike
        assert metrics[2][step][M.VAL_REWARD_MEAN] == metrics[1][step][M.VAL_REWARD_MEAN]
    for step in (1, 2, 3):
        a, b = metrics[1][step], metrics[2][step]
        assert b[M.REWARD_MEAN] == a[M.REWARD_MEAN]  # the same completions were sampled
        rel = 1e-5 if step == 1 else 2e-3
        for name in COMPARED["ppo" if method == "ppo" else "grpo"]:  # PPO's: the value loss too
            assert b[name] == pytest.approx(a[name], rel=rel, abs=1e-7), (step, name)
    assert metrics[1][1][M.GRAD_NORM] > 0 and metrics[1][3][M.KL_MEAN] > 1e-4  # (the reference pass is compared)
    sharded = [m for m in two if isinstance(m, msg.Event) and "sharded across 2 devices" in m.message]
    assert len(sharded) == 1  # rank 0's word: it holds half of the base (each matrix's rows split in two)
    held, total = sharded[0].data["held"], sharded[0].data["total"]
    assert held == total // 2 and sharded[0].data["layers"] == 2
    assert sharded[0].data["loaded_by_rank0_only"]  # rank 1 read no weights: its shard came from rank 0
    a, b = adapter(tmp_path / "one"), adapter(tmp_path / "sharded")
    assert a.keys() == b.keys()
    for name in a:
        assert float((b[name] - a[name]).norm()) <= 1e-2 * float(a[name].norm()) + 1e-7, name
    if critic != "adapter":  # resumed once, where the checkpoint holds the most: the policy's and a critic's adapters
        return
    # the sharded run's checkpoint (whole LoRA weights and optimiser state, as any) resumes on one rank
    hp5 = spec["method"][method]["hyperparameters"] | {"max_steps": 4, "eval_interval": 0}
    resumed = spec | {"method": {"type": method, method: spec["method"][method] | {"hyperparameters": hp5}}}
    rest = run_ranks(tmp_path / "sharded", resumed, 1)
    said = [m for m in rest if isinstance(m, msg.Event) and m.message.startswith("resumed from checkpoint")]
    assert said and said[0].data["step"] == 3
    assert [m.step for m in rest if isinstance(m, msg.Metrics)] == [4]


def test_two_ranks_run_an_agent_jobs_episodes_as_one_does(
    tiny_calc_dir: Path, calculator: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """A GRPO job whose policy calls the calculator tool over HTTP (multi-turn episodes): each rank runs the episodes
    of its block of groups, every turn of a row sampled from the row's own seed, and the two ranks train what one
    does on the same global batch."""
    data = tmp_path_factory.mktemp("calc-data")
    tiny_calc.write_calculator_datasets(data, n_train=32)
    tools = [calculator_server.calculator_tool(calculator)]
    hp = {"max_steps": 2, "batch_size": 3, "group_size": 4, "beta": 0.05, "checkpoint_interval": 2}
    spec = agent_spec(tiny_calc_dir, data, tools, **hp)
    loopback = RemoteConfig(url_schemes=("http",), allow_networks=("127.0.0.0/8",), timeout_s=5.0, max_retries=1)
    env = {REMOTE_GRADERS_ENV: loopback.model_dump_json()}
    runs = {n: run_ranks(tmp_path / f"ranks-{n}", spec | {"resources": {"gpus": n}}, n, env=env) for n in (1, 2)}
    metrics = {n: {m.step: m.metrics for m in ms if isinstance(m, msg.Metrics)} for n, ms in runs.items()}
    assert sorted(metrics[1]) == sorted(metrics[2]) == [1, 2]
    for step in (1, 2):
        one, two = metrics[1][step], metrics[2][step]
        # the same episodes: their rewards, tool calls and turns
        for name in (M.REWARD_MEAN, M.EPISODE_TOOL_CALL_RATE, M.EPISODE_TURNS_MEAN):
            assert two[name] == one[name], (step, name)
        rel = 1e-5 if step == 1 else 2e-3
        for name in (M.LOSS_TOTAL, M.GRAD_NORM, M.KL_MEAN):
            assert two[name] == pytest.approx(one[name], rel=rel, abs=1e-7), (step, name)
    assert metrics[1][1][M.EPISODE_TOOL_CALL_RATE] > 0  # the policy called the tool: episodes of several turns
    assert metrics[1][1][M.GRAD_NORM] > 0
    one, two = adapter(tmp_path / "ranks-1"), adapter(tmp_path / "ranks-2")
    for name in one:
        assert float((two[name] - one[name]).norm()) <= 1e-2 * float(one[name].norm()) + 1e-7, name


def two_rank_grpo(model: Path, data: Path, *, steps: int) -> dict[str, Any]:
    """A GRPO spec asking for two devices: 4 groups of 2, a checkpoint every 2 steps, no validation."""
    hp = {"max_steps": steps, "batch_size": 4, "group_size": 2, "checkpoint_interval": 2, "eval_interval": 0}
    return make_spec(model, data, "grpo", **hp) | {"resources": {"gpus": 2}}


def rank_pid(where: Path, rank: int) -> int | None:
    """The pid of a trainer's rank ``rank`` (its environment says RANK) whose run folder is ``where`` or under it."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        here = any(arg.startswith(str(where).encode()) for arg in cmdline)
        if b"worker.runner" in cmdline and here and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    return None


def signal_pending(pid: int, sig: signal.Signals) -> bool:
    """``sig`` was sent to process ``pid`` and is not delivered yet (as to a stopped process)."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    pending = [int(line.split()[1], 16) for line in status if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask >> (sig - 1) & 1 for mask in pending)


def test_a_killed_rank_ends_the_attempt_as_a_killed_trainer_and_the_job_resumes_on_another_number_of_ranks(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    spec = two_rank_grpo(random_model_dir, arithmetic_data, steps=6)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "spec.json").write_text(json.dumps(spec))
    trainer = TrainerProcess(run_dir, stop_grace_s=30, ranks=2)
    messages: list[Any] = []
    try:
        deadline = time.monotonic() + 300
        while not any(isinstance(m, msg.Checkpoint) for m in messages) and time.monotonic() < deadline:
            if (m := trainer.get(timeout=0.5)) is not None:
                messages.append(m)
        pid, other = rank_pid(run_dir, 1), rank_pid(run_dir, 0)
        assert pid is not None and other is not None
        # Rank 0 held outside any collective while rank 1 is killed (as when it is busy sampling its own block): the
        # launcher sees rank 1 dead first and ends rank 0 with its SIGTERM, which it counts as a failure too.
        os.kill(other, signal.SIGSTOP)
        os.kill(pid, signal.SIGKILL)
        # The launcher has seen rank 1 dead once it has sent rank 0 its SIGTERM (pending while rank 0 is stopped).
        wait_until(lambda: signal_pending(other, signal.SIGTERM), "the launcher to end rank 0", timeout=60)
        os.kill(other, signal.SIGCONT)
        with pytest.raises(Ended):
            while time.monotonic() < deadline:
                if (m := trainer.get(timeout=0.5)) is not None:
                    messages.append(m)
        trainer.close()
    finally:
        trainer.kill()
    # what the worker sees of a trainer the kernel killed: SIGKILL it did not send (it trains again, once)
    assert trainer.killed_by_someone_else
    said = [m for m in messages if isinstance(m, msg.Event) and m.data.get("rank") == 1]
    assert said and said[0].data["signal"] == "SIGKILL" and said[0].level == "warn"
    assert not any(isinstance(m, msg.Error | msg.Done) for m in messages)  # rank 0 blamed nobody
    assert rank_pid(run_dir, 0) is None  # no rank outlives its launcher
    saved = [m.step for m in messages if isinstance(m, msg.Checkpoint)]
    # the next attempt, on one rank, resumes from rank 0's checkpoint
    rest = run_ranks(run_dir, spec | {"resources": {"gpus": 1}}, 1)
    resumed = [m for m in rest if isinstance(m, msg.Event) and m.message.startswith("resumed from checkpoint")]
    assert resumed and resumed[0].data["step"] == max(saved)
    steps = [m.step for m in rest if isinstance(m, msg.Metrics)]
    assert steps == list(range(max(saved) + 1, 7))
    assert any(isinstance(m, msg.Done) for m in rest)


def test_a_two_device_job_waits_for_a_worker_with_two_and_survives_a_killed_rank(
    make_service: Callable[..., Service], random_model_dir: Path, arithmetic_data: Path
) -> None:
    """Real workers on PostgreSQL and Redis: one with one device leaves the job in its queue; one with two runs it as
    two ranks; a rank killed mid-run is the killed trainer the worker retries once from the stored checkpoint (here
    on two ranks again), and the job succeeds with every step recorded once."""
    svc = make_service()
    spec = grpo_spec(str(random_model_dir), steps=6, checkpoint_interval=2, eval_interval=3) | {
        "resources": {"gpus": 2}
    }
    job_id = svc.create_job(spec, arithmetic_data)
    start_worker(svc, "one-device", env={"PROXIMA_WORKER_DEVICES": "1"})
    svc.celery.send_task(RUN_JOB, args=[job_id], queue=queue_for(2))
    log = svc.root / "worker-one-device.log"
    svc.wait_for("the one-device worker", lambda: "takes jobs from ['celery']" in log.read_text(errors="replace"))

    def takes_a_job_from_its_queue() -> None:
        probe = svc.create_job(grpo_spec(str(random_model_dir), steps=2), arithmetic_data, status="cancelled")
        svc.send(probe)  # a one-device job's queue; cancelled, so the worker skips it
        svc.wait_for("the one-device worker's next job", lambda: f"job {probe} not claimable" in log.read_text())

    # Two, one after the other: a worker runs its tasks in the order it got them, so by the second it has run what
    # it took with the first (its queues' messages then, the two-device job's among them were it reading that queue).
    takes_a_job_from_its_queue()
    takes_a_job_from_its_queue()
    assert svc.job(job_id).status == "queued" and svc.job(job_id).lease_owner is None

    start_worker(svc, "two-devices", env={"PROXIMA_WORKER_DEVICES": "2"})
    svc.wait_for("the first checkpoint", lambda: svc.checkpoints(job_id), timeout=180)
    rank1 = svc.wait_for("rank 1", lambda: rank_pid(svc.root / "home", 1))
    os.kill(rank1, signal.SIGKILL)

    job = svc.wait_status(job_id, "succeeded", "failed", "cancelled", timeout=300)
    said = messages(svc, job_id)
    assert job.status == "succeeded", (job.error, said, svc.worker_logs())
    assert job.lease_owner is None
    assert any(m.startswith("rank 1 of the trainer's 2 was ended by SIGKILL") for m in said), said
    assert any("training again from the checkpoint at step" in m for m in said), said
    assert svc.metric_steps(job_id) == [0, 1, 2, 3, 4, 5, 6]  # each step once (validation at 0, 3 and 6)
    assert [c.step_number for c in svc.checkpoints(job_id)] == [2, 4, 6]


def test_proxima_train_runs_a_spec_asking_for_two_devices_as_two_ranks(
    random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    """The command line relaunches itself under torch's launcher; rank 0 writes the run folder, as one rank would."""
    spec = two_rank_grpo(random_model_dir, arithmetic_data, steps=2)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "train", str(spec_file), "--output", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PROXIMA_HOME": str(tmp_path / "home")},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("adapter: ") == 1  # rank 0 alone speaks
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # written once, by rank 0
    assert (out / "adapter" / "adapter_model.safetensors").exists()
