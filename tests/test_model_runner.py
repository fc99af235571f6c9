"""ModelRunner: block copies and swaps move whole blocks, slot mapping skips cached prefixes, logits rows
and sampling follow the scheduled sequences."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
from tiny_engine import tiny_model

from offline_paged.core.sampling_params import SamplingParams
from offline_paged.core.scheduler import ScheduledSequence, SchedulerOutput
from offline_paged.core.sequence import Sequence, SequenceGroup
from offline_paged.models.llama import Llama
from offline_paged.worker.backend import select_backend
from offline_paged.worker.model_runner import ModelRunner


def make_runner(num_blocks: int = 16, num_cpu_blocks: int = 8) -> ModelRunner:
    model = tiny_model()
    backend = select_backend("cpu", "float64")
    llama = Llama(model.config, model.weights, backend.ops, backend.dtype)
    return ModelRunner(llama, backend, num_blocks, num_cpu_blocks, block_size=4)


def fill_blocks(runner: ModelRunner) -> None:
    kv = runner.kv_cache  # [L, 2, N, B, Hkv, D]
    kv[...] = np.arange(kv.shape[2])[None, None, :, None, None, None]


def test_copies_and_swaps_move_whole_blocks():
    runner = make_runner()
    fill_blocks(runner)
    runner.execute(SchedulerOutput([], blocks_to_copy=[(3, 5), (5, 6)]))
    assert (runner.kv_cache[:, :, 5] == 3).all() and (runner.kv_cache[:, :, 6] == 5).all()
    runner.execute(SchedulerOutput([], blocks_to_swap_out=[(7, 1), (2, 0)]))
    runner.kv_cache[:, :, [7, 2]] = -1
    runner.execute(SchedulerOutput([], blocks_to_swap_in=[(0, 9), (1, 10)]))
    assert (runner.kv_cache[:, :, 9] == 2).all() and (runner.kv_cache[:, :, 10] == 7).all()


_seq_ids = itertools.count()


def scheduled(prompt, start, num_new, table, num_samples=1, skip=0, prompt_logprobs=None, n=1, seq_id=None):
    params = SamplingParams(n=n, temperature=0.0, prompt_logprobs=prompt_logprobs)
    group = SequenceGroup("r", 0, None, list(prompt), params, list(range(n)),
                          prompt_logprobs=[None] if prompt_logprobs is not None else None)
    seq_id = next(_seq_ids) if seq_id is None else seq_id
    seq = Sequence(seq_id, group, 0, 0, list(prompt), len(prompt), num_skip_write=skip)
    return ScheduledSequence(seq, start, num_new, table, num_samples, prompt_logprobs, seq.num_output_tokens)


def prepare(runner, items):
    """The eager step inputs, through the runner's block-table rows as execute() does."""
    return runner._prepare(items, runner.table_rows.sync(items))


def test_slot_mapping_skips_cached_positions_and_only_needed_rows_get_logits():
    runner = make_runner()
    items = [scheduled(range(10, 20), 0, 10, [4, 9, 2], skip=8, prompt_logprobs=1),
             scheduled(range(30, 36), 2, 3, [6, 1], num_samples=0)]
    batch = prepare(runner, items)
    slots = batch.meta.slot_mapping.tolist()
    assert slots[:8] == [-1] * 8 and slots[8:10] == [2 * 4 + 0, 2 * 4 + 1]
    assert slots[10:] == [6 * 4 + 2, 6 * 4 + 3, 1 * 4 + 0]
    assert batch.logits_indices.tolist() == list(range(10))  # all prompt rows; none for the mid-prefill
    assert batch.meta.context_lens.tolist() == [10, 5]
    assert batch.meta.query_start_loc.tolist() == [0, 10, 13]


def test_fork_row_is_sampled_n_times_and_prompt_logprobs_cover_the_chunk():
    runner = make_runner()
    prompt = [10, 20, 30, 40, 50]
    results = runner.execute(SchedulerOutput([
        scheduled(prompt, 0, 5, [3, 8], num_samples=3, prompt_logprobs=0, n=3)]))
    assert len(results) == 1
    assert len(results[0].samples) == 3
    assert len({s.token_id for s in results[0].samples}) == 1  # greedy: same row, same token
    entries = results[0].prompt_logprobs
    assert [list(e) for e in entries] == [[20], [30], [40], [50]]


def test_step_arrays_are_int32_with_positions_and_bounds_of_a_mixed_batch():
    runner = make_runner()
    items = [scheduled(range(10, 20), 4, 6, [4, 9, 2]),  # a chunk on top of 4 cached tokens
             scheduled(range(30, 36), 5, 1, [6, 1])]  # a decode step
    batch = prepare(runner, items)
    assert batch.positions.tolist() == [4, 5, 6, 7, 8, 9, 5]
    assert batch.input_ids.tolist() == [14, 15, 16, 17, 18, 19, 35]
    assert batch.meta.block_tables.tolist() == [[4, 9, 2], [6, 1, 0]]
    assert (batch.meta.max_query_len, batch.meta.max_context_len) == (6, 10)  # CUDA plans splits from these
    for array in (batch.input_ids, batch.positions, batch.meta.slot_mapping, batch.meta.block_tables,
                  batch.meta.context_lens, batch.meta.query_start_loc, batch.logits_indices):
        assert array.dtype == np.int32
    assert batch.logits_indices.tolist() == [5, 6]


def test_swaps_go_through_the_backend_swapper_created_on_first_use():
    runner = make_runner()
    assert runner._swapper is None  # recompute-only runs never allocate the swap pool
    fill_blocks(runner)
    runner.swap_out([(3, 7), (5, 0)])
    assert (runner.swapper.cpu_cache[:, :, 7] == 3).all() and (runner.swapper.cpu_cache[:, :, 0] == 5).all()
    assert runner.swapper.cpu_cache.shape[2] == 8


def _prepare_by_token(items, block_size: int):
    """The step arrays written one token at a time: the definition _prepare's numpy must equal."""
    ids, positions, slots, rows, offsets = [], [], [], [], []
    for item in items:
        offsets.append(len(rows))
        for p in range(item.start, item.start + item.num_new_tokens):
            ids.append(item.seq.token_ids[p])
            positions.append(p)
            written = p >= item.num_skip_write
            slots.append(item.block_table[p // block_size] * block_size + p % block_size if written else -1)
            if item.prompt_logprobs is not None or (item.num_samples and p == item.start + item.num_new_tokens - 1):
                rows.append(len(ids) - 1)
    return ids, positions, slots, rows, offsets


def test_prepare_equals_the_per_token_definition_on_random_batches():
    rng = np.random.default_rng(7)
    runner = make_runner(num_blocks=64)
    for trial in range(40):
        items = []
        for _ in range(rng.integers(1, 7)):
            length = int(rng.integers(1, 30))
            start = int(rng.integers(0, length))
            num_new = int(rng.integers(1, length - start + 1))
            table = rng.permutation(64)[:-(-length // 4)].tolist()
            items.append(scheduled(rng.integers(4, 200, length).tolist(), start, num_new, table,
                                   num_samples=int(rng.integers(0, 2)), skip=int(rng.integers(0, start + 1)),
                                   prompt_logprobs=1 if trial % 3 == 0 and rng.random() < 0.5 else None))
        batch = prepare(runner, items)
        ids, positions, slots, rows, offsets = _prepare_by_token(items, block_size=4)
        assert batch.input_ids.tolist() == ids
        assert batch.positions.tolist() == positions
        assert batch.meta.slot_mapping.tolist() == slots
        assert batch.logits_indices.tolist() == rows
        assert list(batch.logits_offsets) == offsets


def test_token_window_reads_like_the_slice():
    from offline_paged.worker.model_runner import _TokenWindow

    ids = list(range(100, 110))
    window = _TokenWindow(ids, 3, 8)
    assert len(window) == 5 and list(window) == ids[3:8] and window[-1] == 107 and window[1:3] == [104, 105]
    assert np.asarray(window, dtype=np.int64).tolist() == ids[3:8]
    assert list(_TokenWindow(ids, 4, 4)) == []


class PaddedForward:
    """A stand-in for MixedGraphs on the CPU (the real one needs CUDA; tests/test_mixed_graphs.py runs it): its
    buckets are multiples of 8 tokens; `run` checks the padded inputs a bucket reads, then runs the model's eager
    forward on the step's real rows."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.calls = []  # (num_tokens, size) of every run

    def bucket_for(self, num_tokens: int) -> int:
        return -(-num_tokens // 8) * 8

    def run(self, batch, num_tokens: int, size: int):
        assert batch.input_ids.shape == batch.positions.shape == batch.meta.slot_mapping.shape == (size,)
        assert (batch.meta.slot_mapping[num_tokens:] == -1).all() and not batch.input_ids[num_tokens:].any()
        assert batch.meta.query_start_loc[-1] == num_tokens  # the metadata is the real sequences'
        self.calls.append((num_tokens, size))
        meta = dataclasses.replace(batch.meta, slot_mapping=batch.meta.slot_mapping[:num_tokens])
        return self.runner.model.forward(batch.input_ids[:num_tokens], batch.positions[:num_tokens],
                                         self.runner.kv_cache, meta, batch.logits_indices)


def test_prefilling_steps_go_through_the_mixed_graphs_padded_to_their_bucket():
    """The runner hands a prefilling step to its mixed-step graphs with ids, positions and slots padded to the
    bucket and the real metadata; the sampled tokens and the KV written equal the eager runner's."""
    runners = [make_runner(), make_runner()]
    graphs = runners[0].mixed_graphs = PaddedForward(runners[0])
    outputs = []
    for runner in runners:
        items = [scheduled(range(10, 20), 0, 10, [4, 9, 2], seq_id=100),  # a 10-token prompt
                 scheduled(range(30, 36), 5, 1, [6, 1], seq_id=101)]  # beside a decode
        step = runner.execute(SchedulerOutput(items))
        outputs.append(([r.samples for r in step], runner.kv_cache.copy()))
    assert graphs.calls == [(11, 16)]
    assert outputs[0][0] == outputs[1][0]
    np.testing.assert_array_equal(outputs[0][1], outputs[1][1])
