"""MaskServer: structured-output masks filled by worker processes, each mirroring some of the matchers.

In one process llguidance's parallel fill stops scaling at ~4 threads: 256 masks over a 128k vocabulary take
2.9 ms on the best pool of a 16-core H200 host, longer than the 1B decode step they must hide behind. Split
over 8 processes of one thread each, the same fill takes 1.1 ms (benchmarks/bench_mask_fill.py --processes).

Data structure: K worker processes, each with its own LLTokenizer and a dict uid -> LLMatcher (its mirrors);
here `_placed`: uid -> (worker, tokens that worker's mirror has consumed). A mirror is fully determined by its
grammar text and the tokens its matcher has consumed (`StructuredMatcher.history`), so a fill sends each
worker only the tokens its mirrors lack; a matcher the server has not seen (new, forked, or dropped) goes to
the least loaded worker with its whole history. Masks are written into shared-memory segments the caller can
pin for the device's copy (`shared_rows`); a fill into any other array goes through a scratch segment. A
segment is a file in /dev/shm mapped by this process and every worker, then unlinked at once (nothing is
left behind, even by a crash); its memory goes with the last array over it.

Invariants: a mirror equals its matcher after every fill that names it; the workers' mirrors are exactly the
uids of the last fill and the matchers fed since the one before (the others are dropped, and resent from
their history if they come back). A worker answers each fill twice: the outcome of the tokens it consumed
(error, stopped) per matcher, sent only where a token was refused or finished the grammar (the rest were
allowed), which `outcome` hands to `StructuredMatcher.accept` (so this process consumes nothing in the step
loop), then the masks. All calls come from one thread, but `add_grammar` and
`ensure_ready`, which the compiler's threads call; `fill` returns a wait that must be called before the next
`fill`.
"""
from __future__ import annotations

import itertools
import mmap
import os
import pickle
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np

# A worker is `python -c _WORKER_MAIN FD`: not a fork (the parent holds a CUDA context and running
# threads), and not multiprocessing's spawn either, which imports the parent's __main__ again in each child:
# a user's script without an `if __name__ == "__main__"` guard would load its model eight more times.
_WORKER_MAIN = "import sys; from offline_paged.core.mask_server import worker_main; worker_main(int(sys.argv[1]))"
_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_SEGMENT_IDS = itertools.count()
_EXIT_GRACE_S = 2.0  # close(): how long the workers get to exit together before they are killed
_ALLOWED = (None, False)  # the outcome of a token the grammar allows, not finishing it (error, stopped)


class MaskServer:
    """Fills next-token bitmasks of StructuredMatchers in `num_workers` processes of `threads` threads each."""

    def __init__(self, tokenizer_source: tuple, num_workers: int, threads: int = 1) -> None:
        """tokenizer_source: ll_tokenizer's arguments (tokenizer, vocab_size, eos_token_ids), pickled to the
        workers, which build their LLTokenizer from it (in the background: `fill` waits for them)."""
        if num_workers < 1 or threads < 1:
            raise ValueError(f"a mask server needs at least one worker of one thread, got {num_workers} x {threads}")
        self._pipes, self._workers = [], []
        for _ in range(num_workers):
            worker, pipe = _start_worker()
            self._workers.append(worker)
            self._pipes.append(pipe)
            pipe.send((tokenizer_source, threads))
        self._replies = [_Replies(pipe.fileno()) for pipe in self._pipes]  # every read of a worker's socket
        self._send_lock = threading.Lock()  # add_grammar comes from the compiler's threads
        self._ready = [False] * num_workers
        self._ready_lock = threading.Lock()
        self._all_ready = False
        self._placed: dict[int, tuple[int, int]] = {}  # uid -> (worker, tokens its mirror consumed)
        self._load = [0] * num_workers  # mirrors per worker
        self._segments: dict[int, tuple[int, np.ndarray]] = {}  # address -> (id, [R, W] int32) of each live segment
        self._scratch: tuple[int, np.ndarray] | None = None  # (id, rows): fills into arrays not in shared memory
        self._pending: list[int] = []  # workers whose fill is not yet waited for
        self._awaiting_outcomes: list[int] = []  # workers of the pending fill whose outcomes are not read
        self._fill_lengths: dict[int, int] = {}  # uid -> history length, of the last fill's matchers given tokens
        self._exceptions: dict[int, tuple[str | None, bool]] = {}  # uid -> (error, stopped) where not (None, False)
        self._fed: dict[int, object] = {}  # uid -> matcher given a token ahead since the last fill
        # The step loop queues the masked sampling right after processing the previous step (the masks are
        # in by then), not in the next step's launch: the device samples while the host schedules (on the
        # H200, 1B JSON bench: 3.71 against 3.93 ms a step, medians of 3).
        self.queue_sampling_early = True
        self.num_resent = 0  # matchers sent with their whole history (new, forked, or back after a drop)
        self.num_outcomes = 0  # outcomes `outcome` answered (the others this process's matchers computed)
        self.num_fills = 0
        self.outcome_wait_s = 0.0  # time this process waited for the workers' outcomes
        self.mask_wait_s = 0.0  # ... and then for their masks

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def shared_rows(self, num_rows: int, num_words: int) -> np.ndarray:
        """A new [num_rows, num_words] int32 array in shared memory that `fill` writes into directly (not while
        a fill is pending: every worker maps it before this returns)."""
        return self._new_segment(num_rows, num_words)[1]

    def _new_segment(self, num_rows: int, num_words: int) -> tuple[int, np.ndarray]:
        if self._pending:
            raise RuntimeError("shared_rows called while a mask fill is not yet waited for")
        segment_id = next(_SEGMENT_IDS)
        path = os.path.join(_SHM_DIR, f"offline-paged-masks-{os.getpid()}-{segment_id}")
        shape = (num_rows, num_words)
        rows = _map_rows(path, shape, create=True)  # [R, W]
        try:
            self.ensure_ready()
            self._broadcast(("attach", segment_id, path, shape))
            self._ping()  # every worker has mapped it
        finally:
            os.unlink(path)
        self._segments[rows.ctypes.data] = (segment_id, rows)
        return segment_id, rows

    def add_grammar(self, text: str) -> None:
        """Have every worker compile `text` now, before its first fill needs it."""
        self._broadcast(("grammar", text))

    def wait_ready(self) -> None:
        """Block until every worker has built its tokenizer and compiled the grammars added so far (the
        bench calls it before its timing)."""
        if self._pending:
            raise RuntimeError("wait_ready called while a mask fill is not yet waited for")
        self.ensure_ready()
        self._ping()

    def _ping(self) -> None:
        self._broadcast(("ping",))
        for index in range(len(self._pipes)):
            self._receive(index)

    def ensure_ready(self) -> None:
        """Block until every worker has built its tokenizer; RuntimeError if one failed (thread-safe: the
        compiler's threads call it before the first grammar is handed out)."""
        if self._all_ready:
            return
        with self._ready_lock:
            for index, ready in enumerate(self._ready):
                if not ready:
                    self._receive(index)
                    self._ready[index] = True
            self._all_ready = True

    def fed(self, matchers: list) -> None:
        """`matchers` took a token ahead (advance_ahead): the next fill consumes it in their mirrors and reports
        the outcomes, whether or not that fill asks for their masks (a sequence that ends with this token)."""
        self._fed.update({matcher.uid: matcher for matcher in matchers})

    def fill(self, rows: list, out: np.ndarray) -> Callable[[], None]:
        """Start filling each (matcher, row) pair's next-token mask into out[row] ([R, W] int32; other rows
        are left as they are); matchers fed since the last fill consume their tokens too. Returns the wait
        for the masks; nothing here touches the llguidance matchers."""
        if self._pending:
            raise RuntimeError("a mask fill started before the previous one was waited for")
        self.ensure_ready()
        if out.ndim != 2 or out.dtype != np.int32 or not out.flags.c_contiguous:
            raise ValueError(f"masks go into a C-contiguous [R, W] int32 array, got {out.dtype} {out.shape}")
        indices = [row for _, row in rows]
        if indices and (min(indices) < 0 or max(indices) >= out.shape[0]):
            bad = [row for row in indices if not 0 <= row < out.shape[0]]
            raise ValueError(f"rows {bad[:5]} are outside the {out.shape[0]} rows of the masks")
        segment = self._segment_of(out)
        scratch = segment is None
        segment_id, target = self._scratch_rows(out.shape) if scratch else segment
        entries = self._entries(rows)
        self._exceptions = {}
        with self._send_lock:
            for index in range(len(self._pipes)):
                drops, work = entries[index]
                if drops or work:
                    self._send(index, ("fill", segment_id, drops, work))
                    self._pending.append(index)
        self._awaiting_outcomes = list(self._pending)
        self.num_fills += 1

        def wait() -> None:
            self._read_outcomes()
            start = time.perf_counter()
            pending, self._pending = self._pending, []
            for index in pending:
                self._receive(index)
            self.mask_wait_s += time.perf_counter() - start
            if scratch:
                for _, row in rows:
                    out[row] = target[row]

        return wait

    def outcome(self, uid: int, history_length: int) -> tuple[str | None, bool] | None:
        """(error or None, is_stopped) of matcher `uid` after the first history_length tokens of its history,
        from the last fill's worker; None when that fill did not consume up to there (then the caller's
        matcher consumes them itself)."""
        if self._fill_lengths.get(uid) != history_length:
            return None
        if self._awaiting_outcomes:
            self._read_outcomes()
        self.num_outcomes += 1
        return self._exceptions.get(uid, _ALLOWED)

    def stats(self) -> dict[str, float]:
        """Counters for a bench report: fills, outcomes served, and the waits in seconds."""
        return {"num_workers": self.num_workers, "num_fills": self.num_fills, "num_outcomes": self.num_outcomes,
                "num_resent": self.num_resent, "outcome_wait_s": self.outcome_wait_s, "mask_wait_s": self.mask_wait_s}

    def close(self) -> None:
        """Stop the workers and free the shared memory (arrays from shared_rows must not be used after)."""
        with self._send_lock:
            for pipe in self._pipes:
                try:
                    pipe.send(None)
                except (BrokenPipeError, OSError):
                    pass
        # They hold nothing to save: one grace period for all of them, then the stragglers are killed.
        deadline = time.monotonic() + _EXIT_GRACE_S
        for worker in self._workers:
            try:
                worker.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        for pipe in self._pipes:
            pipe.close()
        self._segments, self._scratch = {}, None  # each segment's memory goes with the last array over it

    # ----------------------------------------------------------------- internals
    def _entries(self, rows: list) -> list[tuple[list, list]]:
        """Per worker: (uids to drop, [(uid, row or None, tokens to consume, grammar text or None)]); a
        matcher fed ahead but not in `rows` only consumes (row None)."""
        work: list[list] = [[] for _ in self._workers]
        seen = {matcher.uid for matcher, _ in rows}
        if len(seen) != len(rows):
            twice = next(uid for uid in seen if sum(matcher.uid == uid for matcher, _ in rows) > 1)
            raise RuntimeError(f"matcher {twice} appears twice in one mask fill")
        fed, self._fed = self._fed, {}
        consume_only = [(matcher, None) for uid, matcher in fed.items() if uid not in seen]
        if consume_only:
            seen.update(matcher.uid for matcher, _ in consume_only)
            rows = rows + consume_only
        placed = self._placed
        lengths = {}  # uid -> history length, of the matchers given tokens (their outcomes are for that length)
        for matcher, row in rows:  # (one pass: 256 rows a step on the JSON bench's hot path)
            uid, history = matcher.uid, matcher.history
            length = len(history)
            where = placed.get(uid)
            if where is None:
                worker = min(range(len(self._load)), key=self._load.__getitem__)
                self._load[worker] += 1
                self.num_resent += 1
                work[worker].append((uid, row, list(history), matcher.grammar_text))
                if length:
                    lengths[uid] = length
            else:
                worker, consumed = where
                if length > consumed:
                    work[worker].append((uid, row, history[consumed:], None))
                    lengths[uid] = length
                else:
                    work[worker].append((uid, row, (), None))
            placed[uid] = (worker, length)
        self._fill_lengths = lengths
        drops: list[list] = [[] for _ in self._workers]
        if len(placed) != len(seen):
            for uid in placed.keys() - seen:
                worker, _ = placed.pop(uid)
                self._load[worker] -= 1
                drops[worker].append(uid)
        return list(zip(drops, work))

    def _segment_of(self, out: np.ndarray) -> tuple[int, np.ndarray] | None:
        """(id, rows) of the segment whose leading rows `out` is, or None. (A dict by address: `.ctypes` on
        each of a long list of segments cost 0.1 ms a step.)"""
        found = self._segments.get(out.__array_interface__["data"][0])
        if found is None:
            return None
        rows = found[1]
        if out.shape[1:] == rows.shape[1:] and out.shape[0] <= rows.shape[0] and out.dtype == rows.dtype:
            return found
        return None

    def _scratch_rows(self, shape: tuple) -> tuple[int, np.ndarray]:
        """The scratch segment, (id, rows) of at least shape[0] rows; it grows by doubling, and the workers
        unmap the one it replaces (an eager step's grammar rows grow with each admission)."""
        old = self._scratch
        if old is None or old[1].shape[1] != shape[1] or old[1].shape[0] < shape[0]:
            grown = 2 * old[1].shape[0] if old is not None and old[1].shape[1] == shape[1] else 0
            self._scratch = self._new_segment(max(shape[0], grown, 64), shape[1])
            if old is not None:
                del self._segments[old[1].ctypes.data]
                self._broadcast(("detach", old[0]))
        return self._scratch

    def _read_outcomes(self) -> None:
        start = time.perf_counter()
        awaiting, self._awaiting_outcomes = self._awaiting_outcomes, []
        for index in awaiting:
            for uid, error, stopped in self._receive(index, expect_list=True):
                self._exceptions[uid] = (error, stopped)
        self.outcome_wait_s += time.perf_counter() - start

    def _broadcast(self, message: tuple) -> None:
        """Send `message` to every worker (the compiler's threads send too: under the send lock)."""
        with self._send_lock:
            for index in range(len(self._pipes)):
                self._send(index, message)

    def _send(self, index: int, message: tuple) -> None:
        try:
            self._pipes[index].send(message)
        except (BrokenPipeError, ConnectionResetError):
            raise RuntimeError(f"mask worker {index} died (exit code {self._workers[index].poll()})") from None

    def _receive(self, index: int, expect_list: bool = False):
        try:
            reply = self._replies[index].next()
        except EOFError:
            raise RuntimeError(f"mask worker {index} died (exit code {self._workers[index].poll()})") from None
        if isinstance(reply, str):
            raise RuntimeError(f"mask worker {index} failed: {reply}")
        if (reply is None) == expect_list:
            raise RuntimeError(f"mask worker {index} answered out of turn: {reply!r}")
        return reply


def _start_worker() -> tuple[subprocess.Popen, Connection]:
    """A worker process and our end of its socket (the child gets this process's sys.path)."""
    ours, theirs = socket.socketpair()
    with theirs:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path for path in sys.path if path))
        worker = subprocess.Popen([sys.executable, "-c", _WORKER_MAIN, str(theirs.fileno())],
                                  pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
    return worker, Connection(ours.detach())


def worker_main(fd: int) -> None:
    """A worker process's entry point: serve the parent at the other end of socket `fd` until it goes."""
    pipe = Connection(fd)
    try:
        tokenizer_source, threads = pipe.recv()
    except EOFError:
        return
    try:
        _serve(pipe, tokenizer_source, threads)
    except (BrokenPipeError, ConnectionResetError):  # the parent went away while we answered: nothing to do
        return


def _serve(pipe, tokenizer_source: tuple, threads: int) -> None:
    """A worker's loop: build the tokenizer, answer `ready`, then two replies per fill (outcomes, then
    None; or the error in their place)."""
    import llguidance
    import llguidance.numpy as llg_numpy

    from offline_paged.core.grammar_tokenizer import ll_tokenizer
    from offline_paged.core.structured_matcher import error_message

    try:
        tokenizer = ll_tokenizer(*tokenizer_source)
        executor = llguidance.LLExecutor(num_threads=threads)
    except Exception as exc:  # the parent raises it at its first fill
        pipe.send(f"{type(exc).__name__}: {exc}")
        return
    pipe.send(None)
    templates: dict[str, llguidance.LLMatcher] = {}
    mirrors: dict[int, llguidance.LLMatcher] = {}
    segments: dict[int, np.ndarray] = {}  # id -> [R, W] int32

    def template(text: str) -> llguidance.LLMatcher:
        if text not in templates:
            templates[text] = llguidance.LLMatcher(tokenizer, text, log_level=0,
                                                   limits=llguidance.LLParserLimits(verbose_errors=False))
        return templates[text]

    while True:
        try:
            message = pipe.recv()
        except EOFError:
            break
        if message is None:
            break
        if message[0] == "ping":  # answered after every earlier message
            pipe.send(None)
            continue
        if message[0] == "attach":
            _, segment_id, path, shape = message
            segments[segment_id] = _map_rows(path, shape)
            continue
        if message[0] == "detach":
            segments.pop(message[1], None)
            continue
        if message[0] == "grammar":
            try:
                template(message[1])
            except Exception:  # the compiler found it valid; a fill that needs it reports the error
                pass
            continue
        _, segment_id, drops, work = message
        replies = 0  # two per fill: the outcomes, then None (the masks are in), or an error in their place
        try:
            for uid in drops:
                mirrors.pop(uid, None)
            pairs, outcomes = [], []
            for uid, row, tokens, text in work:
                if text is not None:
                    mirrors[uid] = template(text).deep_copy()
                mirror = mirrors[uid]
                if tokens:
                    for token in tokens:  # one by one, as StructuredMatcher._local
                        mirror.consume_token(token)
                    error, stopped = error_message(mirror, tokens[-1]), mirror.is_stopped()
                    if error is not None or stopped:  # (the parent takes the others as allowed, not stopped)
                        outcomes.append((uid, error, stopped))
                if row is not None:
                    pairs.append((mirror, row))
            pipe.send(outcomes)
            replies += 1
            if pairs:  # (llguidance refuses an empty fill)
                llg_numpy.fill_next_token_bitmask_par(executor, pairs, segments[segment_id])
            pipe.send(None)
        except Exception as exc:
            for _ in range(2 - replies):
                pipe.send(f"{type(exc).__name__}: {exc}")


class _Replies:
    """The replies on this process's end of a worker's socket. The worker's Connection frames each as a
    4-byte big-endian length and a pickle; where Connection.recv reads a frame's length and its body in two
    reads, this reads whatever has arrived into a buffer, so a fill's two replies often come in one read (on
    the CPU stand-in, 8 workers: 0.157 -> 0.107 ms a step for the replies)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buffer = bytearray()

    def has_reply(self) -> bool:
        """Whether a whole reply is in the buffer already (`next` would not read)."""
        return self._frame_end() is not None

    def next(self):
        """The next reply, unpickled; EOFError when the worker closed its end."""
        while (end := self._frame_end()) is None:
            chunk = os.read(self._fd, 1 << 16)
            if not chunk:
                raise EOFError
            self._buffer += chunk
        reply = pickle.loads(self._buffer[4:end])
        del self._buffer[:end]
        return reply

    def _frame_end(self) -> int | None:
        if len(self._buffer) < 4:
            return None
        size, = struct.unpack_from("!i", self._buffer)
        if size < 0:  # Connection's frame of 2 GiB or more: no reply is near that
            raise RuntimeError(f"a mask worker's reply of {size} bytes")
        return 4 + size if len(self._buffer) >= 4 + size else None


def _map_rows(path: str, shape: tuple[int, int], create: bool = False) -> np.ndarray:
    """An [R, W] int32 array over the file at `path` (made, of the right size, when create), shared with
    every process that maps it. The array holds the mapping: it is unmapped when the array is collected."""
    nbytes = max(shape[0] * shape[1] * 4, 4)
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return np.frombuffer(mapping, dtype=np.int32, count=shape[0] * shape[1]).reshape(shape)
