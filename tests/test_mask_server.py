"""MaskServer: masks filled by worker processes equal the ones this process fills from the same matchers,
through forks, matchers that leave a fill and come back, errors, shared and plain output arrays; and the
engine's overlapped grammar steps give the same tokens with the server as without it."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

import numpy as np
import pytest

from offline_paged.core.grammar_compiler import GrammarCompiler
from offline_paged.core.mask_server import _SHM_DIR, MaskServer, _Replies
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
    """A compiler with a 2-worker server."""
    compiler = GrammarCompiler(TOKENIZER, VOCAB_SIZE, (EOS_ID,), mask_processes=2)
    compiler.tokenizer  # (starts the server)
    yield compiler
    compiler.close()


def _allowed(mask_row: np.ndarray) -> np.ndarray:
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:VOCAB_SIZE]
    return np.flatnonzero(bits)


def _local_masks(rows, num_rows: int, num_words: int) -> np.ndarray:  # (this process's fill)
    expected = np.zeros((num_rows, num_words), np.int32)
    fill_bitmask_rows(rows, expected)
    return expected


def _same_outcome(ours: str | None, theirs: str | None) -> None:
    """Both accept the token, or both refuse it naming the parser error (llguidance words a refusal by
    whether a mask was computed in that state: a mirror rebuilt from its history computed none)."""
    assert (ours is None) == (theirs is None)
    assert ours is None or ours.startswith("Parser Error: token")


@pytest.mark.parametrize("shared", [True, False], ids=["shared_rows", "plain_array"])
def test_the_servers_masks_and_outcomes_equal_this_process_s_through_forks_drops_and_returns(compiler, shared):
    """Twins: each matcher with the server beside one without. Every step the server's masks equal this
    process's fill of the twins, and the outcomes `accept` reads (from the server's worker, or from this
    process's catching-up matcher when the server did not consume the token) equal the twins'."""
    reference = GrammarCompiler(TOKENIZER, VOCAB_SIZE, (EOS_ID,))  # no server
    served = [compiler.compile(spec) for spec in SPECS]
    plain = [reference.compile(spec) for spec in SPECS]
    server = compiler.mask_server
    assert server is not None and server.num_workers == 2 and all(g.mask_server is server for g in served)
    rng = np.random.default_rng(0)
    twins = [(served[i % 3].new_matcher(), plain[i % 3].new_matcher()) for i in range(12)]
    num_words = served[0].num_words
    out = server.shared_rows(16, num_words) if shared else np.zeros((16, num_words), np.int32)
    assert not [name for name in os.listdir(_SHM_DIR) if name.startswith(f"offline-paged-masks-{os.getpid()}-")]
    resent_before, outcomes_before, checked, outcomes = server.num_resent, server.num_outcomes, 0, 0
    fed: list = []  # (twin pair, token) fed ahead last step, accepted after this step's fill
    for step in range(30):
        live = [t for t in twins if not t[1].is_failed and not t[1].is_finished]
        # Some matchers sit out a step (a preempted sequence): the server drops them and resends them later.
        present = [t for j, t in enumerate(live) if step % 5 != 0 or j % 2 == 0]
        rows = [(t, int(r)) for t, r in zip(present, rng.permutation(16)[:len(present)])]
        out[:] = 7  # rows not filled keep this
        wait = server.fill([(t[0], row) for t, row in rows], out)
        for (ours, theirs), token in fed:  # the stop checker's accept, while the masks fill
            _same_outcome(ours.accept(token), theirs.accept(token))
            assert ours.is_finished == theirs.is_finished and ours.is_failed == theirs.is_failed
            outcomes += 1
        wait()
        expected = np.zeros((16, num_words), np.int32)
        fill_bitmask_rows([(t[1], row) for t, row in rows], expected)
        for twin, row in rows:
            np.testing.assert_array_equal(out[row], expected[row], err_msg=f"step {step} matcher {twin[0].uid}")
            checked += 1
        filled = {row for _, row in rows}
        assert all((out[row] == 7).all() for row in range(16) if row not in filled)
        if not rows:
            break
        # Mostly allowed tokens, a refused one now and then; fed ahead (most) or accepted at once.
        fed = []
        for twin, row in rows:
            allowed = _allowed(expected[row])
            allowed = allowed[allowed != EOS_ID] if (allowed != EOS_ID).any() else allowed
            token = int(rng.choice(allowed)) if allowed.size and rng.random() > 0.03 else int(rng.integers(VOCAB_SIZE))
            if rng.random() < 0.8:
                fed.append((twin, token))
            else:
                _same_outcome(twin[0].accept(token), twin[1].accept(token))
        advance_ahead([(t[0], token) for t, token in fed])
        advance_ahead([(t[1], token) for t, token in fed])
        if step % 4 == 1 and not fed:
            ours, theirs = present[0]
            twins.append((ours.fork(), theirs.fork()))
        elif step % 4 == 1:  # fork after the outcomes are read
            for (ours, theirs), token in fed:
                _same_outcome(ours.accept(token), theirs.accept(token))
            fed = []
            ours, theirs = rows[0][0]
            twins.append((ours.fork(), theirs.fork()))
    assert checked > 150 and outcomes > 100  # (224 and 129 with this seed)
    # Every token fed ahead and accepted after a fill had its outcome from the workers, the matchers that
    # sat that fill out included (they only consumed); the fork steps' accepts before any fill did not.
    assert server.num_outcomes - outcomes_before == outcomes
    assert server.num_resent > resent_before + len(twins) - 12  # new, forked and returning matchers
    assert len(twins) > 12


def _mapped_segments(pid: int) -> int:
    """Mask segments of this process that worker `pid` has mapped (unlinked files still show in its maps)."""
    with open(f"/proc/{pid}/maps") as maps:
        return sum(f"offline-paged-masks-{os.getpid()}-" in line for line in maps)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the workers' /proc/PID/maps")
def test_fills_into_growing_plain_arrays_stay_right_and_the_workers_unmap_outgrown_scratch_rows():
    """A fill into an array outside shared memory goes through a scratch segment, which grows (by
    doubling) as an eager step's grammar rows do; the workers let go of each one it replaces."""
    compiler = GrammarCompiler(TOKENIZER, VOCAB_SIZE, (EOS_ID,), mask_processes=2)
    try:
        grammars = [compiler.compile(spec) for spec in SPECS]
        server = compiler.mask_server
        num_words = grammars[0].num_words
        rng = np.random.default_rng(1)
        for num_rows in (3, 70, 150, 300, 20):
            matchers = [grammars[i % 3].new_matcher() for i in range(num_rows)]
            for matcher in matchers:  # a few allowed tokens each, so that the masks differ between rows
                for _ in range(int(rng.integers(3))):
                    allowed = _allowed(_local_masks([(matcher, 0)], 1, num_words)[0])
                    allowed = allowed[allowed != EOS_ID]
                    if allowed.size:
                        matcher.accept(int(rng.choice(allowed)))
            rows = [(matcher, int(row)) for matcher, row in zip(matchers, rng.permutation(num_rows))]
            out = np.zeros((num_rows, num_words), np.int32)
            server.fill(rows, out)()
            np.testing.assert_array_equal(out, _local_masks(rows, num_rows, num_words), err_msg=f"{num_rows} rows")
        # 64 rows, then 128, 256 and 512: only the last is still mapped, in this process and in each worker.
        assert [_mapped_segments(worker.pid) for worker in server._workers] == [1, 1]
    finally:
        compiler.close()


def test_a_dead_worker_is_an_error_and_bad_rows_are_refused_before_any_worker_sees_them():
    compiler = GrammarCompiler(TOKENIZER, VOCAB_SIZE, (EOS_ID,), mask_processes=2)
    grammar = compiler.compile(SPECS[1])
    server = compiler.mask_server
    matcher = grammar.new_matcher()
    out = np.zeros((2, grammar.num_words), np.int32)
    with pytest.raises(ValueError, match=r"rows \[5\] are outside the 2 rows"):
        server.fill([(matcher, 5)], out)
    with pytest.raises(RuntimeError, match=f"matcher {matcher.uid} appears twice in one mask fill"):
        server.fill([(matcher, 0), (matcher, 1)], out)
    server.fill([(matcher, 1)], out)()  # the server goes on
    np.testing.assert_array_equal(out[1], _local_masks([(matcher, 1)], 2, grammar.num_words)[1])
    for worker in server._workers:
        worker.kill()
        worker.wait()
    with pytest.raises(RuntimeError, match="mask worker . died"):
        server.fill([(matcher, 0)], out)()
    compiler.close()


def test_a_script_without_a_main_guard_starts_its_workers_once(tmp_path):
    """The workers do not import the parent's __main__ (multiprocessing's spawn would: each of them would
    run the script's top level again, here starting servers of its own)."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import numpy as np\n"
        "from offline_paged.core.grammar_compiler import GrammarCompiler\n"
        "from offline_paged.core.structured_outputs import StructuredOutputsParams\n"
        "from tiny_engine import EOS_ID, VOCAB_SIZE, ByteTokenizer\n"
        "print('top level ran', flush=True)\n"
        "compiler = GrammarCompiler(ByteTokenizer(), VOCAB_SIZE, (EOS_ID,), mask_processes=2)\n"
        "grammar = compiler.compile(StructuredOutputsParams(regex='ab|ac'))\n"
        "out = np.zeros((1, grammar.num_words), np.int32)\n"
        "compiler.mask_server.fill([(grammar.new_matcher(), 0)], out)()\n"
        "print('allowed', np.flatnonzero(np.unpackbits(out.view(np.uint8), bitorder='little')).tolist())\n"
        "compiler.close()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("top level ran") == 1
    assert f"allowed [{TOKENIZER.encode('a')[0]}]" in result.stdout


def test_close_kills_a_worker_that_does_not_exit_and_lets_the_others_exit():
    import signal

    server = MaskServer((TOKENIZER, VOCAB_SIZE, (EOS_ID,)), 3)
    server.wait_ready()
    stuck = server._workers[1]
    os.kill(stuck.pid, signal.SIGSTOP)  # it cannot read the stop message
    server.close()
    assert stuck.returncode == -signal.SIGKILL
    assert [worker.returncode for i, worker in enumerate(server._workers) if i != 1] == [0, 0]
    server.close()  # a second close does nothing


def test_close_with_a_fill_pending_lets_every_worker_exit_cleanly():
    grammar = GrammarCompiler(TOKENIZER, VOCAB_SIZE, (EOS_ID,), mask_processes=2)
    spec = grammar.compile(SPECS[0])
    server = grammar.mask_server
    out = server.shared_rows(4, spec.num_words)
    server.fill([(spec.new_matcher(), row) for row in range(4)], out)  # never waited for
    grammar.close()
    assert [worker.returncode for worker in server._workers] == [0, 0]


class ParentOnlyTokenizer(ByteTokenizer):
    """A token table only the creating process can read: the mask workers fail to build their tokenizer."""

    def __init__(self) -> None:
        self.parent = os.getpid()

    def token_bytes(self, token_id: int) -> bytes:
        if os.getpid() != self.parent:
            raise RuntimeError("no token table outside the parent")
        return super().token_bytes(token_id)


def test_workers_that_fail_to_start_leave_the_masks_to_this_process_with_a_warning():
    compiler = GrammarCompiler(ParentOnlyTokenizer(), VOCAB_SIZE, (EOS_ID,), mask_processes=2)
    with pytest.warns(RuntimeWarning, match="grammar mask processes did not start .*no token table"):
        grammar = compiler.compile(SPECS[1])
    assert grammar.mask_server is None and compiler.mask_server is None
    matcher = grammar.new_matcher()
    assert matcher.mask_server is None and matcher.accept(TOKENIZER.encode("a")[0]) is None
    compiler.close()


def test_replies_read_in_any_pieces_come_out_whole_and_in_order():
    """_Replies reads what a worker's Connection sent: several replies in one read, one reply over several
    reads (a 200 kB error text), then EOF when the worker's end closes."""
    ours, theirs = socket.socketpair()
    worker = Connection(theirs.detach())
    replies = _Replies(ours.fileno())
    assert not replies.has_reply()
    sent = [[(3, None, True)], None, "x" * 200_000, [], None]

    def send_all():
        for reply in sent:
            worker.send(reply)
        worker.close()

    sender = threading.Thread(target=send_all)
    sender.start()
    got = [replies.next() for _ in sent]
    sender.join()
    assert got == sent and not replies.has_reply()
    with pytest.raises(EOFError):
        replies.next()
    ours.close()


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
    assert server is not None and server.num_resent > 0 and server.num_outcomes > 0  # the server ran them
    assert _tokens(got) == _tokens(local)
    eng.close()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_sequences_come_back_to_the_server_with_their_history(mode):
    """Preemption takes sequences out of the fills (their mirrors are dropped) and brings them back (resent
    with their whole history): the tokens equal the in-process fill's."""
    config = dict(num_kv_blocks=28, num_cpu_blocks=256, max_num_batched_tokens=16, preemption_mode=mode,
                  async_scheduling=True)
    local = run_to_completion(tiny_engine(grammar_mask_processes=0, **config), _workload())
    eng = tiny_engine(grammar_mask_processes=2, **config)
    got = run_to_completion(eng, _workload())
    assert eng.stats.num_preemptions > 0 and eng.mask_server.num_outcomes > 0
    assert _tokens(got) == _tokens(local)
    eng.close()


def test_a_late_sampling_is_queued_early_only_when_it_asks_to_be():
    """LaunchedStep.queue_early_sampling: the step loop's call after processing the previous step."""
    from offline_paged.worker.launched_step import LateSamples, LaunchedStep, ReadySamples

    started = []

    def step(early: bool) -> LaunchedStep:
        samples = LateSamples(lambda: started.append(early) or ReadySamples([]), early=early)
        return LaunchedStep(output=None, samples=samples, sample_index={}, owners=[], prompt_logprobs=[],
                            forward_timer=None, used_cuda_graph=False)

    late, early = step(False), step(True)
    late.queue_early_sampling()
    early.queue_early_sampling()
    early.queue_early_sampling()  # once only
    assert started == [True]
    late.queue_sampling()  # the next launch queues the others
    assert started == [True, False]


@pytest.mark.parametrize("workload", [_async_workload, _workload], ids=["mixed", "json"])
def test_masked_sampling_queued_by_the_next_launch_gives_the_same_tokens(workload):
    """queue_sampling_early off (the server's default is on, which the test above runs)."""
    local = run_to_completion(tiny_engine(async_scheduling=True, grammar_mask_processes=0), workload())
    eng = tiny_engine(async_scheduling=True, grammar_mask_processes=2)
    assert eng.grammar_compiler.tokenizer is not None and eng.mask_server is not None  # (started with it)
    assert eng.mask_server.queue_sampling_early
    eng.mask_server.queue_sampling_early = False
    got = run_to_completion(eng, workload())
    assert _tokens(got) == _tokens(local)
    eng.close()


@pytest.mark.parametrize("launch_ahead", [True, False], ids=["launched", "scheduled"])
def test_a_request_aborted_while_the_next_step_is_scheduled_ahead_ends_alone(launch_ahead):
    """With mask processes the engine schedules (and launches) the next step while the masks fill; a request
    aborted between steps then is still in that step. Its step runs, its token is dropped, and the others end
    with the tokens of an engine where it was aborted before any step was scheduled ahead; no block leaks."""
    workload = _workload()
    eng = tiny_engine(async_scheduling=True, grammar_mask_processes=2)
    eng.launch_ahead = launch_ahead
    for request_id, (prompt_ids, params) in workload.items():
        eng.add_request(request_id, prompt_token_ids=prompt_ids, params=params)
    results, aborted = {}, None
    while eng.has_unfinished_requests():
        for output in eng.step():
            results[output.request_id] = output
        ahead = eng._launched_ahead if launch_ahead else eng._scheduled_ahead
        if aborted is None and ahead is not None:
            victim = next(item.seq for item in ahead[0].scheduled if item.seq.group.request_id.startswith("j"))
            aborted = victim.group.request_id
            assert eng.abort_request(aborted)
    assert aborted is not None and aborted not in results
    assert set(results) == set(workload) - {aborted}
    # Each request's tokens depend on its own seed only: the same as in a run without the victim.
    alone = run_to_completion(tiny_engine(async_scheduling=True, grammar_mask_processes=0),
                              {k: v for k, v in workload.items() if k != aborted})
    assert _tokens(results) == _tokens(alone)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_gpu_blocks
    eng.close()


@pytest.mark.parametrize("workload", [_async_workload, _workload], ids=["mixed", "json"])
def test_masked_sampling_queued_inside_the_ahead_launch_gives_the_same_tokens(workload):
    """With mask processes the step's masked sampling is queued by the next step's launch (not before it: session
    52 measured that order slower); the tokens stay those of in-process masks."""
    local = run_to_completion(tiny_engine(async_scheduling=True, grammar_mask_processes=0), workload())
    eng = tiny_engine(async_scheduling=True, grammar_mask_processes=2)
    queued_at_launch = []  # per ahead launch: whether the in-flight step's sampling was queued already
    execute = eng.executor.execute

    def recording(output, in_flight=None, defer_grammar_sampling=False):
        if in_flight is not None and getattr(in_flight.samples, "early", False):  # (a MaskServer's LateSamples)
            queued_at_launch.append(in_flight.samples.launched)
        return execute(output, in_flight, defer_grammar_sampling)

    eng.executor.execute = recording
    got = run_to_completion(eng, workload())
    assert _tokens(got) == _tokens(local)
    assert queued_at_launch and set(queued_at_launch) == {False}
    eng.close()
