"""benchmarks/fp8_accuracy.py computes what it reports: the per-item |loglikelihood difference| is 0
between two engines of one config and > 0 for an FP8 KV cache, its mean is the plain mean, and the
fixed loglikelihood requests are seeded, distinct slices of the texts. On a tiny random model (the real
SmolLM2 run is the script itself)."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
from fixtures_scripts import load_script  # noqa: E402
from fixtures_tiny_model import write_tiny_model  # noqa: E402

fp8_accuracy = load_script("benchmarks/fp8_accuracy.py")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-fp8-accuracy"), seed=5)


def lm(tiny_dir: Path, **engine_args):
    from offline_paged.entrypoints.lm_eval import OfflinePagedLM

    return OfflinePagedLM(pretrained=str(tiny_dir), device="cpu", dtype="float32", **engine_args)


def requests(model, num_pairs: int = 40, seed: int = 0) -> list:
    texts = fp8_accuracy.corpus_texts()
    return fp8_accuracy.pair_requests([model.tok_encode(t) for t in texts], num_pairs, seed)


def test_mean_abs_difference_is_the_mean_of_per_item_absolute_differences():
    assert fp8_accuracy.mean_abs_difference([1.0, 2.0, -3.0], [1.5, 1.0, -3.0]) == pytest.approx(0.5)
    assert fp8_accuracy.max_abs_difference([1.0, 2.0, -3.0], [1.5, 1.0, -3.0]) == pytest.approx(1.0)
    assert fp8_accuracy.mean_abs_difference([-2.5, -0.25], [-2.5, -0.25]) == 0.0
    assert fp8_accuracy.mean_difference([1.0, 2.0, -3.0], [1.5, 1.0, -3.0]) == pytest.approx(-0.5 / 3)


@pytest.mark.parametrize("reference, other", [([1.0], [1.0, 2.0]), ([], [])])
def test_mean_abs_difference_refuses_unmatched_or_empty_lists(reference, other):
    with pytest.raises(ValueError, match="equally long"):
        fp8_accuracy.mean_abs_difference(reference, other)


def test_pairs_are_seeded_distinct_slices_of_the_texts():
    token_lists = [list(range(100, 130)), list(range(200, 212))]
    pairs = fp8_accuracy.pair_requests(token_lists, 50, seed=7)
    assert pairs == fp8_accuracy.pair_requests(token_lists, 50, seed=7)
    assert pairs != fp8_accuracy.pair_requests(token_lists, 50, seed=8)
    assert len({(tuple(c), tuple(x)) for _, c, x in pairs}) == 50
    for key, context, continuation in pairs:
        assert key is None and context and 1 <= len(continuation) <= 8
        joined = context + continuation
        assert any(ids[:len(joined)] == joined for ids in token_lists)  # a prefix cut where it was


def test_pairs_refuse_more_than_the_texts_hold():
    with pytest.raises(ValueError, match="only 3 distinct"):
        fp8_accuracy.pair_requests([[1, 2, 3]], 4, seed=0)  # (k, m): (1, 1), (1, 2), (2, 1)


def test_corpus_holds_the_prompts_and_the_rolling_texts():
    texts = fp8_accuracy.corpus_texts()
    assert "Once upon a time, in a small village by the sea," in texts
    assert any(t.startswith("PagedAttention stores the key-value cache") for t in texts)
    assert all(isinstance(t, str) and t for t in texts)


def test_identical_configs_differ_by_zero_and_an_fp8_kv_cache_by_more(tiny_dir):
    reference = lm(tiny_dir)
    pairs = requests(reference)
    assert pairs == requests(lm(tiny_dir, kv_cache_dtype="fp8"))  # one tokenizer, the same requests
    base = fp8_accuracy.loglikelihoods(reference, pairs)
    again = fp8_accuracy.loglikelihoods(lm(tiny_dir), pairs)
    fp8 = fp8_accuracy.loglikelihoods(lm(tiny_dir, kv_cache_dtype="fp8"), pairs)
    assert len(base) == len(pairs) and all(value < 0 for value in base)
    assert fp8_accuracy.mean_abs_difference(base, again) == 0.0
    assert fp8_accuracy.mean_abs_difference(base, fp8) > 0.0


def test_the_report_compares_each_config_with_the_reference():
    Config, Result = fp8_accuracy.Config, fp8_accuracy.ConfigResult
    scores = {"mc acc": 50.0, "mc acc_norm": 50.0, "gen EM": 0.0, "rolling bpb": 2.0}
    reference = Result(Config("fp32", "float32"), scores, [-1.0, -2.0], [-3.0], ["a", "b"], 1.0)
    other = Result(Config("fp8_kv", "FP8 KV"), scores | {"mc acc": 52.0}, [-1.5, -2.0], [-2.0], ["a", "c"], 1.0)
    diff = fp8_accuracy.comparison(reference, other)
    assert diff["score_diff"]["mc acc"] == pytest.approx(2.0) and diff["score_diff"]["gen EM"] == 0.0
    assert diff["mean_abs_dll_mc"] == pytest.approx(0.25) and diff["mean_abs_dll_pairs"] == pytest.approx(1.0)
    assert diff["mean_abs_dll_all"] == pytest.approx(0.5) and diff["max_abs_dll_all"] == pytest.approx(1.0)
    assert diff["mean_dll_all"] == pytest.approx(0.5 / 3) and diff["same_generations"] == 1
    verdict = fp8_accuracy.verdict("fp8_kv", diff)
    assert "1 point NOT met (largest 2.0)" in verdict and "0.500 <= 0.05 NOT met" in verdict
    assert "signed mean dLL +0.167" in verdict
    assert fp8_accuracy.verdict("bf16", diff) is None
    text = fp8_accuracy.table([reference, other], {"fp8_kv": diff})
    assert "| FP8 KV | 52.0 (+2.0) |" in text and "| +0.167 | 1/2 |" in text


def test_the_staged_run_reports_what_the_direct_run_does(tiny_dir, tmp_path):
    """lm-eval here and the engine elsewhere (export -> score -> report, through JSON files as the GPU run
    carries them) gives the direct run's task scores, per-item loglikelihoods and generations, bit for bit; a
    replay whose requests differ from the recorded ones is refused."""
    model = str(tiny_dir)
    configs = [c for c in fp8_accuracy.CONFIGS if c.name in ("fp32", "fp8_kv")]
    fp8_accuracy.export_requests(model, tmp_path / "requests.json", 20, 0)
    requests_file = json.loads((tmp_path / "requests.json").read_text())
    assert requests_file["scored"] and requests_file["generated"] and "logprob" not in json.dumps(requests_file)
    answers = fp8_accuracy.score_requests(requests_file, configs, model, "cpu")
    answers = json.loads(json.dumps(answers))  # as the answers file carries them
    staged = fp8_accuracy.report_requests(model, requests_file, answers, configs)
    with tempfile.TemporaryDirectory() as tmp:
        manager = fp8_accuracy.task_manager(Path(tmp))
        direct = fp8_accuracy.run_config(configs[1], model, manager, fp8_accuracy.corpus_texts(), 20, 0)[0]
    got = staged[1]  # the FP8 config's (a direct fp32 run as well would add time and no other check)
    assert got.config == direct.config and got.scores == direct.scores
    assert got.mc_loglikelihoods == direct.mc_loglikelihoods and got.pair_loglikelihoods == direct.pair_loglikelihoods
    assert got.generations == direct.generations
    assert staged[0].pair_loglikelihoods != staged[1].pair_loglikelihoods  # the FP8 cache's answers, not fp32's

    requests_file["scored"][0][0][0][-1] += 1  # one token of the first scored request
    with pytest.raises(RuntimeError, match="scored call 0 differs from the recorded requests"):
        fp8_accuracy.report_requests(model, requests_file, answers, configs[:1])


def test_the_granularity_script_rounds_through_e4m3_at_each_scale():
    """benchmarks/fp8_kv_granularity.py: each granularity's rounding is e4m3's (within half a step of 3
    mantissa bits of the scaled value), its largest scaled magnitude lands on 448, and scale 1.0 clips."""
    module = load_script("benchmarks/fp8_kv_granularity.py")
    import numpy as np

    x = np.random.default_rng(0).normal(0, 3, (5, 4, 64)).astype(np.float32)  # [T, H, D]
    x[0, 0, 0] = 1000.0  # beyond e4m3's range at scale 1.0
    one = module.round_e4m3(x, "one")
    assert one[0, 0, 0] == 448.0 and one.dtype == np.float32
    for granularity, axes in (("token", (-2, -1)), ("token_head", (-1,))):
        scale = np.abs(x).max(axis=axes, keepdims=True) / 448.0
        got = module.round_e4m3(x, granularity)
        normal = np.abs(x / scale) >= 2.0 ** -6  # e4m3's normal range: relative rounding
        assert np.all(np.abs(got - x)[normal] <= 2.0 ** -4 * np.abs(x)[normal] + 1e-6)
        relative = np.abs(got - x)[normal] / np.abs(x)[normal]
        assert relative.max() > 2.0 ** -6  # 3 mantissa bits, not a finer format's
        assert np.allclose(np.abs(got).max(axis=axes), np.abs(x).max(axis=axes))
