"""Episodes per second of the agent pipeline on tiny-calc, with tool calls made concurrently against one at
a time, for tool latencies of 0, 50 and 500 ms.

The real pipeline, in this process: tiny-calc (from the test model cache, or ``--model-dir``) loaded as the RL
trainer loads a policy (``trainer.loops.engine.load_policy``: LoRA r 16 on every linear layer, fresh, so the policy is
the base model as it is) and sampled by ``HFRolloutEngine`` in the precision the trainer picks on this machine
(``--precision auto``: bf16 from a merged bf16 copy where the CPU has AVX512-BF16 or AMX, else fp32);
``EpisodeRunner`` built as ``trainer.loops.agent.AgentRollouts`` builds it (the template's tool-call parser, an episode
budget of ``--max-tokens`` for every turn and in all, ``--max-episode-steps`` turns); ``HttpToolExecutor`` over real
HTTP (loopback allowed, ``concurrency`` at least the batch size) to the built-in calculator server
(``trainer.agents.calculator_server``), one uvicorn server per latency in a thread of this process, each delaying every
answer by its artificial latency.

A batch is like a training step's: ``--prompts`` tiny-calc questions × ``--samples`` episodes each (8 × 8 = 64) at
temperature 1, the calculator offered through the chat template. The base model calls the tool on about 30% of its
sampled episodes (``build_info.json``), which is the call rate measured here (no prompt or policy is changed to raise
it); the calls per batch are reported. Two sides:

- **concurrent**: the runner's default ``max_concurrent_calls`` (64, as ``AgentRollouts`` runs it): every call of a
  turn is submitted before the first is awaited, so their waits overlap;
- **serial**: ``max_concurrent_calls=1``: the runner's thread pool has one thread, so the calls of a turn run one
  after the other (the executor's ``start``/``finish`` too, which cost nothing over HTTP).

Both sides run the same batches with the same sampling seed, so they sample the same episodes (checked: the
completion token ids of every batch are compared) and differ only in how the tool calls wait. Per batch: wall time;
generation time (``generate`` calls of the engine, timed around them); tool time (the wall time during which at least
one call was in flight, the union of the calls' intervals as the executor saw them); tool call-seconds (the sum of
each call's latency, ``Episode.tool_latency_s``), whose ratio to the tool time is how many waits overlapped on
average; the rest (parsing, tokenising the tool messages, building the rows) is what remains of the wall time.

``--rounds`` rounds (3); in each, every latency runs a window of ``--batches`` batches (5) per side, the sides
alternating which goes first round by round. A serial window at a latency of 500 ms or more runs
``--slow-serial-batches`` batches (2) instead (its ~20 calls take ~10 s a batch); the ratio
concurrent/serial is computed over the batches both sides ran (the same episodes). One unmeasured warm-up batch a side
comes first. Each window starts once the 1-minute load average is below ``--idle-load`` (1) and records it; medians over
the rounds are reported with their range, and the result as JSON on the ``RESULT`` line.

    .venv/bin/python bench/agent_episodes.py                  # the full run (meant to take < 10 min on 2 idle cores)
    .venv/bin/python bench/agent_episodes.py --quick          # a smoke run (seconds; not a measurement)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import uvicorn
from transformers import PreTrainedTokenizerBase

from trainer.agents import calculator_server
from trainer.agents.episodes import Episode, EpisodeConfig, EpisodeRunner, ToolOutcome
from trainer.agents.tool_calls import ToolCall, parser_for
from trainer.agents.tools import HttpToolExecutor
from trainer.builtin_models import shipped, tiny_calc
from trainer.generation.encoding import encode_prompts
from trainer.generation.models import default_device, load_tokenizer, resolve_precision
from trainer.generation.rollout_engine import Generation, HFRolloutEngine, RolloutEngine, SamplingParams
from trainer.grading.remote_graders import RemoteConfig
from trainer.loops.engine import load_policy
from trainer.spec.agent_spec import ToolSpec
from trainer.spec.data import PromptItem
from trainer.spec.lora import LoraSpec

REPO = Path(__file__).resolve().parent.parent
SLOW_LATENCY_MS = 500.0  # serial windows at this latency or more run --slow-serial-batches batches
SEED = 0

Side = Literal["concurrent", "serial"]
SIDES: tuple[Side, Side] = ("concurrent", "serial")


def _loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _wait_for_idle(limit: float, patience_s: float = 300.0) -> float:
    """Wait until the 1-minute load average is below ``limit`` (at most ``patience_s``); the load then."""
    deadline = time.monotonic() + patience_s
    while _loadavg() >= limit and time.monotonic() < deadline:
        time.sleep(2)
    return _loadavg()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# --- timing seams: the engine and the executor, wrapped -----------------------------------------------------------


class TimedEngine:
    """A :class:`~trainer.generation.rollout_engine.RolloutEngine` adding up the wall time of its ``generate`` calls."""

    def __init__(self, inner: RolloutEngine) -> None:
        self.inner = inner
        self.seconds = 0.0

    @property
    def exact_logprobs(self) -> bool:
        return self.inner.exact_logprobs

    def push_weights(self, policy: torch.nn.Module, version: int) -> None:
        self.inner.push_weights(policy, version)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, generator: torch.Generator | None
    ) -> Generation:
        t0 = time.perf_counter()
        try:
            return self.inner.generate(prompts, params, generator=generator)
        finally:
            self.seconds += time.perf_counter() - t0


class TimedExecutor:
    """A :class:`~trainer.agents.episodes.ToolExecutor` that records when each call was in flight (thread-safe)."""

    def __init__(self, inner: HttpToolExecutor) -> None:
        self.inner = inner
        self.intervals: list[tuple[float, float]] = []
        self._lock = threading.Lock()

    def start(
        self, item: dict[str, Any], trace_id: str, prompt_messages: list[dict[str, str]]
    ) -> list[dict[str, Any]] | None:
        return self.inner.start(item, trace_id, prompt_messages)

    def call(self, call: ToolCall, tool: ToolSpec | None, *, item: dict[str, Any], trace_id: str) -> ToolOutcome:
        t0 = time.perf_counter()
        try:
            return self.inner.call(call, tool, item=item, trace_id=trace_id)
        finally:
            t1 = time.perf_counter()
            with self._lock:
                self.intervals.append((t0, t1))

    def finish(self, trace_id: str) -> None:
        self.inner.finish(trace_id)

    def take_busy_seconds(self) -> float:
        """The wall time during which at least one call was in flight since the last take (the union of the
        intervals), and forget them."""
        with self._lock:
            spans, self.intervals = sorted(self.intervals), []
        busy, end = 0.0, float("-inf")
        for a, b in spans:
            if b > end:
                busy += b - max(a, end)
                end = b
        return busy


# --- the calculator servers ---------------------------------------------------------------------------------------


@dataclass
class RunningServer:
    latency_ms: float
    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def start_calculator(latency_ms: float) -> RunningServer:
    """The calculator tool server on a free loopback port in a thread of this process, answering after
    ``latency_ms``."""
    server = calculator_server.make_server("127.0.0.1", 0, latency_s=latency_ms / 1000)
    thread = threading.Thread(target=server.run, name=f"calculator-{latency_ms:g}ms", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise SystemExit(f"the calculator server ({latency_ms:g} ms) did not start")
        time.sleep(0.02)
    port = int(server.servers[0].sockets[0].getsockname()[1])
    return RunningServer(latency_ms, f"http://127.0.0.1:{port}/", server, thread)


# --- batches and windows ------------------------------------------------------------------------------------------


@dataclass
class Prompts:
    """One batch's encoded prompts: ``samples`` rows per question, grouped as a GRPO step draws them."""

    ids: list[list[int]]
    items: list[PromptItem]


def make_batches(tokenizer: PreTrainedTokenizerBase, n_batches: int, prompts: int, samples: int) -> list[Prompts]:
    """``n_batches`` batches of distinct tiny-calc questions (the training split), encoded with the calculator
    offered by the chat template, as the trainer encodes an agent job's prompts."""
    triples = tiny_calc.train_triples(n_batches * prompts, seed=SEED)
    function = ToolSpec.model_validate(calculator_server.calculator_tool("http://127.0.0.1/")).function()
    out: list[Prompts] = []
    for b in range(n_batches):
        items = [
            PromptItem(tiny_calc.prompt_messages(t), {"answer": tiny_calc.answer_text(t)})
            for t in triples[b * prompts : (b + 1) * prompts]
            for _ in range(samples)
        ]
        ids = encode_prompts(tokenizer, items, max_prompt_tokens=1_000_000, tools=[[function]] * len(items))
        out.append(Prompts(ids, items))
    return out


@dataclass
class BatchResult:
    batch: int  # the batch's index (its questions and its sampling seed)
    episodes: int
    wall_s: float
    generate_s: float
    tool_wait_s: float  # wall time with at least one call in flight
    tool_call_s: float  # sum of the calls' latencies (Episode.tool_latency_s)
    tool_calls: int
    tool_errors: int
    turns: int
    fingerprint: str  # of the completion token ids: the same on both sides when they sampled the same episodes

    @property
    def other_s(self) -> float:
        return self.wall_s - self.generate_s - self.tool_wait_s


class Bench:
    """The model, the engine and the executor, loaded once; one runner per side."""

    def __init__(self, model_dir: Path, precision: Literal["auto", "fp32", "bf16"], remote: RemoteConfig) -> None:
        self.device = default_device()
        self.precision = resolve_precision(precision, self.device)
        self.tokenizer = load_tokenizer(str(model_dir))
        # As the RL trainer loads its policy: the merged bf16 sampler copy exactly when it would make one.
        policy = load_policy(
            str(model_dir),
            LoraSpec(),
            device=self.device,
            precision=self.precision,
            seed=SEED,
            sampler_copy=self.precision == "bf16",
        )
        self.engine = TimedEngine(
            HFRolloutEngine(
                policy.model,
                eos_id=self.tokenizer.eos_token_id,
                pad_id=self.tokenizer.pad_token_id,
                device=self.device,
                precision=self.precision,
                base_copy=policy.base_copy,
            )
        )
        self.http = HttpToolExecutor(remote)
        self.executor = TimedExecutor(self.http)

    def runner(self, side: Side, max_tokens: int, max_episode_steps: int) -> EpisodeRunner:
        """The runner as ``AgentRollouts`` builds it; the serial side with a thread pool of one."""
        config = EpisodeConfig(max_episode_steps=max_episode_steps, max_tokens=max_tokens, max_turn_tokens=max_tokens)
        parser = parser_for(self.tokenizer)
        if side == "serial":
            return EpisodeRunner(self.engine, self.tokenizer, parser, self.executor, config, max_concurrent_calls=1)
        return EpisodeRunner(self.engine, self.tokenizer, parser, self.executor, config)

    def run_batch(
        self, runner: EpisodeRunner, prompts: Prompts, tool: ToolSpec, batch: int, temperature: float
    ) -> BatchResult:
        generator = torch.Generator(device=self.device).manual_seed(SEED + 1 + batch)
        self.engine.seconds = 0.0
        self.executor.take_busy_seconds()
        params = SamplingParams(max_new_tokens=1, temperature=temperature)  # the runner sets each turn's length
        t0 = time.perf_counter()
        generation, episodes = runner.run(
            prompts.ids, prompts.items, [[tool]] * len(prompts.ids), params, generator=generator
        )
        wall = time.perf_counter() - t0
        return BatchResult(
            batch=batch,
            episodes=len(episodes),
            wall_s=wall,
            generate_s=self.engine.seconds,
            tool_wait_s=self.executor.take_busy_seconds(),
            tool_call_s=sum(sum(e.tool_latency_s) for e in episodes),
            tool_calls=_count(episodes, "calls"),
            tool_errors=_count(episodes, "errors"),
            turns=sum(e.turns for e in episodes),
            fingerprint=_fingerprint(generation),
        )

    def close(self) -> None:
        self.http.close()


def _count(episodes: Sequence[Episode], what: Literal["calls", "errors"]) -> int:
    return sum(sum((e.tool_calls_by_name if what == "calls" else e.tool_errors_by_name).values()) for e in episodes)


def _fingerprint(generation: Generation) -> str:
    rollout = generation.rollout
    rows = [ids[:n] for ids, n in zip(rollout.completion_ids.tolist(), rollout.lengths.tolist(), strict=True)]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def window_summary(batches: list[BatchResult]) -> dict[str, Any]:
    """A window's figures: episodes/s over its batches, and per-batch means."""
    n = len(batches)
    wall = sum(b.wall_s for b in batches)
    tool_wait = sum(b.tool_wait_s for b in batches)
    return {
        "batches": n,
        "episodes_per_s": sum(b.episodes for b in batches) / wall,
        "s_per_batch": wall / n,
        "generate_s_per_batch": sum(b.generate_s for b in batches) / n,
        "tool_wait_s_per_batch": tool_wait / n,
        "tool_call_s_per_batch": sum(b.tool_call_s for b in batches) / n,
        "other_s_per_batch": sum(b.other_s for b in batches) / n,
        "tool_calls_per_batch": sum(b.tool_calls for b in batches) / n,
        "tool_errors": sum(b.tool_errors for b in batches),
        "turns_per_episode": sum(b.turns for b in batches) / sum(b.episodes for b in batches),
        # how many calls were in flight on average while any was (1 when serial); None: no call was made
        "overlap": sum(b.tool_call_s for b in batches) / tool_wait if tool_wait > 0 else None,
    }


def _spread(values: Sequence[float | None], digits: int = 2) -> str:
    xs = [x for x in values if x is not None]  # None: a window without tool calls has no overlap
    if not xs:
        return "—"
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}–{max(xs):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=shipped(tiny_calc.MODEL_NAME))
    parser.add_argument("--latencies", type=float, nargs="+", default=[0.0, 50.0, 500.0], help="tool latencies, ms")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the two sides alternate which goes first")
    parser.add_argument("--batches", type=int, default=5, help="measured batches a window")
    parser.add_argument(
        "--slow-serial-batches",
        type=int,
        default=2,
        help=f"batches of a serial window at {SLOW_LATENCY_MS:g} ms or more (its tool waits add up)",
    )
    parser.add_argument("--prompts", type=int, default=8, help="questions a batch")
    parser.add_argument("--samples", type=int, default=8, help="episodes a question")
    parser.add_argument("--max-tokens", type=int, default=40, help="an episode's token budget (policy and tools)")
    parser.add_argument("--max-episode-steps", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    parser.add_argument("--idle-load", type=float, default=1.0, help="a window starts once the load is below this")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 1 round of 1 batch of 2 × 4 episodes, no idle wait"
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.batches, args.slow_serial_batches = 1, 1, 1
        args.prompts, args.samples, args.idle_load = 2, 4, float("inf")
    if min(args.rounds, args.batches, args.slow_serial_batches, args.prompts, args.samples) < 1:
        raise SystemExit("--rounds, --batches, --slow-serial-batches, --prompts and --samples must be at least 1")
    if not tiny_calc.is_complete_build(args.model_dir):
        raise SystemExit(f"no tiny-calc in {args.model_dir}: build it with `proxima models build tiny-calc`")
    latencies = [float(x) for x in args.latencies]
    rows = args.prompts * args.samples

    def batches_of(side: Side, latency_ms: float) -> int:
        return args.slow_serial_batches if side == "serial" and latency_ms >= SLOW_LATENCY_MS else args.batches

    load_before = _loadavg()
    remote = RemoteConfig(url_schemes=("http",), allow_networks=("127.0.0.0/8",), concurrency=max(rows, 16))
    bench = Bench(args.model_dir, args.precision, remote)
    servers = {ms: start_calculator(ms) for ms in latencies}
    tools = {ms: ToolSpec.model_validate(calculator_server.calculator_tool(s.url)) for ms, s in servers.items()}
    runners = {side: bench.runner(side, args.max_tokens, args.max_episode_steps) for side in SIDES}
    # Batch i of round r is batch r * batches + i: new questions and a new seed each round, the same on every side
    # and latency (a window that runs fewer batches runs the first of its round's).
    prompts = make_batches(bench.tokenizer, args.rounds * args.batches + 1, args.prompts, args.samples)
    warmup_index = args.rounds * args.batches
    windows: list[dict[str, Any]] = []
    results: dict[tuple[int, float, Side], list[BatchResult]] = {}
    print(
        f"tiny-calc, {bench.precision} on {bench.device} ({torch.get_num_threads()} torch threads), "
        f"{args.prompts} prompts × {args.samples} samples = {rows} episodes a batch, T {args.temperature:g}, "
        f"max_episode_steps {args.max_episode_steps}, budget {args.max_tokens} tokens; {args.batches} batches a "
        f"window, {args.slow_serial_batches} for serial at ≥ {SLOW_LATENCY_MS:g} ms",
        flush=True,
    )
    try:
        # Unmeasured: the sampler's first merge, the first HTTP connections, the kernels' first shapes.
        warm = [
            bench.run_batch(runners[side], prompts[warmup_index], tools[latencies[0]], warmup_index, args.temperature)
            for side in SIDES
        ]
        print(
            "warm-up batch, each side: " + ", ".join(f"{w.wall_s:.2f} s ({w.tool_calls} tool calls)" for w in warm),
            flush=True,
        )
        for rnd in range(args.rounds):
            order = SIDES if rnd % 2 == 0 else SIDES[::-1]
            for ms in latencies:
                for side in order:
                    start_load = _wait_for_idle(args.idle_load)
                    done: list[BatchResult] = []
                    for i in range(batches_of(side, ms)):
                        index = rnd * args.batches + i
                        done.append(bench.run_batch(runners[side], prompts[index], tools[ms], index, args.temperature))
                    results[(rnd, ms, side)] = done
                    w = window_summary(done) | {
                        "round": rnd + 1,
                        "latency_ms": ms,
                        "side": side,
                        "load_start": start_load,
                        "load_end": _loadavg(),
                        "batch_results": [asdict(b) for b in done],
                    }
                    windows.append(w)
                    print(
                        f"round {rnd + 1} {ms:5g} ms {side:10s}: {w['episodes_per_s']:6.1f} episodes/s, "
                        f"{w['s_per_batch']:.2f} s/batch (generate {w['generate_s_per_batch']:.2f}, tools "
                        f"{w['tool_wait_s_per_batch']:.2f}, other {w['other_s_per_batch']:.2f}), "
                        f"{w['tool_calls_per_batch']:.1f} calls/batch, errors {w['tool_errors']}; "
                        f"load {start_load:.2f} → {w['load_end']:.2f}",
                        flush=True,
                    )
    finally:
        bench.close()
        for s in servers.values():
            s.stop()

    # concurrent/serial over the batches both sides ran in a round: the same episodes, timed two ways
    ratios: dict[float, list[float]] = {ms: [] for ms in latencies}
    same_episodes: dict[float, bool] = {ms: True for ms in latencies}
    for rnd in range(args.rounds):
        for ms in latencies:
            conc, ser = results[(rnd, ms, "concurrent")], results[(rnd, ms, "serial")]
            k = min(len(conc), len(ser))
            pairs = list(zip(conc[:k], ser[:k], strict=True))
            same_episodes[ms] &= all(c.fingerprint == s.fingerprint for c, s in pairs)
            ratios[ms].append(sum(s.wall_s for _, s in pairs) / sum(c.wall_s for c, _ in pairs))

    def of(ms: float, side: Side, key: str) -> list[float]:
        return [w[key] for w in windows if w["latency_ms"] == ms and w["side"] == side]

    # (key, column, digits) of the table; the medians of the first seven go to the JSON too
    columns = [
        ("episodes_per_s", "episodes/s", 1),
        ("s_per_batch", "s/batch", 2),
        ("generate_s_per_batch", "generate s/batch", 2),
        ("tool_wait_s_per_batch", "tool wait s/batch", 2),
        ("tool_call_s_per_batch", "tool call-s/batch", 2),
        ("other_s_per_batch", "other s/batch", 2),
        ("tool_calls_per_batch", "tool calls/batch", 1),
        ("overlap", "overlap", 1),
    ]
    table: list[dict[str, Any]] = []
    print(f"\nmedians over {args.rounds} rounds (range):")
    print(
        "| latency ms | side | "
        + " | ".join(title for _, title, _ in columns)
        + " | errors | batches a window | load at starts |"
    )
    print("|---:|---|" + "---:|" * (len(columns) + 2) + "---|")
    for ms in latencies:
        for side in SIDES:
            loads = of(ms, side, "load_start")
            row = {"latency_ms": ms, "side": side}
            row |= {key: statistics.median(of(ms, side, key)) for key, _, _ in columns[:7]}
            row |= {"tool_errors": sum(of(ms, side, "tool_errors")), "batches_per_window": batches_of(side, ms)}
            table.append(row)
            cells = [_spread(of(ms, side, key), digits) for key, _, digits in columns]
            print(
                f"| {ms:g} | {side} | "
                + " | ".join(cells)
                + f" | {row['tool_errors']} | {batches_of(side, ms)} | {min(loads):.2f}–{max(loads):.2f} |"
            )
    print("\nconcurrent/serial episodes/s, over the batches both sides ran (the same episodes), median (range):")
    for ms in latencies:
        same = "same episodes on both sides" if same_episodes[ms] else "EPISODES DIFFER between the sides"
        print(f"  {ms:g} ms: {_spread(ratios[ms])}× ({same})")
    load_after = _loadavg()
    print(f"load average: {load_before:.2f} before, {load_after:.2f} after")
    summary = {
        "config": {
            "model_dir": str(args.model_dir),
            "precision": bench.precision,
            "device": str(bench.device),
            "torch_threads": torch.get_num_threads(),
            "cpu": _cpu_name(),
            "prompts": args.prompts,
            "samples": args.samples,
            "episodes_per_batch": rows,
            "temperature": args.temperature,
            "max_tokens": args.max_tokens,
            "max_episode_steps": args.max_episode_steps,
            "rounds": args.rounds,
            "batches": args.batches,
            "slow_serial_batches": args.slow_serial_batches,
            "slow_latency_ms": SLOW_LATENCY_MS,
            "latencies_ms": latencies,
            "idle_load": args.idle_load if args.idle_load != float("inf") else None,
            "quick": args.quick,
            "concurrent_max_calls": runners["concurrent"].max_concurrent_calls,
            "remote_concurrency": remote.concurrency,
        },
        "warmup": [asdict(w) for w in warm],
        "medians": table,
        "ratio_concurrent_over_serial": {str(ms): ratios[ms] for ms in latencies},
        "same_episodes": {str(ms): same_episodes[ms] for ms in latencies},
        "windows": windows,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
    }
    print("RESULT " + json.dumps(summary))


if __name__ == "__main__":
    main()
