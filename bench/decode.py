"""Generation against the matmul floor: the RL loop's sampling (``trainer.generation.rollout_engine.HFRolloutEngine``:
the merged bf16 copy in bf16, the policy itself in fp32) on the benchmarks' model and batch (``common.py``: 8 prompts ×
8 samples, exactly 32 new tokens), and the time the decode steps' matrix products alone take on this machine.

    python bench/decode.py --model small --precision bf16 --rounds 5

The floor: every linear layer of the sampling model (and the tied unembedding) as one ``[64, in] @ [in, out]``
product in the sampler's dtype, in sequence, timed over many repetitions: what one decode step of the batch cannot go
below without faster matmuls (attention over the cache, norms and sampling come on top). Each round runs in its own
process (``--worker ours``, so ``before_after.py`` can run it from an older checkout) and reports the seconds of each
generation after a warm-up; the summary is the median over rounds of each round's median, with the range, and the
load average around every round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from common import (
    COMPLETION,
    DEFAULT_WORKDIR,
    GROUP,
    LORA_ALPHA,
    LORA_R,
    MODELS,
    SEED,
    build_assets,
    emit_result,
    idle_runs,
    peak_rss_mib,
    run_worker,
)


def matmul_floor_s(model: Any, rows: int, dtype: Any, reps: int = 50) -> float:
    """Seconds of one decode step's matrix products: a [rows, in] @ [in, out] per linear layer, in sequence."""
    import torch

    shapes = [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = [torch.randn(i, o, dtype=dtype) for i, o in shapes]
    xs = [torch.randn(rows, i, dtype=dtype) for i, _ in shapes]
    for x, w in zip(xs, weights, strict=True):  # warm-up
        x @ w
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            for x, w in zip(xs, weights, strict=True):
                x @ w
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def worker(model_dir: Path, prompts: Path, precision: str, gens: int, warmup: int, decode: str) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer

    from trainer.generation.rollout_engine import HFRolloutEngine, SamplingParams
    from trainer.loops.engine import load_policy
    from trainer.spec.lora import LoraSpec

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [json.loads(ln)["prompt"] for ln in prompts.read_text().splitlines() if ln.strip()]
    device = torch.device("cpu")
    lora = LoraSpec(r=LORA_R, alpha=LORA_ALPHA, dropout=0.0, target_modules="all-linear")
    policy = load_policy(
        str(model_dir), lora, device=device, precision=precision, seed=SEED, sampler_copy=precision == "bf16"
    )
    engine = HFRolloutEngine(
        policy.model,
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
        device=device,
        precision=precision,  # type: ignore[arg-type]
        base_copy=policy.base_copy,
        decode=decode,  # type: ignore[arg-type]
    )
    params = SamplingParams(COMPLETION, 1.0, 1.0, COMPLETION)
    generator = torch.Generator().manual_seed(SEED)
    times = []
    for g in range(warmup + gens):
        batch = [tok(t, add_special_tokens=False)["input_ids"] for t in texts[g * 8 : g * 8 + 8]]
        rows = [p for p in batch for _ in range(GROUP)]
        t0 = time.perf_counter()
        out = engine.generate(rows, params, generator=generator)
        dt = time.perf_counter() - t0
        assert int(out.rollout.lengths.min()) == COMPLETION
        if g >= warmup:
            times.append(dt)
    sampler, _ = engine.sampling_model()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    floor = matmul_floor_s(sampler, len(rows), dtype)
    decoder = engine._decoder
    return {
        "step_s": times,
        "compile_s": decoder.compile_s if decoder is not None else 0.0,
        "per_token_ms": [1000 * t / COMPLETION for t in times],
        "floor_ms": 1000 * floor,
        "peak_rss_mib": peak_rss_mib(),
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="measured generations per round")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    p.add_argument("--worker", choices=["ours"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, help="torch threads")
    p.add_argument(
        "--decode",
        default="dynamic",
        help="comma-separated sides, alternating each round: dynamic (HF's growing cache, the default engine), "
        "static (a static cache), compiled (a static cache and a torch.compile'd step; its compile is in the warm-up "
        "and reported apart)",
    )
    a = p.parse_args()
    if a.worker:
        import torch

        if a.threads:
            torch.set_num_threads(a.threads)
        emit_result(worker(Path(a.model_dir), Path(a.prompts), a.precision, a.steps, a.warmup, a.decode))
        return
    model_dir, prompts = build_assets(a.workdir, a.model)
    argv = ["--model-dir", str(model_dir), "--prompts", str(prompts), "--precision", a.precision]
    argv += ["--steps", str(a.steps), "--warmup", str(a.warmup)] + (["--threads", str(a.threads)] if a.threads else [])
    sides = a.decode.split(",")
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for r in range(a.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            res = run_worker(__file__, "ours", [*argv, "--decode", side])
            res["median_ms"] = statistics.median(res["per_token_ms"])
            runs[side].append(res)
            print(
                f"round {r + 1} {side}: {res['median_ms']:.2f} ms/token (generations "
                f"{' '.join(f'{t:.3f}' for t in res['step_s'])} s), compile {res['compile_s']:.1f} s, matmul floor "
                f"{res['floor_ms']:.2f} ms/step (load {res['load_start']} → {res['load_end']})"
                + (" UNDER LOAD: left out" if res.get("loaded") else ""),
                flush=True,
            )
    for side, every in runs.items():
        rs = idle_runs(every)
        medians, floors = [x["median_ms"] for x in rs], [x["floor_ms"] for x in rs]
        ratio = statistics.median(medians) / statistics.median(floors)
        compiles = [x["compile_s"] for x in rs]
        print(
            f"{a.model} {a.precision} {side}: decode {statistics.median(medians):.2f} ms/token "
            f"[{min(medians):.2f}, {max(medians):.2f}], matmul floor {statistics.median(floors):.2f} ms "
            f"[{min(floors):.2f}, {max(floors):.2f}]: {ratio:.1f}× the floor; compile "
            f"{statistics.median(compiles):.1f} s [{min(compiles):.1f}, {max(compiles):.1f}]; "
            f"{len(every) - len(rs)} of {len(every)} rounds left out"
        )


if __name__ == "__main__":
    main()
