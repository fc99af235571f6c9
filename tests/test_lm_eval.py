"""lm-eval side by side: the local tasks in data/lm_eval (multiple choice, rolling log-likelihood,
generate_until) through our backend and through lm-eval's own `hf` backend on the same HF directory.

Per-item log-likelihoods agree within 1e-3, is_greedy flags, accuracies and greedy generations are
identical. The default run uses a tiny random Llama saved as an HF directory; the real SmolLM2 run is
marked slow. Both sides get the same max_length (128), so the rolling windows are the same and the
long text spans several of them.
"""
from __future__ import annotations

from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
from fixtures_tiny_model import write_tiny_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import offline_paged.entrypoints.lm_eval  # noqa: E402,F401  (registers "offline-paged")

TASKS = ["offline_paged_mc", "offline_paged_rolling", "offline_paged_gen"]
DATA = Path(__file__).resolve().parent.parent / "data" / "lm_eval"
MAX_LENGTH = 128


def task_manager(tmp_path: Path) -> TaskManager:
    """The task YAMLs with their data files made absolute (lm-eval resolves them against the cwd)."""
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    for yaml in DATA.glob("*.yaml"):
        (tasks_dir / yaml.name).write_text(yaml.read_text().replace("data/lm_eval/", f"{DATA}/"))
    return TaskManager(include_path=str(tasks_dir))


def evaluate(model: str, model_args: str, manager: TaskManager) -> dict:
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, task_manager=manager,
                                   log_samples=True, batch_size=1)


def responses(result: dict, task: str) -> list:
    return [sample["resps"] for sample in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


def assert_side_by_side(ours: dict, theirs: dict) -> None:
    for task in ("offline_paged_mc", "offline_paged_rolling"):
        for mine, hf in zip(responses(ours, task), responses(theirs, task), strict=True):
            for [a], [b] in zip(mine, hf, strict=True):  # one response per request of the doc
                if task == "offline_paged_rolling":
                    assert a == pytest.approx(b, abs=1e-3), task
                else:  # (loglikelihood, is_greedy)
                    assert a[0] == pytest.approx(b[0], abs=1e-3) and a[1] == b[1], task
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["offline_paged_mc"][metric] == theirs["results"]["offline_paged_mc"][metric]
    assert responses(ours, "offline_paged_gen") == responses(theirs, "offline_paged_gen")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-lm-eval"), seed=3)


def test_tiny_model_side_by_side_with_the_hf_backend(tiny_dir, tmp_path):
    manager = task_manager(tmp_path)
    ours = evaluate("offline-paged", f"pretrained={tiny_dir},dtype=float32,device=cpu,"
                    f"max_model_len={MAX_LENGTH + 1}", manager)
    theirs = evaluate("hf", f"pretrained={tiny_dir},dtype=float32,device=cpu,max_length={MAX_LENGTH}", manager)
    assert_side_by_side(ours, theirs)
    generations = [r[0][0] for r in responses(ours, "offline_paged_gen")]
    assert any(generations), "the generate_until task must produce some text to compare"


def test_scores_do_not_depend_on_prefix_caching(tiny_dir):
    """The choices of an item share its context: with prefix caching it is read from the cache
    (prompt_logprobs_start keeps it unscored), and the scores are those of a cold computation."""
    from lm_eval.api.instance import Instance

    def run(caching: bool):
        lm = offline_paged.entrypoints.lm_eval.OfflinePagedLM(pretrained=str(tiny_dir), device="cpu", dtype="float64",
                                                  enable_prefix_caching=caching)
        context = "A context long enough to fill several sixteen-token KV blocks before the choice:"
        requests = [Instance("loglikelihood", {}, (context, f" choice {c}"), i) for i, c in enumerate("abcd")]
        return lm.loglikelihood(requests, disable_tqdm=True), lm.llm.stats

    cached, cached_stats = run(True)
    cold, cold_stats = run(False)
    assert cached_stats.num_cached_prompt_tokens >= 3 * 64  # choices 2..4 reuse >= 4 full blocks each
    assert cold_stats.num_cached_prompt_tokens == 0
    for (a, greedy_a), (b, greedy_b) in zip(cached, cold, strict=True):
        assert a == pytest.approx(b, abs=1e-9) and greedy_a == greedy_b


@pytest.mark.slow
def test_smollm2_side_by_side_with_the_hf_backend(tmp_path):
    """float64 on both sides: in float32 each side is ~1e-4 per logit from the truth (test_default_model),
    and the rolling task sums a few hundred tokens, which adds up to ~1e-3 (measured: 1.06e-3)."""
    from offline_paged.models.default_model import ensure_default_model

    model_dir = ensure_default_model()
    manager = task_manager(tmp_path)
    ours = evaluate("offline-paged", f"pretrained={model_dir},dtype=float64,device=cpu,"
                    f"max_model_len={MAX_LENGTH + 1}", manager)
    theirs = evaluate("hf", f"pretrained={model_dir},dtype=float64,device=cpu,max_length={MAX_LENGTH}", manager)
    assert_side_by_side(ours, theirs)


def test_eval_command_runs_a_local_task_on_our_backend(tiny_dir, tmp_path):
    import subprocess
    import sys

    task_manager(tmp_path)  # writes the task YAMLs with absolute data paths
    command = [str(Path(sys.executable).parent / "offline-paged"), "eval", "--tasks", "offline_paged_mc",
               "--include_path", str(tmp_path / "tasks"), "--model_args", f"pretrained={tiny_dir}",
               "dtype=float32", "--device", "cpu", "--limit", "4", "--num-kv-blocks", "40", "--block-size", "8"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "offline-paged (" in result.stdout and "|offline_paged_mc|" in result.stdout
    assert "'num_kv_blocks': 40" in result.stdout or "num_kv_blocks=40" in result.stdout  # our engine options


def test_simple_evaluate_takes_an_instance_a_hub_id_and_trust_remote_code(tiny_dir, tmp_path, monkeypatch):
    """What the README shows: an OfflinePagedLM instance (pretrained= a hub id in the HF cache, lm-eval's
    trust_remote_code=True, lm-eval's default device=cuda on a CPU-only machine) scores like a path."""
    from fixtures_hf_cache import add_to_hf_cache

    from offline_paged.entrypoints.lm_eval import OfflinePagedLM

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    add_to_hf_cache(tmp_path / "hub", "TinyOrg/tiny-eval", tiny_dir)
    model = OfflinePagedLM(pretrained="TinyOrg/tiny-eval", dtype="float32", device="cuda:0",
                           trust_remote_code=True, max_model_len=MAX_LENGTH + 1)
    manager = task_manager(tmp_path)
    result = lm_eval.simple_evaluate(model=model, tasks=["offline_paged_mc"], task_manager=manager, log_samples=True)
    by_path = evaluate("offline-paged", f"pretrained={tiny_dir},dtype=float32,device=cpu,"
                       f"max_model_len={MAX_LENGTH + 1}", manager)
    assert responses(result, "offline_paged_mc") == responses(by_path, "offline_paged_mc")
