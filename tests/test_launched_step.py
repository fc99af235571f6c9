"""worker.launched_step: wait() regroups the step's samples per scheduled sequence, once."""
from __future__ import annotations

from types import SimpleNamespace

from offline_paged.worker.launched_step import LaunchedStep, ReadySamples


class CountingSamples(ReadySamples):
    __slots__ = ("calls",)

    def __init__(self, results):
        super().__init__(results)
        self.calls = 0

    def results(self):
        self.calls += 1
        return super().results()


def _sample(token_id):
    return SimpleNamespace(token_id=token_id, logprob=-0.5)


def test_ready_samples_expose_token_ids_as_int32():
    samples = ReadySamples([_sample(7), _sample(3), _sample(11)])
    assert samples.token_ids.dtype.name == "int32" and samples.token_ids.tolist() == [7, 3, 11]


def test_wait_groups_samples_by_owner_in_order_and_keeps_prompt_logprobs():
    # Three scheduled sequences: the first samples twice (n=2 at its first step), the second none
    # (a prefill chunk), the third once.
    samples = CountingSamples([_sample(1), _sample(2), _sample(3)])
    prompt_logprobs = [None, [{5: -1.0}], None]
    step = LaunchedStep(output=SimpleNamespace(scheduled=["a", "b", "c"]), samples=samples,
                        sample_index={}, owners=[0, 2, 0], prompt_logprobs=prompt_logprobs,
                        forward_timer=None, used_cuda_graph=True)
    done = step.wait()
    assert [[s.token_id for s in r.samples] for r in done.results] == [[1, 3], [], [2]]
    assert [r.prompt_logprobs for r in done.results] == prompt_logprobs
    assert done.used_cuda_graph is True and done.forward_timer is None and done.num_samples == 3
    assert step.wait() is done and samples.calls == 1  # the device is waited for once


def test_wait_without_owners_gives_each_sequence_its_own_sample():
    """owners=None (the decode graph's samples): sample i is sequence i's only one."""
    samples = ReadySamples([_sample(4), _sample(8)])
    step = LaunchedStep(output=SimpleNamespace(scheduled=["a", "b"]), samples=samples, sample_index={},
                        owners=None, prompt_logprobs=[None, None], forward_timer=None, used_cuda_graph=True)
    done = step.wait()
    assert len(done.results) == 2 and done.num_samples == 2
    assert [[s.token_id for s in r.samples] for r in done.results] == [[4], [8]]
    assert [r.prompt_logprobs for r in done.results] == [None, None]
    assert done.results[1].samples[0].token_id == 8 and done.results[-1].samples[0].token_id == 8
    assert [r.samples[0].token_id for r in done.results[::-1]] == [8, 4]
