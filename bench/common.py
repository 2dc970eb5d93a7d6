"""What the side-by-side benchmarks against TRL share (``grpo_vs_trl.py``, ``ppo_vs_trl.py``): the benchmark
configuration of the trainer core, its models and prompts, the FLOP count of its passes, and the harness that runs
each side in its own subprocess and measures it.

The configuration: a randomly initialised Qwen2-architecture model (seed 0) saved with a locally built byte-level BPE
of 1024 tokens into a work folder (``small`` = hidden 256, 4 layers; ``large`` = hidden 512, 8 layers; FFN
4×hidden, head dim 64, 2 query heads per KV head, tied embeddings); 512 synthetic prompts of 16–32 tokens; LoRA r 16,
alpha 32, dropout 0, all-linear; 8 prompts × 8 samples a step; exactly 32 new tokens per sample (EOS held off); AdamW
at lr 3e-4; the reward our ``length_penalty`` grader, called by both sides.

The harness: each side runs in its own subprocess (the script re-run with ``--worker``) and prints one ``RESULT``
line of JSON. Step time is the wall time between consecutive step ends, warm-up steps excluded; peak RSS (``VmHWM``)
is reset after the warm-up and read after every measured step; phases are wall times of wrapped functions, summed
over the measured steps. ``/proc/loadavg`` is read before and after every subprocess.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BATCH_PROMPTS = 8
GROUP = 8
ROWS = BATCH_PROMPTS * GROUP
COMPLETION = 32
PROMPT_MIN, PROMPT_MAX = 16, 32
N_PROMPTS = 512
VOCAB = 1024
LORA_R, LORA_ALPHA = 16, 32
LR = 3e-4
SEED = 0
# Where both sides run: "cpu" (the default and the results in BENCHMARKS.md's CPU tables) or "cuda" (a GPU check:
# PROXIMA_BENCH_DEVICE=cuda; peak memory is then also the GPU's, torch.cuda.max_memory_allocated).
DEVICE = os.environ.get("PROXIMA_BENCH_DEVICE", "cpu")
# Both benchmarks build the same models and prompts: one work folder, built once.
DEFAULT_WORKDIR = Path(tempfile.gettempdir()) / "proxima-grpo-bench"


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int

    @property
    def intermediate(self) -> int:
        return 4 * self.hidden

    @property
    def heads(self) -> int:
        return self.hidden // 64

    @property
    def kv_heads(self) -> int:
        return max(self.heads // 2, 1)


MODELS = {"small": ModelShape(256, 4), "large": ModelShape(512, 8), "xl": ModelShape(1024, 16)}  # xl: GPU runs

# The length_penalty grader is the reward on both sides: ~5 characters a token, so 32 tokens ≈ 150–200 characters
# and the reward varies within every group.
GRADER = {"type": "length_penalty", "name": "len", "input": "{{sample.output_text}}", "max_chars": 100}


# -- set-up: tokenizer, model, prompts ------------------------------------------------------------------------


def _words(rng: random.Random) -> list[str]:
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    syllables = [c + v for c in consonants for v in vowels]
    words = sorted({a + b for a in syllables for b in syllables})
    rng.shuffle(words)
    return words[:2000] + [str(d) for d in range(10)]


def _tokenizer(rng: random.Random, words: list[str]) -> Any:
    """A byte-level BPE of VOCAB tokens trained on the synthetic words. (A word-level tokenizer would not do:
    transformers 5 loads a Qwen2 folder's tokenizer as ``Qwen2Tokenizer``, which rebuilds a byte-level BPE.)"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(5000)]
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=VOCAB,
            special_tokens=["<pad>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", padding_side="left")


def _prompt(rng: random.Random, words: list[str], tok: Any) -> tuple[str, int]:
    """Random words up to a random length of PROMPT_MIN..PROMPT_MAX tokens: (text, its token count)."""
    target = rng.randint(PROMPT_MIN, PROMPT_MAX)
    text = ""
    while True:
        longer = (text + " " + rng.choice(words)).strip()
        n = len(tok(longer, add_special_tokens=False)["input_ids"])
        if n > target:
            return text, len(tok(text, add_special_tokens=False)["input_ids"])
        text = longer


def build_assets(workdir: Path, model: str) -> tuple[Path, Path]:
    """The model folder (weights + tokenizer) and the prompt file, built once per workdir, deterministically."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    shape = MODELS[model]
    tok_dir = workdir / "tokenizer"
    model_dir = workdir / f"qwen2-h{shape.hidden}-l{shape.layers}"
    prompts = workdir / "prompts.jsonl"
    rng = random.Random(SEED)
    words = _words(rng)
    if not (tok_dir / "tokenizer.json").exists():
        _tokenizer(rng, words).save_pretrained(tok_dir)
    if (model_dir / "config.json").exists() and prompts.exists():
        return model_dir, prompts
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(SEED)
    Qwen2ForCausalLM(cfg).save_pretrained(model_dir)
    for f in tok_dir.iterdir():
        (model_dir / f.name).write_bytes(f.read_bytes())
    tok = AutoTokenizer.from_pretrained(model_dir)  # as both trainers will load it
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1), (tok.pad_token_id, tok.eos_token_id)
    if not prompts.exists():
        rows = [_prompt(rng, words, tok) for _ in range(N_PROMPTS)]
        prompts.write_text("".join(json.dumps({"prompt": t, "n_tokens": n}) + "\n" for t, n in rows))
    return model_dir, prompts


def prompt_lengths(prompts: Path) -> list[int]:
    return [json.loads(ln)["n_tokens"] for ln in prompts.read_text().splitlines() if ln.strip()]


# -- model FLOPs ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlopTerms:
    """FLOPs of one pass over the step's ``ROWS`` sequences (padding excluded, attention scores left out: < 4% at
    context ≤ 64). N = matmul weights of the transformer body (q, k, v, o, gate, up, down), N_L = one adapter's LoRA
    weights (A and B), H = V·h the LM head (a matmul even when tied), T = ROWS·(p + C) tokens, p the mean prompt."""

    n: float
    n_l: float
    head: float
    tokens: float

    @property
    def logits(self) -> float:
        """The LM head on the C completion positions only (both trainers keep just those logits)."""
        return 2 * self.head * ROWS * COMPLETION

    def generation(self, mean_prompt: float) -> float:
        """Prefill + C − 1 decode steps through body and adapter, logits for C tokens."""
        return 2 * (self.n + self.n_l) * ROWS * (mean_prompt + COMPLETION - 1) + self.logits

    def forward(self, *, adapter: bool, lm_head: bool = True) -> float:
        return 2 * (self.n + (self.n_l if adapter else 0.0)) * self.tokens + (self.logits if lm_head else 0.0)

    def backward(self, *, lm_head: bool = True) -> float:
        """Frozen weights need only input gradients (2·N·T); LoRA weights both (4·N_L·T)."""
        return 2 * self.n * self.tokens + 4 * self.n_l * self.tokens + (self.logits if lm_head else 0.0)


def flop_terms(shape: ModelShape, mean_prompt: float) -> FlopTerms:
    h, i, kv = shape.hidden, shape.intermediate, shape.kv_heads * 64
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * i
    lora_per_layer = LORA_R * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h))
    return FlopTerms(
        n=shape.layers * per_layer,
        n_l=shape.layers * lora_per_layer,
        head=VOCAB * h,
        tokens=ROWS * (mean_prompt + COMPLETION),
    )


# -- inside a worker: peak memory, phases, step clock -------------------------------------------------------------


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux ≥ 4.0)


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


class PhaseTimer:
    """Wall time by phase, summed over the measured steps (``on`` is False during warm-up)."""

    def __init__(self) -> None:
        self.on = False
        self.sums: dict[str, float] = {}

    def wrap(self, fn: Any, name: str | Callable[..., str]) -> Any:
        """``name`` may be a callable choosing the phase when the call returns; it gets the call's arguments (e.g. to
        tell the reference pass from the policy's by whether grad is enabled and the adapter is disabled)."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.on:
                    key = name(*args, **kwargs) if callable(name) else name
                    self.sums[key] = self.sums.get(key, 0.0) + time.perf_counter() - t0

        return timed


class StepClock:
    """Step times between consecutive step ends; resets peak RSS and starts the phase timer after warm-up."""

    def __init__(self, warmup: int, phases: PhaseTimer) -> None:
        self.warmup, self.phases = warmup, phases
        self.done = 0
        self.last = time.perf_counter()
        self.times: list[float] = []
        self.peak_rss_mib = 0.0
        self.peak_gpu_mib = 0.0

    def step_end(self) -> None:
        now = time.perf_counter()
        self.done += 1
        if self.done > self.warmup:
            self.times.append(now - self.last)
            self.peak_rss_mib = peak_rss_mib()
            if DEVICE == "cuda":
                import torch

                self.peak_gpu_mib = torch.cuda.max_memory_allocated() / 2**20
        if self.done == self.warmup:
            reset_peak_rss()
            if DEVICE == "cuda":
                import torch

                torch.cuda.reset_peak_memory_stats()
            self.phases.on = True
        self.last = now


def patch_backward(phases: PhaseTimer, name: str | Callable[..., str] = "backward") -> None:
    import torch

    torch.Tensor.backward = phases.wrap(torch.Tensor.backward, name)  # type: ignore[method-assign]


def adapters_disabled(model: Any) -> bool:
    """Whether a PEFT model's adapters are switched off (``disable_adapter()``: the reference policy on both sides)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layer = _first_lora.get(id(model))
    if layer is None:
        layer = next(m for m in model.modules() if isinstance(m, BaseTunerLayer))
        _first_lora[id(model)] = layer
    return bool(layer.disable_adapters)


_first_lora: dict[int, Any] = {}


def emit_result(res: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(res), flush=True)


# -- the driver: subprocesses, rounds, summary --------------------------------------------------------------------


def loadavg() -> str:
    """The 1-, 5- and 15-minute load averages."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


SETTLE_S = 240.0
# A run starts once the 1-minute load average is below this (the previous run's own threads included); one that
# could not be (SETTLE_S passed) runs anyway, is marked ``loaded`` and left out of the summaries' medians.
MAX_LOAD = float(os.environ.get("PROXIMA_BENCH_MAX_LOAD", "1.0"))


def settle(max_load: float) -> float:
    """Wait (up to SETTLE_S) for the 1-minute load average to fall below ``max_load``; returns the last reading."""
    deadline = time.monotonic() + SETTLE_S
    while (load := float(loadavg().split()[0])) >= max_load and time.monotonic() < deadline:
        time.sleep(5)
    return load


def run_worker(
    script: str, side: str, argv: list[str], *, python: list[str] | None = None, cwd: Path | None = None
) -> dict[str, Any]:
    """Run ``script --worker side argv…`` once the machine is idle (``MAX_LOAD``) and return its ``RESULT``, with
    the load average before and after and whether it had to start under load. ``python``: the interpreter's command
    line (default this one; ``bench/before_after.py`` passes a bootstrap); ``cwd``: the folder it runs in."""
    cmd = [*(python or [sys.executable]), script, "--worker", side, *argv]
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("PYTHONWARNINGS", "ignore")
    loaded = settle(MAX_LOAD) >= MAX_LOAD
    load_start = loadavg()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    load_end = loadavg()
    results = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"{side} worker failed (exit {proc.returncode})")
    res = dict(json.loads(results[-1].removeprefix("RESULT ")))
    res["load_start"], res["load_end"], res["loaded"] = load_start, load_end, loaded
    return res


def idle_runs(rs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs that started below ``MAX_LOAD``: all of them when none did (the summary then says so)."""
    return [r for r in rs if not r.get("loaded")] or rs


def run_rounds(
    sides: list[str], rounds: int, run_one: Callable[[str], dict[str, Any]]
) -> dict[str, list[dict[str, Any]]]:
    """Alternate the sides (a, b, a, b, ...) and print each run as it ends."""
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    for r in range(rounds):
        for side in sides:
            res = run_one(side)
            runs[side].append(res)
            print(
                f"round {r + 1} {side:4s}: "
                + " ".join(f"{t:.3f}" for t in res["step_s"])
                + f" s/step, peak RSS {res['peak_rss_mib']:.0f} MiB "
                + (f"GPU {res['peak_gpu_mib']:.0f} MiB " if res.get("peak_gpu_mib") else "")
                + f"(load {res['load_start']} → {res['load_end']})"
                + (" UNDER LOAD: left out" if res.get("loaded") else ""),
                flush=True,
            )
    return runs


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per side, over the rounds that started idle (``idle_runs``): mean, min, max and median seconds per step over
    every measured step, the mean and median of each round, how many rounds started under load, generated tokens
    per second of (mean) step time, the largest peak RSS of its runs, and phase seconds per step."""
    summary: dict[str, dict[str, Any]] = {}
    for side, every in runs.items():
        rs = idle_runs(every)
        times = [t for res in rs for t in res["step_s"]]
        sec = statistics.fmean(times)
        phases: dict[str, float] = {}
        for res in rs:
            for k, v in res["phases"].items():
                phases[k] = phases.get(k, 0.0) + v
        summary[side] = {
            "s_per_step": sec,
            "s_min": min(times),
            "s_max": max(times),
            "s_median": statistics.median(times),
            "round_means": [statistics.fmean(res["step_s"]) for res in rs],
            "round_medians": [statistics.median(res["step_s"]) for res in rs],
            "rounds_under_load": sum(1 for res in every if res.get("loaded")),
            "gen_tok_s": ROWS * COMPLETION / sec,
            "peak_rss_mib": max(res["peak_rss_mib"] for res in rs),
            "peak_gpu_mib": max(res.get("peak_gpu_mib", 0.0) for res in rs),
            "phases_per_step": {k: v / len(times) for k, v in phases.items()},
            "steps": len(times),
        }
    return summary


def format_phases(phases: dict[str, float], order: list[str]) -> str:
    return ", ".join(f"{k} {phases[k]:.3f}" for k in order if k in phases)
