"""The over-optimisation signature (Gao et al. 2022, arXiv 2210.10760): the reward a policy is trained on keeps
rising while a reward it is not trained on, closer to the truth, falls.

A job shows it when its grader is a `multi` with held-out sub-graders (`graders.held_out_keys`: scored, not in
`calculate_output`), for example a reward model trained on beside the true answer checked for validation only. At
every validation :class:`OveroptimisationWatch` compares the held-out graders' greedy validation mean with its best so
far: the metric ``val/overoptimisation`` is the fall from that best while the trained reward's validation mean
(``val/reward/mean``) is above its value at the best, else 0; the first time the fall reaches ``DROP`` since the last
best, the job gets a warning event naming both curves. ``keep_best`` on the held-out grader's series makes the job's
adapter the checkpoint before the fall.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.spec import metrics as M

DROP = 0.05
"""The fall of the held-out validation mean, from its best, at which the job is warned (rewards of 0–1 graders)."""


@dataclass
class OveroptimisationWatch:
    held_out: tuple[str, ...]  # sub-grader keys not trained on
    best: float | None = None  # the held-out validation mean at its best
    proxy_at_best: float = 0.0  # the trained reward's validation mean then
    step_at_best: int = 0
    warned: bool = False

    def observe(self, step: int, m: dict[str, float]) -> tuple[float, str | None]:
        """(val/overoptimisation, a warning to send or None) for the validation metrics ``m`` of ``step``."""
        held = sum(m[M.reward_of(k, validation=True)] for k in self.held_out) / len(self.held_out)
        proxy = m[M.VAL_REWARD_MEAN]
        if self.best is None or held >= self.best:
            self.best, self.proxy_at_best, self.step_at_best, self.warned = held, proxy, step, False
            return 0.0, None
        fall = self.best - held if proxy > self.proxy_at_best else 0.0
        if fall < DROP or self.warned:
            return fall, None
        self.warned = True
        names = ", ".join(repr(k) for k in self.held_out)
        return fall, (
            f"reward over-optimisation: since step {self.step_at_best} the trained reward's validation mean rose from "
            f"{self.proxy_at_best:.3f} to {proxy:.3f} while the held-out grader {names} fell from {self.best:.3f} to "
            f"{held:.3f}; keep_best on {M.reward_of(self.held_out[0], validation=True)} keeps the checkpoint before "
            f"the fall"
        )
