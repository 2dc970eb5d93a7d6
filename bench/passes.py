"""The training passes alone, on the benchmarks' batch (``common.py``: 64 rows, prompts of 24 tokens, 32 completion
tokens): the choices behind the trainer's defaults, each pair alternating in one process, the median of
``--reps`` repetitions after a first uncounted one.

- ``lora``: a policy's forward with the graph, its backward, and a no-grad forward, with PEFT's LoRA linear
  forward against ours (``trainer/generation/lora_forward.py``), and the largest log-prob difference between them;
- ``attention``: the same passes with eager attention, grouped attention (``trainer/generation/attention.py``: eager's
maths
  without copying the key/value heads) and SDPA (the bf16 training passes on a CPU run grouped where they can, else
  eager);
- ``critic``: PPO's adapter critic, its passes apart against joined to the policy's (the update's forward and
  backward, and the rollout's no-grad passes: old, reference, V).

    python bench/passes.py --model small --precision bf16 --threads 1 --only lora,attention,critic
"""

from __future__ import annotations

import argparse
import statistics
import time
import types
from collections.abc import Callable
from typing import Any

from common import DEFAULT_WORKDIR, LORA_ALPHA, LORA_R, MODELS, SEED, build_assets, loadavg


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def alternate(sides: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """Median seconds of each side over ``reps`` runs after an uncounted first, the order flipping every round."""
    runs: dict[str, list[float]] = {k: [] for k in sides}
    names = list(sides)
    for r in range(reps + 1):
        for k in names if r % 2 == 0 else names[::-1]:
            runs[k].append(timed(sides[k]))
    return {k: statistics.median(v[1:]) for k, v in runs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--threads", type=int)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--only", default="lora,attention,critic")
    a = p.parse_args()

    import torch
    from peft.tuners.lora import Linear as LoraLinear

    from trainer.generation.lora_forward import _forward, install
    from trainer.generation.rollout import Rollout, completion_logprobs
    from trainer.loops.critic import Critic
    from trainer.loops.engine import load_policy
    from trainer.spec.lora import LoraSpec

    if a.threads:
        torch.set_num_threads(a.threads)
    model_dir, _ = build_assets(DEFAULT_WORKDIR, a.model)
    lora = LoraSpec(r=LORA_R, alpha=LORA_ALPHA, target_modules="all-linear")
    model = load_policy(str(model_dir), lora, device=torch.device("cpu"), precision=a.precision, seed=SEED).model
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():  # a trained-looking adapter: B = 0 would make the LoRA path a no-op
        for n, w in model.named_parameters():
            if "lora_B" in n:
                w.copy_(torch.randn(w.shape, generator=g) * 0.1)
    n, prompt, completion = 64, 24, 32
    ro = Rollout(
        torch.randint(2, 1024, (n, prompt), generator=g),
        torch.ones(n, prompt, dtype=torch.long),
        torch.randint(2, 1024, (n, completion), generator=g),
        torch.ones(n, completion, dtype=torch.long),
        torch.full((n,), completion),
        torch.zeros(n, dtype=torch.bool),
    )
    prec = a.precision
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    print(f"{a.model} {prec}, {torch.get_num_threads()} threads, load {loadavg()}", flush=True)

    def passes(prefix: str, setup: Callable[[], None]) -> dict[str, Callable[[], Any]]:
        def fwd_bwd() -> None:
            setup()
            logp, _ = completion_logprobs(model, ro, temperature=1.0, precision=prec)
            logp.sum().backward()
            model.zero_grad(set_to_none=True)

        def no_grad() -> None:
            setup()
            with torch.no_grad():
                completion_logprobs(model, ro, temperature=1.0, precision=prec)

        return {f"{prefix} forward+backward": fwd_bwd, f"{prefix} no-grad forward": no_grad}

    only = a.only.split(",")
    if "lora" in only:

        def peft() -> None:
            for layer in layers:
                vars(layer).pop("forward", None)

        def ours() -> None:
            for layer in layers:
                layer.forward = types.MethodType(_forward, layer)

        with torch.no_grad():
            peft()
            want, _ = completion_logprobs(model, ro, temperature=1.0, precision=prec)
            ours()
            got, _ = completion_logprobs(model, ro, temperature=1.0, precision=prec)
        print(f"lora: max |Δ log p| ours against PEFT's {float((got - want).abs().max()):.2e}")
        res = alternate(passes("PEFT's", peft) | passes("ours", ours), a.reps)
        print("lora: " + ", ".join(f"{k} {v:.3f} s" for k, v in res.items()), flush=True)
    if "attention" in only:
        cfg = model.get_base_model().config

        def impl(name: str) -> Callable[[], None]:
            def setup() -> None:
                cfg._attn_implementation = name

            return setup

        from trainer.generation.attention import GROUPED, use_grouped_attention

        trainers = cfg._attn_implementation  # what the trainer chose (trainer.loops.engine.cpu_bf16_attention)
        use_grouped_attention(model.get_base_model())  # registers it (and switches to it where it can)
        res = alternate(
            passes("eager", impl("eager")) | passes("grouped", impl(GROUPED)) | passes("sdpa", impl("sdpa")), a.reps
        )
        cfg._attn_implementation = trainers
        print("attention: " + ", ".join(f"{k} {v:.3f} s" for k, v in res.items()), flush=True)
    if "critic" in only:
        install(model)  # the trainer's forward on every layer again, whatever the lora comparison left
        critic = Critic(model, lora=lora, seed=SEED)

        def update_apart() -> None:
            logp, _ = completion_logprobs(model, ro, temperature=1.0, precision=prec)
            logp.sum().backward()
            critic.values(ro, precision=prec).sum().backward()
            model.zero_grad(set_to_none=True)

        def update_joined() -> None:
            logp, _, v = critic.forward_with_policy(ro, temperature=1.0, precision=prec)
            (logp.sum() + v.sum()).backward()
            model.zero_grad(set_to_none=True)

        def scores_apart() -> None:
            with torch.no_grad():
                completion_logprobs(model, ro, temperature=1.0, precision=prec)
                with model.disable_adapter():
                    completion_logprobs(model, ro, temperature=1.0, precision=prec)
                critic.values(ro, precision=prec)

        def scores_joined() -> None:
            critic.rollout_scores(
                ro, policy=True, reference=True, temperature=1.0, precision=prec, micro_batch_size=None
            )

        res = alternate(
            {
                "update apart": update_apart,
                "update joined": update_joined,
                "no-grad passes apart": scores_apart,
                "no-grad passes joined": scores_joined,
            },
            a.reps,
        )
        print("critic: " + ", ".join(f"{k} {v:.3f} s" for k, v in res.items()), flush=True)
    print(f"load at the end {loadavg()}")


if __name__ == "__main__":
    main()
