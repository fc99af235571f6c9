"""The decode-graph path of the runner on the CPU: what it hands DecodeGraphs is enough to rebuild every step.

NumpyDecodeGraphs keeps DecodeGraphs' contract with NumPy: it sees the block tables only through the change
feed of the persistent rows (BlockTableRows.take_changes, or a whole copy on a new generation) and the
sampling parameters only through SamplingRows' dirty rows, rebuilds slot mapping, context lengths and
block tables as cuda/step_inputs.cu's decode_inputs does, runs the model, and samples with the NumPy
sampler from the mirrored parameters. Attached to a real engine, its outputs must equal the engine without
graphs exactly (float64), in the synchronous and the async loop, on random workloads with preemption
(recompute and swap), prefix hits, n > 1, stops, and penalty / logprobs rows (which take the eager
sampler). A stale mirror entry, a wrong write flag or a wrong seed would change tokens.
"""
from __future__ import annotations

import math

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings
from test_async_scheduling import _outputs, workloads
from tiny_engine import run_to_completion, tiny_engine, tiny_model

from offline_paged.core.sampling_params import SamplingParams, StructuredOutputsParams
from offline_paged.worker import model_runner
from offline_paged.ops.attention import AttentionMetadata
from offline_paged.worker.launched_step import LateSamples, ReadySamples
from offline_paged.worker.sampler import Sampler, SamplingRequest

MODEL = tiny_model(seed=3)


class NumpyDecodeGraphs:
    def __init__(self, model, kv_cache, block_size: int, max_model_len: int, buckets=(1, 2, 4, 8)) -> None:
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.max_model_len, self.buckets = max_model_len, buckets
        self.max_blocks = math.ceil(max_model_len / block_size)
        self.tables, self.tables_key = None, None  # [R, Mr] the mirror
        self.params, self.seeds, self.rows_source = None, None, None
        self.num_replays = self.num_sampled_replays = self.num_masked_samples = 0
        self.last_run = None  # (logits [S, V], block-table rows [S], sample positions [S] or None) of the last replay
        self.ids_buffer = np.zeros(buckets[-1], np.int32)  # [b_max] the masked sampler's ids (sampled_ids)

    def fits(self, num_seqs: int, max_context_len: int, max_table_len: int) -> bool:
        return (0 < num_seqs <= self.buckets[-1] and max_context_len <= self.max_model_len
                and max_table_len <= self.max_blocks)

    def run(self, input_ids, positions, slot_rows, writes, table_rows, timer=None, fill=None, sample_positions=None):
        self.num_replays += 1
        changes = table_rows.take_changes()
        if self.tables_key != (table_rows, table_rows.generation):
            self.tables, self.tables_key = table_rows.tables.copy(), (table_rows, table_rows.generation)
        else:
            self.tables[changes[:, 0], changes[:, 1]] = changes[:, 2]
        num_seqs, rows, positions = len(slot_rows), np.asarray(slot_rows), np.asarray(positions)  # [S] each
        used = positions // self.block_size + 1  # [S] blocks each sequence reads
        tables = np.zeros((num_seqs, int(used.max())), dtype=np.int64)  # [S, M]
        for i in range(num_seqs):
            tables[i, :used[i]] = self.tables[rows[i], :used[i]]
        blocks = tables[np.arange(num_seqs), positions // self.block_size]  # [S]
        slots = np.where(np.asarray(writes), blocks * self.block_size + positions % self.block_size, -1)  # [S]
        ids = np.asarray(input_ids, dtype=np.int64).copy()  # [S]
        if fill is not None:
            fill(ids)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, context_lens=positions + 1,
                                 query_start_loc=np.arange(num_seqs + 1), max_query_len=1,
                                 max_context_len=int(positions.max()) + 1)
        logits = self.model.forward(ids, positions, self.kv_cache, meta, np.arange(num_seqs))  # [S, V]
        self.last_run = (logits, rows, sample_positions)
        return logits

    def run_and_sample(self, input_ids, positions, slot_rows, writes, table_rows, sample_positions,
                       sampling_rows, timer=None, fill=None):
        self.num_sampled_replays += 1
        logits = self.run(input_ids, positions, slot_rows, writes, table_rows, timer, fill)
        requests = self._requests(sampling_rows, slot_rows, sample_positions)
        return logits, ReadySamples(Sampler().sample(logits, requests))

    # The masked sampling graph (structured output): the last replay's rows sampled under host masks [S, W],
    # their ids written into one persistent buffer, which `sampled_ids` hands out before the draw.
    def masks_fit(self, num_words: int) -> bool:
        return 32 * num_words >= self.model.config.vocab_size

    def mask_staging(self, num_seqs: int, num_words: int, host_rows=None) -> np.ndarray:
        return np.zeros((num_seqs, num_words), np.int32) if host_rows is None else host_rows(num_seqs, num_words)

    def sampled_ids(self, num_seqs: int) -> np.ndarray:
        return self.ids_buffer[:num_seqs]

    def sample_masked(self, masks: np.ndarray, sampling_rows):
        self.num_masked_samples += 1
        (logits, rows, sample_positions), self.last_run = self.last_run, None
        samples = ReadySamples(Sampler().sample(logits, self._requests(sampling_rows, rows, sample_positions, masks)))
        self.ids_buffer[:len(rows)] = samples.token_ids
        return samples

    def _requests(self, sampling_rows, slot_rows, sample_positions, masks=None) -> list[SamplingRequest]:
        """The rows' SamplingRequests from the mirror of sampling_rows (updated from its dirty rows)."""
        dirty = sampling_rows.take_dirty()
        if self.rows_source is not sampling_rows or self.params.shape[0] < sampling_rows.num_rows:
            self.params, self.seeds = sampling_rows.params.copy(), sampling_rows.seeds.copy()
            self.rows_source = sampling_rows
        else:
            self.params[dirty], self.seeds[dirty] = sampling_rows.params[dirty], sampling_rows.seeds[dirty]
        requests = []
        for i, (row, position) in enumerate(zip(np.asarray(slot_rows).tolist(), np.asarray(sample_positions).tolist())):
            temperature, min_p, _, top_p, top_k = self.params[row, :5].tolist()
            params = SamplingParams(temperature=temperature, min_p=min_p, top_p=top_p, top_k=int(top_k))
            mask = None if masks is None else masks[i]
            requests.append(SamplingRequest(params, int(self.seeds[row]), position, (), (), mask))
        return requests


def _params(draw) -> SamplingParams:
    kind = draw(st.sampled_from(["top_k", "top_p", "min_p", "mixed"]))
    base = dict(max_tokens=draw(st.integers(1, 14)), temperature=draw(st.sampled_from([0.0, 0.7, 1.4])),
                seed=draw(st.integers(0, 5)))
    if kind in ("top_k", "mixed"):
        base["top_k"] = draw(st.integers(1, 30))
    if kind in ("top_p", "mixed"):
        base["top_p"] = draw(st.sampled_from([0.3, 0.8, 0.95]))
    if kind in ("min_p", "mixed"):
        base["min_p"] = draw(st.sampled_from([0.02, 0.2]))
    return SamplingParams(**base)


@st.composite
def filtered_workloads(draw):
    """test_async_scheduling's workloads plus requests with top-k / top-p / min-p."""
    requests, pool = draw(workloads())
    for index in range(draw(st.integers(0, 4))):
        requests[f"f{index}"] = (draw(st.lists(st.integers(4, 250), min_size=1, max_size=12)), _params(draw))
    return requests, pool


def _run(requests, pool, async_scheduling: bool, graphs: bool):
    num_blocks, mode = pool
    engine = tiny_engine(MODEL, num_kv_blocks=num_blocks, num_cpu_blocks=64, preemption_mode=mode,
                         max_num_seqs=6, max_num_batched_tokens=24, max_model_len=40,
                         async_scheduling=async_scheduling)
    runner = engine.runner
    fake = None
    if graphs:
        fake = NumpyDecodeGraphs(runner.model, runner.kv_cache, runner.block_size, 40)
        runner.attach_decode_graphs(fake, sample_in_graph=True)
    results = run_to_completion(engine, requests)
    assert engine.block_manager.num_seqs == 0
    return _outputs(results), fake


@settings(max_examples=50, deadline=None)
@given(filtered_workloads(), st.booleans())
def test_graph_path_inputs_rebuild_every_step(workload, async_scheduling):
    requests, pool = workload
    expected, _ = _run(requests, pool, async_scheduling=False, graphs=False)
    got, fake = _run(requests, pool, async_scheduling, graphs=True)
    assert got == expected


def test_the_graph_path_is_taken_and_samples_in_the_graph():
    requests = {f"r{i}": ([5 + i, 9, 13, 40 + i], SamplingParams(max_tokens=12, temperature=0.8, seed=i, top_k=5))
                for i in range(5)}
    requests["slow"] = ([7, 7, 7], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    expected, _ = _run(requests, (256, "recompute"), async_scheduling=False, graphs=False)
    for async_scheduling in (False, True):
        got, fake = _run(requests, (256, "recompute"), async_scheduling, graphs=True)
        assert got == expected
        assert fake.num_sampled_replays > 5 and fake.num_replays == fake.num_sampled_replays


def test_penalty_rows_fall_back_to_the_eager_sampler():
    requests = {f"r{i}": ([5 + i, 9, 13], SamplingParams(max_tokens=8, temperature=0.8, seed=i)) for i in range(3)}
    requests["pen"] = ([7, 7, 7], SamplingParams(max_tokens=16, temperature=0.9, seed=4, repetition_penalty=1.3,
                                                 ignore_eos=True))
    expected, _ = _run(requests, (256, "recompute"), async_scheduling=False, graphs=False)
    got, fake = _run(requests, (256, "recompute"), async_scheduling=True, graphs=True)
    assert got == expected
    assert fake.num_replays > 5 and fake.num_sampled_replays == 0


def test_grammar_rows_draw_in_the_masked_graph_and_feed_the_next_step_by_row(monkeypatch):
    """Structured-output rows replay the decode graph and draw in its masked sampler (the eager sampler's masks,
    the graph's mirrored parameters). Under async scheduling the next decode step finds their pending tokens by
    block-table row (decode_pending_inputs) from the masked step's sample_rows, as after an unmasked graph step:
    a wrong row would feed another sequence's token and change the outputs."""
    spec = StructuredOutputsParams(regex="[0-9]+(, [a-c]+)*")
    requests = {f"g{i}": ([5 + i, 9, 13], SamplingParams(max_tokens=12, temperature=0.8, seed=i,
                                                         structured_outputs=spec)) for i in range(4)}
    requests["plain"] = ([7, 7, 7], SamplingParams(max_tokens=16, temperature=0.7, seed=9, ignore_eos=True))
    expected, _ = _run(requests, (256, "recompute"), async_scheduling=False, graphs=False)
    after_masked = []
    by_row = model_runner.decode_pending_inputs

    def counted(columns, rows, previous, upload):
        after_masked.append(isinstance(previous.samples, LateSamples))
        return by_row(columns, rows, previous, upload)

    monkeypatch.setattr(model_runner, "decode_pending_inputs", counted)
    for async_scheduling in (False, True):
        got, fake = _run(requests, (256, "recompute"), async_scheduling, graphs=True)
        assert got == expected, async_scheduling
        assert fake.num_masked_samples > 5
    assert sum(after_masked) > 5  # async: decode steps fed by a masked graph step's samples, found by row
