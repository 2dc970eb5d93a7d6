"""The methods beyond GRPO through real workers: the RLHF pipeline (preference data → reward_model job → PPO job
graded by that reward model, fetched by the worker from the artifact store), DPO and supervised jobs."""

from __future__ import annotations

import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainer.spec import metrics as M
from trainer.spec.config import parse_spec

from .conftest import Service, service_factory

FAST = {"precision": "fp32", "checkpoint_interval": 2, "eval_samples": 8}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with service_factory(tmp_path_factory) as make:
        svc = make()
        svc.start_worker("a")
        yield svc


def data_dir(src: Path, out: Path, train: str, validation: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / train, out / "train.jsonl")
    shutil.copy(src / validation, out / "validation.jsonl")
    return out


def spec(model: Path, method: str, block: dict[str, Any]) -> dict[str, Any]:
    raw = {
        "model": str(model),
        "training_file": "file-placeholder",
        "validation_file": "file-placeholder",
        "seed": 1,
        "method": {"type": method, method: block},
    }
    return parse_spec(raw).to_json()


def run(service: Service, job_spec: dict[str, Any], data: Path) -> dict[int, dict[str, Any]]:
    job_id = service.create_job(job_spec, data)
    service.send(job_id)
    job = service.wait_status(job_id, "succeeded", "failed", timeout=180)
    assert job.status == "succeeded", (job.error, service.worker_logs()[-3000:])
    return service.metrics(job_id) | {-1: {"job_id": job_id, "model": job.fine_tuned_model}}


def test_preference_data_to_a_reward_model_job_to_a_ppo_job_graded_by_it(
    service: Service, random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    prefs = data_dir(arithmetic_data, tmp_path / "prefs", "preferences.jsonl", "validation_preferences.jsonl")
    rm_hp = {**FAST, "max_steps": 4, "batch_size": 8}
    rm = run(service, spec(random_model_dir, "reward_model", {"hyperparameters": rm_hp}), prefs)
    assert M.PREFERENCE_ACCURACY in rm[4] and M.validation(M.PREFERENCE_ACCURACY) in rm[4]
    rm_job = rm[-1]["job_id"]

    grader = {"type": "reward_model", "name": "rm", "model": rm_job, "normalize": True}  # as the API stores it
    # online RL's eval_samples is OpenAI's (completions per validation prompt): eval_prompts bounds its validation
    ppo_hp = {**FAST, "max_steps": 2, "batch_size": 4, "group_size": 2, "max_completion_tokens": 6}
    ppo_hp["eval_prompts"] = ppo_hp.pop("eval_samples")
    ppo = run(service, spec(random_model_dir, "ppo", {"grader": grader, "hyperparameters": ppo_hp}), arithmetic_data)
    assert sorted(s for s in ppo if s >= 0) == [1, 2]
    for key in (M.reward_of("rm"), M.LOSS_VALUE, M.EXPLAINED_VARIANCE, M.KL_COEF):
        assert key in ppo[2], key
    assert ppo[2][M.reward_of("rm")] == ppo[2][M.REWARD_MEAN]


def test_dpo_and_supervised_jobs_succeed_with_adapters_that_load_with_peft(
    service: Service, random_model_dir: Path, arithmetic_data: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    prefs = data_dir(arithmetic_data, tmp_path / "prefs", "preferences.jsonl", "validation_preferences.jsonl")
    conv = data_dir(arithmetic_data, tmp_path / "sft", "supervised.jsonl", "validation_supervised.jsonl")
    dpo = run(service, spec(random_model_dir, "dpo", {"hyperparameters": {**FAST, "max_steps": 2}}), prefs)
    assert M.REWARDS_CHOSEN in dpo[2] and M.PREFERENCE_MARGIN in dpo[2]
    sft = run(service, spec(random_model_dir, "supervised", {"hyperparameters": {**FAST, "max_steps": 2}}), conv)
    assert M.TOKEN_ACCURACY in sft[2] and M.VAL_LOSS in sft[2]

    for result in (dpo, sft):
        job = service.job(result[-1]["job_id"])
        adapter_file = service.file(job.result_files[1])
        archive = tmp_path / f"{job.id}.tar.gz"
        service.store.get_to_path(adapter_file.storage_key, archive)
        dest = tmp_path / job.id
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(random_model_dir), str(dest))
