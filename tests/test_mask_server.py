"""MaskServer: masks filled by worker processes equal the ones this process fills from the same matchers,
through forks, matchers that leave a fill and come back, errors, shared and plain output arrays; and the
engine's overlapped grammar steps give the same tokens with the server as without it."""
from __future__ import annotations

import os

import numpy as np
import pytest

from offline_paged.core.grammar_compiler import GrammarCompiler
from offline_paged.core.mask_server import _SHM_DIR, MaskServer
from offline_paged.core.structured_matcher import advance_ahead, fill_bitmask_rows
from offline_paged.core.structured_outputs import StructuredOutputsParams
from test_structured_generation import SCHEMA, _async_workload, _tokens, _workload
from tiny_engine import EOS_ID, VOCAB_SIZE, ByteTokenizer, run_to_completion, tiny_engine

TOKENIZER = ByteTokenizer()
SPECS = [StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
         StructuredOutputsParams(regex="(ab|a[0-9]{1,3})c+"),
         StructuredOutputsParams(choice=["yes", "no", "maybe"])]


@pytest.fixture(scope="module")
def compiler():
    compiler = GrammarCompiler(TOKENIZER, VOCAB_SIZE, (EOS_ID,), mask_processes=2)
    yield compiler
    compiler.close()


def _allowed(mask_row: np.ndarray) -> np.ndarray:
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:VOCAB_SIZE]
    return np.flatnonzero(bits)


def _local_masks(rows, num_rows: int, num_words: int) -> np.ndarray:
    expected = np.zeros((num_rows, num_words), np.int32)
    fill_bitmask_rows(rows, expected)
    return expected


@pytest.mark.parametrize("shared", [True, False], ids=["shared_rows", "plain_array"])
def test_the_servers_masks_equal_this_process_s_through_forks_drops_and_returns(compiler, shared):
    grammars = [compiler.compile(spec) for spec in SPECS]
    server = compiler.mask_server
    assert server is not None and server.num_workers == 2
    rng = np.random.default_rng(0)
    matchers = [grammars[i % len(grammars)].new_matcher() for i in range(12)]
    num_words = grammars[0].num_words
    out = server.shared_rows(16, num_words) if shared else np.zeros((16, num_words), np.int32)
    assert not [name for name in os.listdir(_SHM_DIR) if name.startswith(f"offline-paged-masks-{os.getpid()}-")]
    resent_before, checked = server.num_resent, 0
    for step in range(25):
        live = [m for m in matchers if not m.is_failed and not m.is_finished]
        if not live:
            break
        # Some matchers sit out a step (a preempted sequence): the server drops them and resends them later.
        present = [m for m in live if step % 5 != 0 or m.uid % 2 == 0]
        rows = [(m, int(r)) for m, r in zip(present, rng.permutation(16)[:len(present)])]
        out[:] = 7  # rows not filled keep this
        server.fill(rows, out)()
        expected = _local_masks(rows, 16, num_words)
        for matcher, row in rows:
            np.testing.assert_array_equal(out[row], expected[row], err_msg=f"step {step} matcher {matcher.uid}")
            checked += 1
        filled = {row for _, row in rows}
        assert all((out[row] == 7).all() for row in range(16) if row not in filled)
        # Advance: mostly allowed tokens, one refused token now and then, a fork of one matcher.
        pairs = []
        for matcher, row in rows:
            allowed = _allowed(expected[row])
            allowed = allowed[allowed != EOS_ID] if (allowed != EOS_ID).any() else allowed
            token = int(rng.choice(allowed)) if allowed.size and rng.random() > 0.03 else int(rng.integers(VOCAB_SIZE))
            pairs.append((matcher, token))
        advance_ahead(pairs)
        for matcher, token in pairs:
            matcher.accept(token)
        if step % 4 == 1:
            matchers.append(rng.choice(present).fork())
    assert checked > 100
    assert server.num_resent > resent_before + len(matchers) - 12  # new, forked and returning matchers


def test_a_dead_worker_is_an_error_and_bad_rows_are_refused_before_any_worker_sees_them():
    compiler = GrammarCompiler(TOKENIZER, VOCAB_SIZE, (EOS_ID,), mask_processes=2)
    grammar = compiler.compile(SPECS[1])
    server = compiler.mask_server
    matcher = grammar.new_matcher()
    out = np.zeros((2, grammar.num_words), np.int32)
    with pytest.raises(ValueError, match=r"rows \[5\] are outside the 2 rows"):
        server.fill([(matcher, 5)], out)
    server.fill([(matcher, 1)], out)()  # the server goes on
    np.testing.assert_array_equal(out[1], _local_masks([(matcher, 1)], 2, grammar.num_words)[1])
    for worker in server._workers:
        worker.kill()
        worker.join()
    with pytest.raises(RuntimeError, match="mask worker . died"):
        server.fill([(matcher, 0)], out)()
    compiler.close()


def test_misuse_is_refused():
    with pytest.raises(ValueError, match="at least one worker"):
        MaskServer((TOKENIZER, VOCAB_SIZE, (EOS_ID,)), 0)
    with pytest.raises(ValueError, match="mask_processes"):
        GrammarCompiler(TOKENIZER, VOCAB_SIZE, (EOS_ID,), mask_processes=-1)


@pytest.mark.parametrize("workload", [_async_workload, _workload], ids=["mixed", "json"])
def test_overlapped_grammar_steps_give_the_same_tokens_with_mask_processes(workload):
    """The engine under async scheduling with 2 mask processes against the in-process fill (0)."""
    local = run_to_completion(tiny_engine(async_scheduling=True, grammar_mask_processes=0), workload())
    eng = tiny_engine(async_scheduling=True, grammar_mask_processes=2)
    got = run_to_completion(eng, workload())
    server = eng.grammar_compiler.mask_server
    assert server is not None and server.num_resent > 0  # the server filled the masks
    assert _tokens(got) == _tokens(local)
    eng.close()
