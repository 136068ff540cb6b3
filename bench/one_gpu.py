"""One GPU: plain Lightning against ``ZorseStrategy()`` with its defaults, the same module, data, batch and precision.

    python -m bench.one_gpu                                # on one GPU: 6 cases (goal: under 6 minutes on an H100)
    python -m bench.one_gpu --model gpt_86m --precision bf16-mixed --steps 20
    python -m bench.one_gpu --case llama_168m/32-true
    .venv/bin/python -m bench.one_gpu --tiny               # the same code on this CPU, small sizes, 5 rounds (about 2 min)
    tools/gpu_run.sh                                       # on the GPU machine: versions, nvidia-smi, then this

Cases: the project's GPT (``zorse_lightning.models.gpt``, byte vocabulary 256)
at 86M (width 768, 12 layers, 12 heads) and 1.2B (width 2048, 24 layers, 16
heads), and a Hugging Face Llama built from its config (``transformers``
``LlamaForCausalLM`` through the project's ``CausalLm``, nothing downloaded:
hidden 1024, 8 layers, 16 heads, intermediate 2816, vocab 32000, 168M), each
at sequence 1024 and batch 8, in ``bf16-mixed`` and ``32-true`` (the Trainer's
flag, for both strategies), with AdamW (the modules' own ``configure_optimizers``).

Each run is its own fresh process (forked from a forkserver that has only
imported, on CPU, or nothing, on a GPU), so plain and zorse runs share no
process group, allocator or autotuner state:

- plain: ``Trainer(strategy="auto", accelerator="gpu", devices=1)``, the model
  built on the device (``trainer.init_module()``);
- zorse: ``Trainer(strategy=ZorseStrategy(), accelerator="gpu", devices=1)``:
  no cluster given, so it is detected from the device, and the plan is made at
  start-up; the model is built on the meta device
  (``trainer.init_module(empty_init=True)``) and materialized on the device by
  the strategy.

Data are random token ids (``(tokens, next_tokens)`` pairs). A callback
synchronises the device at the start and at the end of every training batch;
a step's time is the interval between the ends of consecutive batches (all the
step's work, the strategy's after-step work included); the figure is the
median over ``--steps`` steps after ``--warmup``. Measured peak memory is
``torch.cuda.max_memory_allocated`` over the timed steps (reset at the first,
so start-up's probes are not in it: the plan predicts training's peak);
``warmup_peak_gib`` is zorse's peak before that, start-up included;
the predicted figures are the start-up plan's (``ZorseStrategy.plan.predicted``:
iteration time and rank 0's peak), ``microbatch_size`` the plan's.

One JSON line per case and round (``--rounds``: each round runs every case, so a
case's rounds lie minutes apart; ``round`` says which), then, with several rounds,
a summary line per case: ``{"case": "summary", "model", "precision", "rounds",
"prediction_error_pct_median", "..._min", "..._max", "ratio_median", "ratio_min",
"ratio_max", "microbatch_sizes", "plain_iteration_ms_min", "plain_iteration_ms_max"}``. ``--tiny`` runs 5 rounds: this shared CPU's speed
drifts by tens of percent within minutes, so one round's error says as much about the
drift between start-up's profile and the timed steps as about the cost model. The case lines::

    {"model", "precision", "plain_samples_per_s", "zorse_samples_per_s", "ratio", "predicted_iteration_ms",
     "measured_iteration_ms", "predicted_peak_gib", "measured_peak_gib", "microbatch_size", ...}

``ratio`` = zorse / plain samples per second; ``measured_iteration_ms`` is
zorse's median step. Extra keys: ``plain_iteration_ms``, ``plain_peak_gib``,
``microbatches`` (per rank), ``zorse_precision`` (the plan's precision note: what
zorse trained in, and why), ``device``, ``sizes`` and, where a run failed,
``error`` (its last lines; the script then exits 1 after the other cases).

``--tiny`` runs the same code on the CPU: one rank of a non-emulated inventory
(a real device, nothing emulated: ``ZorseStrategy(cluster=CPU_ONE,
emulate=False)``), small sizes (width 64, 2-3 layers, sequence 32, batch 8), few
steps; the peak fields are null. It then prints the host overhead, where no
compute can hide it: both strategies on a model too small to compute (width 8,
2 layers, sequence 4, batch 8), the median wall time per step of each, the pair
run once a round and every figure the median over the rounds::

    {"case": "host_overhead", "plain_host_ms_per_step", "plain_host_ms_min", "zorse_host_ms_per_step",
     "zorse_host_ms_min", "difference_ms", "differences_ms", "rounds", "steps", "sizes"}

The project's goal is zorse within 1 ms a step of plain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PRECISIONS = ("bf16-mixed", "32-true")
GIB = float(1 << 30)

CPU_ONE = {
    "name": "cpu_one",
    "description": "this CPU as one real device, nothing emulated (bench.one_gpu --tiny)",
    "emulated": False,
    "machines": [{"name": "localhost", "intra_bandwidth_gbps": 10, "gpus": [{"type": "a100x40", "count": 1}]}],
}
"""The ``--tiny`` inventory: one rank; with ``emulate=False`` its device is the CPU itself, timed as it is."""


@dataclass(frozen=True)
class ModelSize:
    kind: str
    """``gpt`` (the project's) or ``llama`` (Hugging Face, from its config)."""
    width: int
    layers: int
    heads: int
    seq_len: int
    vocab: int
    intermediate: int = 0
    """Llama's MLP width."""
    batch: int = 8


MODELS: dict[str, ModelSize] = {  # in the order they run: the longest last
    "gpt_86m": ModelSize("gpt", width=768, layers=12, heads=12, seq_len=1024, vocab=256),
    "llama_168m": ModelSize("llama", width=1024, layers=8, heads=16, seq_len=1024, vocab=32000, intermediate=2816),
    "gpt_1.2b": ModelSize("gpt", width=2048, layers=24, heads=16, seq_len=1024, vocab=256),
}
TINY_MODELS: dict[str, ModelSize] = {  # in the order they run: the longest last
    "gpt_86m": ModelSize("gpt", width=64, layers=2, heads=4, seq_len=32, vocab=256),
    "llama_168m": ModelSize("llama", width=64, layers=2, heads=4, seq_len=32, vocab=512, intermediate=176),
    "gpt_1.2b": ModelSize("gpt", width=96, layers=3, heads=4, seq_len=32, vocab=256),
}
HOST_OVERHEAD_MODEL = ModelSize("gpt", width=8, layers=2, heads=1, seq_len=4, vocab=16)
"""Too small to compute: what a step costs is the host's work around it. Two layers, not one: a block list of at
least two is what the strategy cuts, profiles and plans (one layer would get an unprofiled data-parallel plan)."""


@dataclass(frozen=True)
class Run:
    """One Trainer run in its own process."""

    strategy: str
    """``plain`` or ``zorse``."""
    model: ModelSize
    precision: str
    warmup: int
    steps: int
    cpu: bool = False
    seed: int = 0
    threads: int = 0
    """torch threads on CPU (0: torch's default)."""
    same_start: bool = False
    """Both strategies from the same weights (built on the host from ``seed``), and the trained weights kept:
    for comparing parameters, not timing start-up."""


# -- one run (child process) ---------------------------------------------------------------


def _module(size: ModelSize):
    if size.kind == "gpt":
        from zorse_lightning.models.gpt import GPT

        return GPT(vocab_size=size.vocab, seq_len=size.seq_len, width=size.width, layers=size.layers,
                   heads=size.heads)
    if size.kind == "llama":
        from zorse_lightning.models.causal_lm import CausalLm

        return CausalLm("llama", config={
            "vocab_size": size.vocab, "hidden_size": size.width, "intermediate_size": size.intermediate,
            "num_hidden_layers": size.layers, "num_attention_heads": size.heads,
            "num_key_value_heads": size.heads, "max_position_embeddings": size.seq_len,
        })
    raise ValueError(f"unknown model kind {size.kind!r}")


def _timer(device_type: str, warmup: int):
    import lightning.pytorch as pl
    import torch

    cuda = device_type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    class SyncedStepTimer(pl.Callback):
        """Synchronises the device at the start and end of each training batch and records both times; at the
        first timed batch, keeps the run's peak memory so far (start-up's included) and starts the training
        peak anew."""

        def __init__(self) -> None:
            self.starts: list[float] = []
            self.ends: list[float] = []
            self.startup_peak_bytes: int | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            sync()
            if cuda and len(self.starts) == warmup:
                self.startup_peak_bytes = torch.cuda.max_memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            self.starts.append(time.perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            sync()
            self.ends.append(time.perf_counter())

    return SyncedStepTimer()


def run_once(run: Run, root: str) -> dict[str, Any]:
    """Train ``run`` in this process; its timings, memory and (zorse) plan."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    if run.threads:
        torch.set_num_threads(run.threads)
        # Lightning's launcher for process-group strategies sets torch's threads to the cores per process unless
        # OMP_NUM_THREADS is set, which a single-device run never does: both strategies keep the same threads.
        os.environ["OMP_NUM_THREADS"] = str(run.threads)
    accelerator = "cpu" if run.cpu else "gpu"
    device_type = "cpu" if run.cpu else "cuda"
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if run.strategy == "zorse":
        from zorse_lightning.strategy.zorse_strategy import ZorseStrategy

        strategy: Any = ZorseStrategy(cluster=CPU_ONE, emulate=False) if run.cpu else ZorseStrategy()
    else:
        strategy = "auto"
    timer = _timer(device_type, run.warmup)
    size = run.model
    total = run.warmup + run.steps
    trainer = pl.Trainer(
        strategy=strategy, accelerator=accelerator, devices=1, precision=run.precision, max_steps=total,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[timer], default_root_dir=root,
    )
    torch.manual_seed(run.seed)
    if run.same_start:  # on the host, the same values for both strategies
        module = _module(size)
    else:  # Plain: built on its device, initialised there. Zorse: on the meta device, materialized per stage.
        with trainer.init_module(empty_init=run.strategy == "zorse"):
            module = _module(size)
    tokens = torch.randint(0, size.vocab, (size.batch * total, size.seq_len + 1),
                           generator=torch.Generator().manual_seed(run.seed))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=size.batch)
    started = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader)
    fit_s = time.perf_counter() - started
    if len(timer.ends) < total:
        raise RuntimeError(f"{len(timer.ends)} of {total} steps ran")
    periods = [b - a for a, b in zip(timer.ends[run.warmup - 1:], timer.ends[run.warmup:])]  # warmup >= 1
    inside = [b - a for a, b in zip(timer.starts[run.warmup:], timer.ends[run.warmup:])]
    result: dict[str, Any] = {
        "step_ms": [round(p * 1000.0, 3) for p in periods],
        "median_step_ms": statistics.median(periods) * 1000.0,
        "median_inside_batch_ms": statistics.median(inside) * 1000.0,
        "fit_s": fit_s,
        "samples_per_step": size.batch,
        "peak_gib": torch.cuda.max_memory_allocated() / GIB if device_type == "cuda" else None,
        "warmup_peak_gib": timer.startup_peak_bytes / GIB if timer.startup_peak_bytes is not None else None,
        "device": torch.cuda.get_device_name() if device_type == "cuda" else "cpu",
    }
    if run.same_start:
        result["parameters"] = _parameter_sample(module)
    if run.strategy == "zorse":
        plan = trainer.strategy.plan
        predicted = plan.predicted
        result["plan"] = {
            "microbatch_size": int(plan.microbatch_size),
            "microbatches": [list(s.microbatches_per_rank) for s in plan.stages],
            "stages": len(plan.stages),
            "predicted_iteration_ms": predicted.iteration_ms if predicted else None,
            "predicted_peak_gib": predicted.memory_gib[0] if predicted and predicted.memory_gib else None,
            "notes": list(plan.notes),
        }
    return result


PARAMETER_SAMPLE = 4096
"""Elements kept of each trained weight (its first ones) to compare the two strategies' parameters."""


def _parameter_sample(module) -> dict[str, list[float]]:
    return {name: p.detach().float().flatten()[:PARAMETER_SAMPLE].cpu().tolist() for name, p in module.named_parameters()}


def parameters_line(args: argparse.Namespace, models: dict[str, ModelSize]) -> dict[str, Any]:
    """Plain and zorse trained from the same weights on the same batches in fp32: how far apart they end."""
    name, steps = "gpt_86m", args.compare_steps
    size = models[name]
    runs = {
        strategy: run_in_process(Run(strategy, size, "32-true", 1, steps - 1, cpu=args.tiny, threads=1 if args.tiny else 0,
                                     same_start=True), args.timeout, args.verbose)
        for strategy in ("plain", "zorse")
    }
    line: dict[str, Any] = {"case": "parameters_after_steps", "model": name, "precision": "32-true", "steps": steps}
    errors = [r["error"] for r in runs.values() if "error" in r]
    if errors:
        line["error"] = "\n".join(errors)
        return line
    plain, zorse = runs["plain"]["parameters"], runs["zorse"]["parameters"]
    differences = [abs(a - b) for n in plain for a, b in zip(plain[n], zorse[n])]
    scale = max(abs(a) for n in plain for a in plain[n])
    line.update(
        max_abs_diff=max(differences), mean_abs_diff=statistics.fmean(differences), max_abs_weight=scale,
        compared=len(differences), same_names=sorted(plain) == sorted(zorse),
    )
    return line


def _child(run: Run, out: str, log: str, environment: dict[str, str]) -> None:
    """A run's process: its output to ``log``, its result to ``out``."""
    os.environ.update(environment)  # a forkserver's child has the server's environment, not the parent's
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    with tempfile.TemporaryDirectory() as root:
        result = run_once(run, root)
    Path(out).write_text(json.dumps(result))


# -- the driver -------------------------------------------------------------------------------

PRELOAD = ("torch", "lightning.pytorch", "zorse_lightning.strategy.zorse_strategy", "zorse_lightning.models.gpt",
           "zorse_lightning.models.causal_lm")
"""What the process server imports once on CPU (``--tiny``), so each run starts in a fresh fork of it, not a fresh
interpreter (an import of Lightning is 8 s on two busy cores). On a GPU nothing is preloaded: every run imports
everything itself, so no CUDA state could ever be shared."""

_CONTEXT = None


def _context(preload: bool):
    """One forkserver for the whole bench: each run is a new process forked from a server that has done nothing
    but (with ``preload``) import; no process group, device state or allocator is ever shared."""
    global _CONTEXT
    if _CONTEXT is None:
        import multiprocessing

        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(list(PRELOAD) if preload else [])
    return _CONTEXT


def run_in_process(run: Run, timeout_s: float, verbose: bool) -> dict[str, Any]:
    """``run`` in a fresh process; its result, or ``{"error": ...}``."""
    from testing.launch import free_port

    environment = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    with tempfile.TemporaryDirectory() as tmp:
        out, log = Path(tmp, "result.json"), Path(tmp, "log.txt")
        started = time.perf_counter()
        process = _context(run.cpu).Process(target=_child, args=(run, str(out), str(log), environment), daemon=False)
        process.start()
        process.join(timeout_s)
        if process.is_alive():
            process.kill()
            process.join()
            code: int | str | None = f"killed after {timeout_s:.0f} s"
        else:
            code = process.exitcode
        text = log.read_text(errors="replace") if log.exists() else ""
        if verbose:
            sys.stderr.write(text)
        took = time.perf_counter() - started
        print(f"  {run.strategy:5s} {run.precision:10s} {took:6.1f} s (process)", file=sys.stderr, flush=True)
        if code != 0 or not out.exists():
            tail = "\n".join(text.strip().splitlines()[-15:])
            return {"error": f"{run.strategy} run: exit {code}\n{tail}"}
        return json.loads(out.read_text())


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def case_line(name: str, precision: str, size: ModelSize, plain: dict, zorse: dict, tiny: bool) -> dict[str, Any]:
    """The case's JSON line from its two runs."""
    line: dict[str, Any] = {"model": name, "precision": precision}
    plain_rate = size.batch / (plain["median_step_ms"] / 1000.0) if "error" not in plain else None
    zorse_rate = size.batch / (zorse["median_step_ms"] / 1000.0) if "error" not in zorse else None
    plan = zorse.get("plan", {})
    line.update(
        plain_samples_per_s=_round(plain_rate), zorse_samples_per_s=_round(zorse_rate),
        ratio=_round(zorse_rate / plain_rate, 4) if plain_rate and zorse_rate else None,
        predicted_iteration_ms=_round(plan.get("predicted_iteration_ms")),
        measured_iteration_ms=_round(zorse.get("median_step_ms")),
        predicted_peak_gib=_round(plan.get("predicted_peak_gib")),
        measured_peak_gib=_round(zorse.get("peak_gib")),
        microbatch_size=plan.get("microbatch_size"),
        microbatches=plan.get("microbatches"),
        zorse_precision=next((n for n in plan.get("notes", ()) if n.startswith("precision")), None),
        plain_iteration_ms=_round(plain.get("median_step_ms")),
        plain_peak_gib=_round(plain.get("peak_gib")),
        warmup_peak_gib=_round(zorse.get("warmup_peak_gib")),
        device=zorse.get("device") or plain.get("device"),
        sizes={"tiny": tiny, **asdict(size)},
    )
    errors = [r["error"] for r in (plain, zorse) if "error" in r]
    if errors:
        line["error"] = "\n".join(errors)
    return line


def prediction_error_pct(line: dict[str, Any]) -> float | None:
    """How far the plan's predicted iteration time is from the measured one, in percent of the measured."""
    predicted, measured = line.get("predicted_iteration_ms"), line.get("measured_iteration_ms")
    return None if not (predicted and measured) else 100.0 * (predicted / measured - 1.0)


def summary_lines(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per case over its rounds: the median prediction error and ratio, and their spread.

    On a shared host whose speed drifts by tens of percent within minutes, one
    round compares a profile taken in one machine state with steps run in
    another; the rounds of a case run minutes apart, and their median is the
    figure the goal is judged on (each round's own line stays beside it). Plain
    Lightning's step over the rounds (its least and its most) is the machine's own
    noise: the same computation, timed the same way, in fresh processes."""
    by_case: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for line in lines:
        if "error" not in line:
            by_case.setdefault((line["model"], line["precision"]), []).append(line)
    summaries = []
    for (model, precision), rounds in by_case.items():
        errors = [e for e in map(prediction_error_pct, rounds) if e is not None]
        ratios = [r["ratio"] for r in rounds if r.get("ratio")]
        plain = [r["plain_iteration_ms"] for r in rounds if r.get("plain_iteration_ms")]
        summaries.append({
            "case": "summary", "model": model, "precision": precision, "rounds": len(rounds),
            "prediction_error_pct_median": _round(statistics.median(errors), 1) if errors else None,
            "prediction_error_pct_min": _round(min(errors), 1) if errors else None,
            "prediction_error_pct_max": _round(max(errors), 1) if errors else None,
            "ratio_median": _round(statistics.median(ratios), 4) if ratios else None,
            "ratio_min": _round(min(ratios), 4) if ratios else None,
            "ratio_max": _round(max(ratios), 4) if ratios else None,
            "microbatch_sizes": sorted({r["microbatch_size"] for r in rounds if r.get("microbatch_size")}),
            "plain_iteration_ms_min": _round(min(plain)) if plain else None,
            "plain_iteration_ms_max": _round(max(plain)) if plain else None,
        })
    return summaries


def host_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """Both strategies on a model too small to compute, on this CPU: wall time per step, the pair run
    ``args.rounds`` times in turn (this CPU's speed drifts between runs seconds apart) and each figure the
    median over the rounds; ``difference_ms`` is the median of each round's own difference."""
    line: dict[str, Any] = {"case": "host_overhead"}
    rounds: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        runs = {
            name: run_in_process(Run(name, HOST_OVERHEAD_MODEL, "32-true", args.overhead_warmup, args.overhead_steps,
                                     cpu=True, threads=1), args.timeout, args.verbose)
            for name in ("plain", "zorse")
        }
        errors = [r["error"] for r in runs.values() if "error" in r]
        if errors:
            line["error"] = "\n".join(errors)
            return line
        rounds.append({
            f"{name}_{figure}": value for name, result in runs.items()
            for figure, value in (("host_ms_per_step", result["median_step_ms"]), ("host_ms_min", min(result["step_ms"])))
        })
    for key in rounds[0]:  # the least step: what contention from other work on the cores leaves
        line[key] = _round(statistics.median(r[key] for r in rounds))
    line["difference_ms"] = _round(statistics.median(r["zorse_host_ms_per_step"] - r["plain_host_ms_per_step"] for r in rounds))
    line["differences_ms"] = [_round(r["zorse_host_ms_per_step"] - r["plain_host_ms_per_step"]) for r in rounds]
    line["rounds"] = args.rounds
    line["steps"] = args.overhead_steps
    line["sizes"] = asdict(HOST_OVERHEAD_MODEL)
    return line


def selected_cases(args: argparse.Namespace, models: dict[str, ModelSize]) -> list[tuple[str, str]]:
    cases = [(m, p) for m in models for p in PRECISIONS]
    if args.model:
        cases = [c for c in cases if c[0] in args.model]
    if args.precision:
        cases = [c for c in cases if c[1] in args.precision]
    if args.case:
        cases = [c for c in cases if f"{c[0]}/{c[1]}" in args.case]
    return cases


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes on this CPU (non-emulated), plus host overhead")
    parser.add_argument("--model", nargs="+", choices=sorted(MODELS), help="only these models")
    parser.add_argument("--precision", nargs="+", choices=PRECISIONS, help="only these precisions")
    parser.add_argument("--case", nargs="+", help="only these cases, as MODEL/PRECISION (gpt_86m/bf16-mixed)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps after warm-up (default 20; --tiny 10)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="times every case runs, one round of all cases after the other, then a summary line per "
                             "case (default 1; --tiny 5: this CPU's speed drifts)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 10; --tiny 3)")
    parser.add_argument("--overhead-steps", type=int, default=40, help="--tiny: timed steps of the host-overhead runs")
    parser.add_argument("--overhead-warmup", type=int, default=10)
    parser.add_argument("--no-host-overhead", action="store_true", help="--tiny: skip the host-overhead line")
    parser.add_argument("--host-overhead-only", action="store_true", help="--tiny: only the host-overhead line")
    parser.add_argument("--compare-steps", type=int, default=40,
                        help="fp32 steps of the parameter comparison (same start, GPT 86M; 0: skip it)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run (process) before it is killed")
    parser.add_argument("--verbose", action="store_true", help="pass each run's output through to stderr")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 10 if args.tiny else 20
    if args.rounds is None:
        args.rounds = 5 if args.tiny else 1
    if args.warmup is None:
        args.warmup = 3 if args.tiny else 10
    if args.host_overhead_only and not args.tiny:
        parser.error("--host-overhead-only goes with --tiny (the host overhead is measured on this CPU)")
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1:
        parser.error("--steps, --warmup and --rounds must be at least 1")
    if args.case:
        known = {f"{m}/{p}" for m in MODELS for p in PRECISIONS}
        unknown = sorted(set(args.case) - known)
        if unknown:
            parser.error(f"unknown case(s) {unknown}; known: {sorted(known)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    models = TINY_MODELS if args.tiny else MODELS
    started = time.perf_counter()
    failed = False
    cases = [] if args.host_overhead_only else selected_cases(args, models)
    lines = []
    for round_index in range(args.rounds):
        for name, precision in cases:
            size = models[name]
            print(f"{name} {precision} (round {round_index + 1} of {args.rounds}):", file=sys.stderr, flush=True)
            results = {
                strategy: run_in_process(Run(strategy, size, precision, args.warmup, args.steps, cpu=args.tiny,
                                             threads=1 if args.tiny else 0), args.timeout, args.verbose)
                for strategy in ("plain", "zorse")
            }
            line = case_line(name, precision, size, results["plain"], results["zorse"], args.tiny)
            line["round"] = round_index + 1
            failed |= "error" in line
            lines.append(line)
            print(json.dumps(line), flush=True)
    if args.rounds > 1:
        for line in summary_lines(lines):
            print(json.dumps(line), flush=True)
    if args.compare_steps and not args.host_overhead_only:
        print("parameters:", file=sys.stderr, flush=True)
        line = parameters_line(args, models)
        failed |= "error" in line
        print(json.dumps(line), flush=True)
    if args.tiny and not args.no_host_overhead:
        print("host overhead:", file=sys.stderr, flush=True)
        line = host_overhead(args)
        failed |= "error" in line
        print(json.dumps(line), flush=True)
    print(f"{time.perf_counter() - started:.0f} s in all", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
