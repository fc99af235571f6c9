"""DataParallelCoordinator with real spawned worker processes on the CPU (tiny random model, fp64 so
outputs can be compared exactly with one in-process engine)."""
import os
import signal

import pytest

from fixtures_tiny_model import write_tiny_model
from offline_paged.core.config import EngineConfig
from offline_paged.core.engine_stats import combine_stats
from offline_paged.core.outputs import EngineStats, RequestError
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.dp.dp_coordinator import DataParallelCoordinator, worker_devices
from offline_paged.dp.dp_worker import WorkerSpec
from offline_paged.engine import LLMEngine


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> EngineConfig:
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float64", block_size=4,
                        num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=32)


def _requests(num: int) -> list[tuple[str, str, SamplingParams]]:
    """Greedy and seeded sampled requests (both must not depend on which engine runs them)."""
    return [(f"r{i}", f"prompt number {i}",
             SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0 if i % 2 else 1.0, seed=i))
            for i in range(num)]


def _single_engine_tokens(config, requests) -> dict[str, list[list[int]]]:
    engine = LLMEngine(config)
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt=prompt, params=params)
    tokens = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] = [c.token_ids for c in output.outputs]
    return tokens


def _run(coordinator, requests, on_step=lambda results: None) -> list:
    for request_id, prompt, params in requests:
        coordinator.add_request(request_id, prompt=prompt, params=params)
    results = []
    while coordinator.has_unfinished_requests():
        step = coordinator.step()
        results += step
        on_step(step)
    return results


@pytest.mark.parametrize("size", [0, -1, True, "2", 1.5])
def test_data_parallel_size_must_be_a_positive_integer(size):
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        worker_devices("cpu", size)


def test_more_workers_than_visible_gpus_is_refused(monkeypatch):
    monkeypatch.setattr("offline_paged.dp.dp_coordinator._visible_gpus", lambda: ["3", "5"])
    assert worker_devices("cuda", 2) == ("cuda", ["3", "5"])
    with pytest.raises(ValueError, match="data_parallel_size=3 is larger than the 2 visible GPU"):
        worker_devices("cuda", 3)


def test_cpu_workers_get_no_gpu():
    assert worker_devices("cpu", 3) == ("cpu", [None, None, None])


def test_combined_stats_add_counts_and_average_occupancy():
    def stats(requests, usage, blocks):
        return EngineStats(requests, 10 * requests, 5, 4, 0.5, 1, 0, usage, usage, usage, usage, usage,
                           blocks, 0, 16, 7)

    combined = combine_stats([stats(3, 0.2, 100), stats(5, 0.6, 50)])
    assert combined.num_requests_finished == 8
    assert combined.num_prompt_tokens == 80
    assert combined.num_gpu_blocks == 150
    assert combined.kv_block_usage_current == pytest.approx(0.4)
    assert combined.kv_block_usage_peak == 0.6
    assert combined.prefix_cache_hit_rate == pytest.approx(0.5)


def test_killed_worker_requests_are_redealt_once_and_outputs_equal_one_engine(config):
    requests = _requests(16)
    want = _single_engine_tokens(config, requests)
    log = []
    killed = {}
    with DataParallelCoordinator(WorkerSpec(config), 2, max_outstanding=3, log=log.append) as dp:
        def kill_worker_0(results):
            if results and not killed:
                killed["outstanding"] = dp.num_outstanding(0)
                os.kill(dp.worker_pids[0], signal.SIGKILL)
        results = _run(dp, requests, kill_worker_0)
        assert dp.num_workers_lost == 1
    assert killed["outstanding"] > 0, "worker 0 held nothing when killed: the test proves nothing"
    ids = [r.request_id for r in results]
    assert sorted(ids) == sorted(want), "a request was lost or returned twice"
    assert not [r for r in results if isinstance(r, RequestError)]
    assert {r.request_id: [c.token_ids for c in r.outputs] for r in results} == want
    assert any("worker 0" in line and "died" in line and "re-dealing" in line for line in log)


def test_request_on_too_many_dead_workers_comes_back_unfinished_not_retried(config):
    """Not a request failure: the RequestError is marked unfinished, so a job writes nothing for it
    and a rerun runs it again (it used to become an error record that resume counted as done)."""
    requests = _requests(8)
    with DataParallelCoordinator(WorkerSpec(config), 2, max_outstanding=2, max_attempts=1,
                                 log=lambda line: None) as dp:
        for request_id, prompt, params in requests:
            dp.add_request(request_id, prompt=prompt, params=params)
        dp._deal()  # deal now, so worker 0 surely dies holding requests it has not answered
        killed = set(dp._workers[0].outstanding)
        os.kill(dp.worker_pids[0], signal.SIGKILL)
        results = []
        while dp.has_unfinished_requests():
            results += dp.step()
    errors = {r.request_id for r in results if isinstance(r, RequestError)}
    assert len(killed) == 2 and errors == killed
    assert all(r.unfinished for r in results if isinstance(r, RequestError))
    assert sorted(r.request_id for r in results) == sorted(r[0] for r in requests)


def test_dealing_is_dynamic_the_worker_with_short_requests_gets_more(config):
    # r0 and r2 are long, the rest short: the first deal alternates, so worker 0 holds both long
    # ones; an even split (round robin or halves) would give both workers 20 requests
    requests = [(f"r{i}", f"p{i}", SamplingParams(max_tokens=200 if i in (0, 2) else 1, ignore_eos=True))
                for i in range(40)]
    with DataParallelCoordinator(WorkerSpec(config), 2, max_outstanding=2, log=lambda line: None) as dp:
        holding = []
        results = _run(dp, requests, lambda _: holding.append(
            max(dp.num_outstanding(0), dp.num_outstanding(1))))
        dealt = [w.num_dealt for w in dp._workers]
    assert len(results) == 40
    assert max(holding) <= 2, "a worker was given more than max_outstanding"
    assert dealt[1] >= 2 * dealt[0], f"dealt {dealt}: the worker with short requests did not get more"


def test_a_request_a_worker_refuses_comes_back_as_an_error(config):
    requests = [("ok", "fine", SamplingParams(max_tokens=2)),
                ("bad", None, SamplingParams(max_tokens=2))]
    with DataParallelCoordinator(WorkerSpec(config), 1, log=lambda line: None) as dp:
        dp.add_request("ok", prompt="fine", params=requests[0][2])
        dp.add_request("bad", prompt_token_ids=[10 ** 6], params=requests[1][2])
        results = []
        while dp.has_unfinished_requests():
            results += dp.step()
    by_id = {r.request_id: r for r in results}
    assert isinstance(by_id["bad"], RequestError) and "prompt_token_ids" in by_id["bad"].message
    assert not isinstance(by_id["ok"], RequestError)


def test_llm_with_data_parallel_size_2_equals_one_engine(config):
    from offline_paged.entrypoints.llm import LLM

    kwargs = dict(device="cpu", dtype="float64", block_size=4, num_kv_blocks=64, max_num_seqs=2)
    # greedy, seeded and unseeded sampled; two identical unseeded prompts must still differ, as in
    # one engine (the coordinator draws their seeds, not each worker from its own arrival count)
    prompts = [f"prompt {i}" for i in range(6)] + ["same"] * 2
    params = [SamplingParams(max_tokens=8, temperature=0.0 if i % 2 else 1.0, seed=i) for i in range(6)] \
        + [SamplingParams(max_tokens=8, temperature=1.0)] * 2
    want = LLM(config.model, **kwargs).generate(prompts, params)
    with LLM(config.model, data_parallel_size=2, **kwargs) as llm:
        got = llm.generate(prompts, params)
        assert [o.request_id for o in got] == [o.request_id for o in want]  # input order kept
        assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
        assert got[-1].outputs[0].token_ids != got[-2].outputs[0].token_ids
        with pytest.raises(ValueError, match="prompt 1: prompt_token_ids must be integers"):
            llm.generate([[1, 2], [10 ** 6]], SamplingParams(max_tokens=2))


def test_llm_data_parallel_refuses_an_already_loaded_model(config):
    from offline_paged.entrypoints.llm import LLM

    with pytest.raises(ValueError, match="loaded_model cannot be combined with data_parallel_size"):
        LLM(device="cpu", loaded_model=object(), data_parallel_size=2)


def test_when_every_worker_is_dead_step_raises_workers_lost(config):
    from offline_paged.dp.dp_coordinator import WorkersLostError

    with DataParallelCoordinator(WorkerSpec(config), 1, max_attempts=3, log=lambda line: None) as dp:
        for request_id, prompt, params in _requests(3):
            dp.add_request(request_id, prompt=prompt, params=params)
        dp._deal()
        os.kill(dp.worker_pids[0], signal.SIGKILL)
        with pytest.raises(WorkersLostError, match="all 1 data-parallel workers died with 3 request"):
            while dp.has_unfinished_requests():
                dp.step()


def test_a_stopped_worker_is_killed_after_the_stall_timeout_and_its_requests_redealt(config):
    requests = _requests(8)
    log = []
    with DataParallelCoordinator(WorkerSpec(config), 2, max_outstanding=2, stall_timeout_s=1.0,
                                 log=log.append) as dp:
        for request_id, prompt, params in requests:
            dp.add_request(request_id, prompt=prompt, params=params)
        dp._deal()
        held = set(dp._workers[0].outstanding)
        os.kill(dp.worker_pids[0], signal.SIGSTOP)  # alive, silent for good: it used to hang the job
        results = []
        while dp.has_unfinished_requests():
            results += dp.step()
        assert dp.num_workers_lost == 1
    assert held, "worker 0 held nothing when stopped: the test proves nothing"
    assert sorted(r.request_id for r in results) == sorted(r[0] for r in requests)
    assert not [r for r in results if isinstance(r, RequestError)]
    assert any("worker 0" in line and "sent nothing for 1 s" in line for line in log)


def test_add_request_refuses_an_over_long_prompt_before_anything_is_dealt(config):
    """LLM.generate with DP used to raise only after every good prompt ran."""
    from offline_paged.entrypoints.llm import LLM

    with DataParallelCoordinator(WorkerSpec(config), 1, log=lambda line: None) as dp:
        dp.add_request("ok", prompt="fine", params=SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="leaves no room to generate"):
            dp.add_request("long", prompt_token_ids=[5] * dp.max_model_len, params=SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="leaves no room to generate"):
            dp.add_request("long text", prompt="word " * (4 * dp.max_model_len), params=SamplingParams(max_tokens=2))
        assert dp.num_outstanding(0) == 0 and len(dp._backlog) == 1  # nothing dealt, "ok" still queued
    kwargs = dict(device="cpu", dtype="float64", block_size=4, num_kv_blocks=64, max_num_seqs=2)
    with LLM(config.model, data_parallel_size=2, **kwargs) as llm:
        with pytest.raises(ValueError, match="prompt 1: the prompt has"):
            llm.generate(["fine", "word " * 1000], SamplingParams(max_tokens=2))
        assert [w.num_dealt for w in llm.engine._workers] == [0, 0]  # no good prompt ran first


@pytest.mark.slow
def test_real_smollm2_data_parallel_equals_one_engine():
    """The real default model (pulled once into the cache), fp64 so batch composition cannot move a
    near-tie: two workers give one engine's greedy and seeded completions."""
    from offline_paged.entrypoints.llm import LLM

    chats = [[{"role": "user", "content": c}] for c in
             ("What is 2+2?", "Name a colour.", "Write a haiku about the sea.", "def add(a, b):")]
    params = [SamplingParams(max_tokens=6, temperature=0.0 if i % 2 else 0.8, seed=i) for i in range(4)]
    kwargs = dict(device="cpu", dtype="float64", max_num_seqs=4, kv_cache_memory=64 << 20,
                  max_model_len=256)
    want = LLM(**kwargs).chat(chats, params)
    with LLM(data_parallel_size=2, **kwargs) as llm:
        got = llm.chat(chats, params)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]


def test_a_worker_holds_its_max_num_seqs_and_a_quarter_more_by_default():
    from offline_paged.core.config import EngineConfig
    from offline_paged.dp.dp_coordinator import default_max_outstanding

    assert default_max_outstanding(EngineConfig(max_num_seqs=8), "cpu") == 10
    assert default_max_outstanding(EngineConfig(max_num_seqs=2), "cuda") == 3
    assert default_max_outstanding(EngineConfig(), "cpu") == 320  # the CPU engine's 256
    assert default_max_outstanding(EngineConfig(), "cuda") == 1280  # a large GPU's 1024, whatever each worker picks
