"""lm-eval scoring speed on the CPU: a multiple-choice task (default 500 items x 4 choices) through the
offline-paged backend and lm-eval's own hf backend on the same model directory, in one run.

Prints, for each backend: evaluate() wall time (model loading excluded), items/s, loglikelihood
requests/s and accuracy; for ours also the prefix-cache hit rate; then the largest per-request
log-likelihood difference between the two. Items share an instruction line (as MMLU-style prompts
do) and each item's choices share its question, which is what the prefix cache turns into saved work.

    .venv/bin/python benchmarks/bench_lm_eval.py [--items 500] [--model DIR] [--hf-batch-size 16]
        [--skip-hf] [--no-cache-too]
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

TASK = "bench_mc_arithmetic"
YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "The following are multiple choice questions about arithmetic. Pick the correct sum.\\n\\nQuestion: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(directory: Path, num_items: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(directory / "items.jsonl", "w") as f:
        for _ in range(num_items):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            wrong = rng.sample([a + b + d for d in (-11, -10, -2, -1, 1, 2, 9, 10, 11)], 3)
            choices = [str(a + b)] + [str(w) for w in wrong]
            rng.shuffle(choices)
            f.write(json.dumps({"question": f"What is {a} + {b}?", "choices": choices,
                                "answer": choices.index(str(a + b))}) + "\n")
    (directory / "task.yaml").write_text(YAML.format(task=TASK, data=directory / "items.jsonl"))


def run(lm, manager) -> tuple[float, dict]:
    import lm_eval

    start = time.perf_counter()
    result = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=manager, log_samples=True)
    return time.perf_counter() - start, result


def lls(result) -> list[float]:
    samples = sorted(result["samples"][TASK], key=lambda s: s["doc_id"])
    return [resp[0][0] for s in samples for resp in s["resps"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=500)
    parser.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--no-cache-too", action="store_true",
                        help="also run ours with enable_prefix_caching=False (what the cache saves)")
    args = parser.parse_args()

    from lm_eval.tasks import TaskManager

    from offline_paged.entrypoints.lm_eval import OfflinePagedLM
    from offline_paged.models.default_model import ensure_default_model

    model_dir = args.model or str(ensure_default_model())
    with tempfile.TemporaryDirectory() as tmp:
        write_task(Path(tmp), args.items)
        manager = TaskManager(include_path=tmp)
        ours = OfflinePagedLM(pretrained=model_dir, dtype="float32", device="cpu")
        seconds, result = run(ours, manager)
        stats = ours.llm.stats
        rows = [("offline-paged", seconds, result, f"prefix-cache hit rate {stats.prefix_cache_hit_rate:.1%} "
                 f"({stats.num_cached_prompt_tokens}/{stats.num_prompt_tokens} prompt tokens)")]
        if args.no_cache_too:
            cold = OfflinePagedLM(pretrained=model_dir, dtype="float32", device="cpu", enable_prefix_caching=False)
            seconds, cold_result = run(cold, manager)
            rows.append(("ours, no cache", seconds, cold_result, ""))
        if not args.skip_hf:
            from lm_eval.models.huggingface import HFLM

            hf = HFLM(pretrained=model_dir, dtype="float32", device="cpu", batch_size=args.hf_batch_size)
            seconds, hf_result = run(hf, manager)
            rows.append((f"hf (batch {args.hf_batch_size})", seconds, hf_result, ""))
    num_requests = len(lls(rows[0][2]))
    print(f"{args.items} items, {num_requests} loglikelihood requests, model {model_dir}")
    for name, seconds, res, note in rows:
        acc = res["results"][TASK]["acc,none"]
        print(f"{name:>16}: {seconds:7.1f} s  {args.items / seconds:6.2f} items/s  "
              f"{num_requests / seconds:7.2f} requests/s  acc {acc:.3f}  {note}")
    for name, seconds, res, _ in rows[1:]:
        diff = max(abs(a - b) for a, b in zip(lls(rows[0][2]), lls(res), strict=True))
        print(f"vs {name}: speed-up {seconds / rows[0][1]:.2f}x; largest per-request "
              f"|loglikelihood difference| {diff:.2e}")


if __name__ == "__main__":
    main()
