"""This process's remote graders (score_model, label_model, endpoint, cosine): the deployment's judge, embeddings
endpoint, URL policy and limits, and the judge budget they spend, as the worker hands them to its trainer process
(`worker.runner`) or the command line sets them (`proxima eval`)."""

from trainer.grading.remote_graders import JudgeBudget, RemoteConfig

_DEFAULT_REMOTE = RemoteConfig()
_remote = (_DEFAULT_REMOTE, JudgeBudget(_DEFAULT_REMOTE.max_judge_calls))


def configure_remote(config: RemoteConfig) -> None:
    """This process's remote graders (score_model, label_model, endpoint, cosine): the deployment's judge,
    embeddings endpoint, URL policy and limits, as the worker hands them to its trainer process (`worker.runner`), and
    a fresh judge budget of `config.max_judge_calls`. Until it is called, a process has the defaults: no judge, no
    embeddings, https URLs to public addresses only."""
    global _remote
    _remote = (config, JudgeBudget(config.max_judge_calls))


def remote_config() -> RemoteConfig:
    """This process's remote configuration (`configure_remote`): an agent job's tool calls obey its URL policy and
    limits as endpoint graders do."""
    return _remote[0]


def remote_budget() -> JudgeBudget:
    """This process's judge budget (its `used` count says how many judge calls were made)."""
    return _remote[1]
