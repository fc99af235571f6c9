"""FP8 accuracy on the CPU: the lm-eval local tasks and per-item log-likelihoods of the FP8 configs
(FP8 KV cache; FP8 weights + FP8 KV cache) against the float32 reference, on the real SmolLM2.

The CPU runs float32, the reference here (it is the CPU's 16-bit-equivalent: the FP8 configs compute in
float32 too, so their difference from it is the FP8 rounding alone); bfloat16 runs as one more row, to show
how far 16-bit rounding itself moves the same numbers (float16 has no fast NumPy matmul: minutes per task,
so it is left out). For each config it runs the tasks of data/lm_eval (multiple choice, greedy generation,
rolling log-likelihood) through our lm-eval backend, and scores a fixed set of loglikelihood requests:
the multiple-choice task's (context, choice) pairs and a seeded set of (context, continuation) pairs cut
from the texts of data/prompts.jsonl and data/lm_eval/rolling.jsonl. Prints one table (task scores, their
differences from the reference in points, mean and largest |loglikelihood difference| per item, how many
greedy generations equal the reference's) and the issue's thresholds, and writes a JSON record (with every
per-item loglikelihood, so a later GPU run can be compared item by item) to benchmarks/results/.

    .venv/bin/python benchmarks/fp8_accuracy.py [--model DIR] [--num-pairs 300] [--seed 0]
        [--configs fp32 bf16 fp8_kv ...] [--no-record]

On the GPU the reference is bf16 and the FP8 configs run over bf16 (GPU_CONFIGS). The GPU machine has no
lm-eval, so that run has three stages; the requests and answers travel as JSON files:

    here:     .venv/bin/python benchmarks/fp8_accuracy.py --export-requests benchmarks/fp8_accuracy_requests.json
    the GPU:  python3 benchmarks/fp8_accuracy.py --score-requests benchmarks/fp8_accuracy_requests.json \
                  --answers $OUT/answers.json [--configs ...]    (scripts/device_real_model.sh fp8-accuracy)
    here:     .venv/bin/python benchmarks/fp8_accuracy.py --report-requests benchmarks/fp8_accuracy_requests.json \
                  --answers answers.json

Stage 1 runs the tasks through a backend that records the engine's work (token ids to score, prompts to
generate from); stage 2 answers them with entrypoints/scoring.py once per config; stage 3 runs the tasks again
through a backend that replays each config's answers (refusing any request that differs from the recorded one)
and reports as above. tests/test_fp8_accuracy_script.py checks that the three stages report exactly what the
direct run does.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "data"
RESULTS = REPO / "benchmarks" / "results"
TASKS = ["offline_paged_mc", "offline_paged_gen", "offline_paged_rolling"]
# (task, lm-eval metric key, table heading, scale): scale 100 turns a fraction into points.
METRICS = [("offline_paged_mc", "acc,none", "mc acc", 100.0),
           ("offline_paged_mc", "acc_norm,none", "mc acc_norm", 100.0),
           ("offline_paged_gen", "exact_match,none", "gen EM", 100.0),
           ("offline_paged_rolling", "bits_per_byte,none", "rolling bpb", 1.0)]
POINT_METRICS = ("mc acc", "mc acc_norm", "gen EM")  # the "within 1 point"
# The thresholds on the mean per-item |loglikelihood difference|.
DLL_THRESHOLDS = {"fp8_kv": 0.05, "fp8_kv_calc": 0.05, "fp8_w_kv": 0.15}
POINT_THRESHOLD = 1.0


@dataclass(slots=True, frozen=True)
class Config:
    """One engine configuration: `engine_args` go to LLM(...) through OfflinePagedLM."""
    name: str
    label: str
    engine_args: dict = field(default_factory=dict)


CONFIGS = [
    Config("fp32", "float32 (reference)", {"dtype": "float32"}),
    Config("bf16", "bfloat16", {"dtype": "bfloat16"}),
    Config("fp8_kv", "FP8 KV (scales 1.0)", {"dtype": "float32", "kv_cache_dtype": "fp8"}),
    Config("fp8_kv_calc", "FP8 KV (calculated scales)",
           {"dtype": "float32", "kv_cache_dtype": "fp8", "calculate_kv_scales": True}),
    Config("fp8_w", "FP8 weights", {"dtype": "float32", "quantization": "fp8"}),
    Config("fp8_w_kv", "FP8 weights + FP8 KV", {"dtype": "float32", "quantization": "fp8", "kv_cache_dtype": "fp8"}),
]
REFERENCE = "fp32"
# On the GPU (16-bit only) the reference is bf16, the baseline, and the FP8 configs run over bf16.
GPU_CONFIGS = [Config("bf16", "bfloat16 (reference)", {"dtype": "bfloat16"})] + [
    replace(c, engine_args=c.engine_args | {"dtype": "bfloat16"}) for c in CONFIGS if c.name.startswith("fp8")]
GPU_REFERENCE = "bf16"


@dataclass(slots=True)
class ConfigResult:
    """What one config scored: task metrics (in table units), per-item loglikelihoods of the fixed sets."""
    config: Config
    scores: dict[str, float]
    mc_loglikelihoods: list[float]
    pair_loglikelihoods: list[float]
    generations: list[str]  # the gen task's greedy texts, by doc
    seconds: float


# ----------------------------------------------------------------- the fixed loglikelihood requests
def corpus_texts(data: Path = DATA) -> list[str]:
    """The texts the pairs are cut from: each prompt of prompts.jsonl (a chat's message contents joined
    by newlines) and each text of lm_eval/rolling.jsonl."""
    texts = []
    for line in (data / "prompts.jsonl").read_text().splitlines():
        record = json.loads(line)
        if isinstance(record.get("prompt"), str):
            texts.append(record["prompt"])
        elif isinstance(record.get("messages"), list):
            texts.append("\n".join(m["content"] for m in record["messages"]))
    for line in (data / "lm_eval" / "rolling.jsonl").read_text().splitlines():
        texts.append(json.loads(line)["text"])
    return texts


def pair_requests(token_lists: list[list[int]], num_pairs: int, seed: int,
                  max_continuation: int = 8) -> list[tuple[None, list[int], list[int]]]:
    """`num_pairs` distinct (None, context ids, continuation ids) requests, lm-eval's shape: a seeded
    split point in a tokenized text (at least one context token) and a continuation of 1 to
    `max_continuation` tokens after it. ValueError when the texts hold fewer distinct pairs."""
    candidates = [(t, k, m) for t, ids in enumerate(token_lists) for k in range(1, len(ids))
                  for m in range(1, min(max_continuation, len(ids) - k) + 1)]
    if num_pairs > len(candidates):
        raise ValueError(f"asked for {num_pairs} pairs; the texts hold only {len(candidates)} distinct ones")
    chosen = random.Random(seed).sample(candidates, num_pairs)
    return [(None, token_lists[t][:k], token_lists[t][k:k + m]) for t, k, m in chosen]


def loglikelihoods(lm, requests: list) -> list[float]:
    """Sum of the continuation's logprobs per (cache key, context ids, continuation ids) request."""
    return [total for total, _ in lm._loglikelihood_tokens(requests, disable_tqdm=True)]


def _differences(reference: list[float], other: list[float]) -> list[float]:
    """other - reference, item by item, for two equally long, non-empty lists."""
    if len(reference) != len(other) or not reference:
        raise ValueError(f"need two equally long, non-empty lists of per-item loglikelihoods; got "
                         f"{len(reference)} and {len(other)}")
    return [b - a for a, b in zip(reference, other)]


def mean_abs_difference(reference: list[float], other: list[float]) -> float:
    """Mean over items of |other - reference| (the issue's per-item loglikelihood difference)."""
    return sum(abs(d) for d in _differences(reference, other)) / len(reference)


def max_abs_difference(reference: list[float], other: list[float]) -> float:
    return max(abs(d) for d in _differences(reference, other))


def mean_difference(reference: list[float], other: list[float]) -> float:
    """Mean over items of other - reference: the systematic shift, where errors of both signs cancel (the other
    reading of the issue's "mean per-item loglikelihood difference"; the verdict keeps the stricter |dLL|)."""
    return sum(_differences(reference, other)) / len(reference)


# ----------------------------------------------------------------- running a config
def task_manager(directory: Path):
    """The local task YAMLs with absolute data paths (lm-eval resolves them against the cwd)."""
    from lm_eval.tasks import TaskManager

    for yaml in (DATA / "lm_eval").glob("*.yaml"):
        (directory / yaml.name).write_text(yaml.read_text().replace("data/lm_eval/", f"{DATA}/lm_eval/"))
    return TaskManager(include_path=str(directory))


def responses(result: dict, task: str) -> list:
    """Each request's first response, docs in order (lm-eval logs one response list per request)."""
    samples = sorted(result["samples"][task], key=lambda s: s["doc_id"])
    return [resp[0] for s in samples for resp in s["resps"]]


def run_config(config: Config, model_dir: str, manager, pair_texts: list[str], num_pairs: int,
               seed: int) -> tuple[ConfigResult, list]:
    """Evaluate the tasks and score the fixed requests with one engine; returns the requests too (built
    with this engine's tokenizer, the same for every config)."""
    from offline_paged.entrypoints.lm_eval import OfflinePagedLM

    start = time.perf_counter()
    lm = OfflinePagedLM(pretrained=model_dir, device="cpu", **config.engine_args)
    return evaluate(lm, config, manager, pair_texts, num_pairs, seed, start)


def evaluate(lm, config: Config, manager, pair_texts: list[str], num_pairs: int, seed: int,
             start: float) -> tuple[ConfigResult, list]:
    """run_config's work on a given lm-eval backend (an engine, or one recording or replaying its answers)."""
    import lm_eval

    result = lm_eval.simple_evaluate(model=lm, tasks=TASKS, task_manager=manager, log_samples=True)
    requests = pair_requests([lm.tok_encode(text) for text in pair_texts], num_pairs, seed)
    pairs = loglikelihoods(lm, requests)
    scores = {heading: result["results"][task][key] * scale for task, key, heading, scale in METRICS}
    seconds = time.perf_counter() - start
    mc = [loglikelihood for loglikelihood, _ in responses(result, "offline_paged_mc")]
    return ConfigResult(config, scores, mc, pairs, responses(result, "offline_paged_gen"), seconds), requests


# ----------------------------------------------------------------- lm-eval here, the engine on the GPU machine
# The GPU machine has the engine but not lm-eval. So: `--export-requests` runs the tasks here through a backend
# that records the engine's work (OfflinePagedLM._score / _generate: token ids in, numbers or raw texts out);
# `--score-requests` answers those on the GPU with entrypoints/scoring.py, once per config; `--report-requests`
# runs the tasks here again through a backend that replays each config's answers, checking that every request is
# the recorded one, and reports as the CPU run does.
def stage_backend(model_dir: str, recorded: dict | None = None, answers: dict | None = None):
    """An OfflinePagedLM over the model's tokenizer (a float32 CPU engine that never runs) whose engine work is
    recorded (recorded=None: into .recorded) or replayed from `answers` (which must meet `recorded` exactly)."""
    from offline_paged.entrypoints.lm_eval import OfflinePagedLM

    class StageLM(OfflinePagedLM):
        def __init__(self):
            super().__init__(pretrained=model_dir, device="cpu", dtype="float32")
            self.recorded = {"scored": [], "generated": []}

        def _score(self, requests, disable_tqdm):
            batch = [[list(tokens), start] for tokens, start in requests]
            return [tuple(answer) for answer in self._next("scored", batch, [(0.0, False)] * len(batch))]

        def _generate(self, prompts, specs, disable_tqdm):
            batch = {"prompts": [list(p) for p in prompts], "specs": [[m, list(u), dict(k)] for m, u, k in specs]}
            return self._next("generated", batch, [""] * len(prompts))

        def _next(self, kind: str, batch, placeholder):
            index = len(self.recorded[kind])
            self.recorded[kind].append(batch)
            if recorded is None:
                return placeholder
            if index >= len(recorded[kind]) or json.loads(json.dumps(batch)) != recorded[kind][index]:
                raise RuntimeError(f"{kind} call {index} differs from the recorded requests: were they exported "
                                   f"with another model or another version of the tasks?")
            return answers[kind][index]

    return StageLM()


def export_requests(model_dir: str, path: Path, num_pairs: int, seed: int) -> dict:
    """Run the tasks and the pairs through a recording backend; write the requests to `path`."""
    with tempfile.TemporaryDirectory() as tmp:
        lm = stage_backend(model_dir)
        evaluate(lm, CONFIGS[0], task_manager(Path(tmp)), corpus_texts(), num_pairs, seed, time.perf_counter())
    record = {"model": model_dir, "num_pairs": num_pairs, "seed": seed, "git_commit": git_commit(), **lm.recorded}
    path.write_text(json.dumps(record) + "\n")
    return record


def score_requests(requests: dict, configs: list[Config], model_dir: str, device: str) -> dict:
    """Each config's answers to the recorded requests, from an engine on `device` (no lm-eval needed):
    {config name: {"scored": [[[logprob sum, greedy], ...] per call], "generated": [[text, ...] per call],
    "seconds": s}}."""
    import gc

    from offline_paged import LLM
    from offline_paged.entrypoints.scoring import generate_texts, score_continuations

    answers = {}
    for config in configs:
        start = time.perf_counter()
        llm = LLM(model=model_dir, device=device, seed=1234, **config.engine_args)  # OfflinePagedLM's seed
        scored = [score_continuations(llm, batch) for batch in requests["scored"]]  # ([tokens, start] pairs)
        generated = [generate_texts(llm, batch["prompts"], batch["specs"]) for batch in requests["generated"]]
        llm.close()
        del llm
        gc.collect()
        if device != "cpu":  # the next engine sizes its KV pool from the free device memory, as the bench does
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()
        answers[config.name] = {"scored": scored, "generated": generated, "seconds": time.perf_counter() - start}
        print(f"{config.label}: {answers[config.name]['seconds']:.1f} s", flush=True)
    return answers


def report_requests(model_dir: str, requests: dict, answers: dict, configs: list[Config]) -> list[ConfigResult]:
    """Each answered config's ConfigResult, lm-eval scoring the replayed answers (in `configs`' order)."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        manager = task_manager(Path(tmp))
        for config in configs:
            lm = stage_backend(model_dir, requests, answers[config.name])
            result, _ = evaluate(lm, config, manager, corpus_texts(), requests["num_pairs"], requests["seed"], 0.0)
            result.seconds = answers[config.name]["seconds"]
            results.append(result)
    return results


# ----------------------------------------------------------------- report
def comparison(reference: ConfigResult, result: ConfigResult) -> dict:
    """Score differences (points) and per-item |dLL| of `result` against `reference`."""
    both_ref = reference.mc_loglikelihoods + reference.pair_loglikelihoods
    both = result.mc_loglikelihoods + result.pair_loglikelihoods
    return {
        "score_diff": {h: result.scores[h] - reference.scores[h] for h in result.scores},
        "same_generations": sum(a == b for a, b in zip(reference.generations, result.generations, strict=True)),
        "mean_abs_dll_mc": mean_abs_difference(reference.mc_loglikelihoods, result.mc_loglikelihoods),
        "mean_abs_dll_pairs": mean_abs_difference(reference.pair_loglikelihoods, result.pair_loglikelihoods),
        "mean_abs_dll_all": mean_abs_difference(both_ref, both),
        "max_abs_dll_all": max_abs_difference(both_ref, both),
        "mean_dll_all": mean_difference(both_ref, both),
    }


def verdict(name: str, diff: dict) -> str | None:
    """The issue's criteria for an FP8 config: every point metric within 1 point, mean |dLL| (all items)
    within its threshold. None for configs the issue sets no threshold for."""
    if name not in DLL_THRESHOLDS:
        return None
    worst = max(abs(diff["score_diff"][h]) for h in POINT_METRICS)
    points = "met" if worst <= POINT_THRESHOLD else "NOT met"
    limit = DLL_THRESHOLDS[name]
    dll = "met" if diff["mean_abs_dll_all"] <= limit else "NOT met"
    return (f"{name}: tasks within {POINT_THRESHOLD:g} point {points} (largest {worst:.1f}); "
            f"mean |dLL| {diff['mean_abs_dll_all']:.3f} <= {limit} {dll} (signed mean dLL "
            f"{diff['mean_dll_all']:+.3f})")


def table(results: list[ConfigResult], diffs: dict[str, dict]) -> str:
    headings = [h for _, _, h, _ in METRICS]
    lines = ["| config | " + " | ".join(headings) + " | mean \\|dLL\\| mc | mean \\|dLL\\| pairs | "
             "mean \\|dLL\\| all | max \\|dLL\\| | mean dLL (signed) | gen = ref |",
             "|---" * (len(headings) + 7) + "|"]
    for result in results:
        diff = diffs.get(result.config.name)
        cells = [_score_cell(result.scores[h], None if diff is None else diff["score_diff"][h], h)
                 for h in headings]
        if diff is None:
            cells += ["-"] * 6
        else:
            cells += [f"{diff[k]:.3f}" for k in ("mean_abs_dll_mc", "mean_abs_dll_pairs", "mean_abs_dll_all",
                                                  "max_abs_dll_all")]
            cells.append(f"{diff['mean_dll_all']:+.3f}")
            cells.append(f"{diff['same_generations']}/{len(result.generations)}")
        lines.append(f"| {result.config.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _score_cell(value: float, diff: float | None, heading: str) -> str:
    digits = 1 if heading in POINT_METRICS else 4
    return f"{value:.{digits}f}" if diff is None else f"{value:.{digits}f} ({diff:+.{digits}f})"


def git_commit() -> str:
    """$OFFLINE_PAGED_GIT_COMMIT when set (a copied tree on the device, whose .git may be stale; as the bench),
    else the checkout's commit, "-dirty" with uncommitted changes."""
    if os.environ.get("OFFLINE_PAGED_GIT_COMMIT"):
        return os.environ["OFFLINE_PAGED_GIT_COMMIT"]
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return commit + ("-dirty" if dirty else "")


def write_record(results: list[ConfigResult], diffs: dict, args, num_mc: int, machine: str = "CPU") -> Path:
    now = datetime.now(timezone.utc)
    commit = git_commit()
    where = "the CPU (ml_dtypes emulation)" if machine == "CPU" else f"{machine} (lm-eval scoring on the CPU)"
    record = {"header": f"FP8 accuracy on {where}, real SmolLM2-135M-Instruct",
              "date": now.isoformat(timespec="seconds"), "git_commit": commit, "machine": machine,
              "cpu": platform.processor() or platform.machine(), "model": args.model or "default",
              "reference": REFERENCE, "num_mc_requests": num_mc, "num_pairs": args.num_pairs, "seed": args.seed,
              "thresholds": {"points": POINT_THRESHOLD, "mean_abs_dll": DLL_THRESHOLDS},
              "configs": [asdict(r.config) | {"scores": r.scores, "seconds": r.seconds,
                                               "vs_reference": diffs.get(r.config.name),
                                               "generations": r.generations,
                                               "mc_loglikelihoods": r.mc_loglikelihoods,
                                               "pair_loglikelihoods": r.pair_loglikelihoods} for r in results]}
    RESULTS.mkdir(exist_ok=True)
    suffix = "cpu" if machine == "CPU" else "gpu"
    path = RESULTS / f"{now:%Y-%m-%d}_{commit.split('-')[0]}_smollm2_fp8_accuracy_{suffix}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-pairs", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    names = sorted({c.name for c in CONFIGS + GPU_CONFIGS})
    parser.add_argument("--configs", nargs="+", default=names, choices=names,
                        help=f"which to run ({REFERENCE} always runs on the CPU, {GPU_REFERENCE} on the GPU)")
    parser.add_argument("--no-record", action="store_true", help="print only; write no JSON record")
    stages = parser.add_mutually_exclusive_group()
    stages.add_argument("--export-requests", type=Path, metavar="FILE",
                        help="stage 1 (here, with lm-eval): record the tasks' and pairs' requests to FILE")
    stages.add_argument("--score-requests", type=Path, metavar="FILE",
                        help="stage 2 (the GPU machine, no lm-eval): answer FILE's requests per config into --answers")
    stages.add_argument("--report-requests", type=Path, metavar="FILE",
                        help="stage 3 (here, with lm-eval): score --answers for FILE's requests and report")
    parser.add_argument("--answers", type=Path, metavar="FILE", help="the answers stage 2 writes and stage 3 reads")
    parser.add_argument("--device", default="cuda", help="stage 2's engine device (default cuda)")
    args = parser.parse_args()
    if (args.score_requests or args.report_requests) and args.answers is None:
        parser.error("--score-requests and --report-requests need --answers FILE")

    if args.score_requests:  # before any import of lm-eval or the default model's download
        model_dir = args.model or str(_default_model())
        requests = json.loads(args.score_requests.read_text())
        configs = _chosen(GPU_CONFIGS if args.device != "cpu" else CONFIGS, args.configs, args.device)
        answers = score_requests(requests, configs, model_dir, args.device)
        args.answers.write_text(json.dumps({"device": _device_name(args.device), "git_commit": git_commit(),
                                            "configs": [asdict(c) for c in configs], "answers": answers}) + "\n")
        print(f"answers: {args.answers}")
        return
    model_dir = args.model or str(_default_model())
    if args.export_requests:
        record = export_requests(model_dir, args.export_requests, args.num_pairs, args.seed)
        print(f"requests: {args.export_requests} ({sum(map(len, record['scored']))} scored, "
              f"{sum(len(b['prompts']) for b in record['generated'])} generated)")
        return
    if args.report_requests:
        answered = json.loads(args.answers.read_text())
        configs = [Config(**c) for c in answered["configs"]]
        results = report_requests(model_dir, json.loads(args.report_requests.read_text()), answered["answers"],
                                  configs)
        machine = answered["device"]
    else:
        chosen = _chosen(CONFIGS, args.configs, "cpu")
        texts = corpus_texts()
        results, requests = [], None
        with tempfile.TemporaryDirectory() as tmp:
            manager = task_manager(Path(tmp))
            for config in chosen:
                result, built = run_config(config, model_dir, manager, texts, args.num_pairs, args.seed)
                if requests is not None and built != requests:
                    raise RuntimeError(f"{config.name} tokenized the pairs differently from {REFERENCE}")
                requests = built
                results.append(result)
                print(f"{config.label}: {result.seconds:.1f} s", flush=True)
        machine = "CPU"
    reference = results[0]
    diffs = {r.config.name: comparison(reference, r) for r in results[1:]}
    num_mc = len(reference.mc_loglikelihoods)
    print(f"\nmodel {model_dir}; {machine}; reference {reference.config.label}; {num_mc} mc requests + "
          f"{args.num_pairs} pairs (seed {args.seed}); differences against the reference in parentheses "
          f"(points for mc/gen)\n")
    print(table(results, diffs))
    for name, diff in diffs.items():
        line = verdict(name, diff)
        if line:
            print(line)
    if not args.no_record:
        print(f"record: {write_record(results, diffs, args, num_mc, machine)}")


def _default_model() -> Path:
    from offline_paged.models.default_model import ensure_default_model

    return ensure_default_model()


def _chosen(configs: list[Config], names: list[str], device: str) -> list[Config]:
    """The configs named (the reference first, always); names of the other device's list are skipped."""
    reference = GPU_REFERENCE if device != "cpu" else REFERENCE
    return [c for c in configs if c.name == reference or c.name in names]


def _device_name(device: str) -> str:
    if device == "cpu":
        return "CPU"
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()


if __name__ == "__main__":
    main()
