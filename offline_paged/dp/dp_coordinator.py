"""DataParallelCoordinator: N engine processes (one per GPU) behind the interface of one LLMEngine.

JobRunner and LLM drive it exactly like an engine (add_request / step / has_unfinished_requests /
abort_request / stats / tokenizer), so the job's guarantees (one writer, one record per line, resume,
per-line errors, one progress bar and summary) hold unchanged: the coordinator's process is the only
one that writes the output file.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import wait

from offline_paged.core.config import LARGE_DEVICE_MEMORY, EngineConfig, auto_max_num_seqs
from offline_paged.core.engine_stats import combine_stats
from offline_paged.core.outputs import EngineStats, RequestError, RequestOutput
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.dp.dp_worker import WorkerSpec, WorkRequest, run_worker
from offline_paged.worker.random_stream import unseeded_request_seed

_POLL_S = 0.25  # step() returns empty-handed after this long, so the job loop can see Ctrl-C
DEFAULT_STALL_TIMEOUT_S = 600.0  # a busy worker reports at least every second (dp_worker._STATS_EVERY_S)


class WorkersLostError(RuntimeError):
    """Every worker died with requests still unfinished."""


@dataclass(eq=False, slots=True)
class _Worker:
    index: int
    process: multiprocessing.process.BaseProcess
    conn: object
    outstanding: dict[str, WorkRequest] = field(default_factory=dict)  # dealt, not yet handed back
    stats: EngineStats | None = None
    max_model_len: int = 0
    num_dealt: int = 0  # requests ever dealt to it (re-dealt ones count again)
    alive: bool = True
    last_heard: float = 0.0  # time.monotonic() of its last message, or of work dealt to it while idle


def worker_devices(device: str, num_workers: int) -> tuple[str, list[str | None]]:
    """(resolved device, CUDA_VISIBLE_DEVICES value per worker; None on the CPU). ValueError when
    num_workers is not a positive integer or exceeds the GPUs visible to this process."""
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"data_parallel_size must be a positive integer, got {num_workers!r}")
    if device == "auto":
        from offline_paged.worker.backend import cuda_available

        device = "cuda" if cuda_available() else "cpu"
    if device == "cpu":
        return device, [None] * num_workers
    gpus = _visible_gpus()
    if num_workers > len(gpus):
        raise ValueError(f"data_parallel_size={num_workers} is larger than the {len(gpus)} visible "
                         f"GPU(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    return device, gpus[:num_workers]


def _visible_gpus() -> list[str]:
    from offline_paged.worker.backend import cuda_available

    if not cuda_available():
        return []
    import cupy  # counting devices initialises the driver only, no context on any GPU

    count = cupy.cuda.runtime.getDeviceCount()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [d.strip() for d in listed.split(",") if d.strip()] if listed else []
    return names[:count] if names else [str(i) for i in range(count)]


def default_max_outstanding(config: EngineConfig, device: str) -> int:
    """Requests one worker holds at most by default: its max_num_seqs and a quarter more. Left to the device
    (None), max_num_seqs is taken as a large device's (each worker's engine picks its own by its GPU's memory):
    a large GPU stays fed, a smaller one only queues more."""
    seqs = config.max_num_seqs or auto_max_num_seqs(device, LARGE_DEVICE_MEMORY)
    return seqs + max(1, seqs // 4)


class DataParallelCoordinator:
    """Deals requests to N worker processes, each an LLMEngine with its own KV pool.

    Data structures: `_backlog`, a deque of WorkRequests not yet dealt; per worker, `outstanding`
    (request id -> WorkRequest) for the requests it holds; `_done`, results received and not yet
    returned by step().
    Invariants: every request added and not yet returned is in exactly one of the backlog, a live
    worker's `outstanding` or `_done`; step() returns each request id once (a result is accepted only
    from the worker that holds the request, and a dead worker's pipe is drained before its requests
    are re-dealt).
    Dealing is dynamic: a request goes to the live worker holding the fewest, and only while that
    worker holds fewer than `max_outstanding`; the rest waits here until a worker hands results back,
    so a worker busy with long prompts is not given more than it can run.
    A worker that dies is reported through `log` and its unfinished requests go back to the front of
    the backlog; a request that was on `max_attempts` workers that died comes back as a RequestError
    marked `unfinished` (one request that kills every engine it reaches must not take the job down;
    a job writes nothing for it, so a rerun tries it again). A worker that holds requests and has
    sent nothing for `stall_timeout_s` (stopped, hung) is killed and counts as dead. When no worker
    is left with work to do, step() raises WorkersLostError.
    add_request checks what it can before anything is dealt (the prompt's tokens against
    max_model_len), so LLM.generate refuses a bad prompt before any good one runs; it sends the
    token ids it computed, so a worker does not tokenize the text again.
    """

    def __init__(self, spec: WorkerSpec, num_workers: int, *, tokenizer=None,
                 max_outstanding: int | None = None, max_attempts: int = 2,
                 stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S,
                 log: Callable[[str], None] | None = None) -> None:
        if stall_timeout_s is not None and not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0 seconds (or None for no limit), got {stall_timeout_s!r}")
        device, visible = worker_devices(spec.config.device, num_workers)
        if spec.cpu_threads is None and device == "cpu":
            spec = replace(spec, cpu_threads=max(1, (os.cpu_count() or 1) // num_workers))
        self.spec = replace(spec, config=replace(spec.config, device=device))
        self.device = device
        self.max_outstanding = max_outstanding or default_max_outstanding(spec.config, device)
        self.max_attempts = max_attempts
        self.stall_timeout_s = stall_timeout_s
        self.log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self._tokenizer = tokenizer
        if tokenizer is None and spec.dummy_preset is None:
            from offline_paged.models.loader import load_tokenizer

            _config, self._tokenizer = load_tokenizer(spec.config.model)
        self._backlog: deque[WorkRequest] = deque()
        self._done: list[RequestOutput | RequestError] = []
        self._attempts: dict[str, int] = {}
        self._num_arrivals = 0
        self.num_workers_lost = 0
        self._workers: list[_Worker] = []
        try:
            self._start(visible)
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------- start and stop
    def _start(self, visible: list[str | None]) -> None:
        context = multiprocessing.get_context("spawn")
        for index, gpu in enumerate(visible):
            parent_conn, child_conn = context.Pipe()
            process = context.Process(target=run_worker, args=(index, gpu, self.spec, child_conn),
                                      name=f"offline-paged-dp-{index}", daemon=True)
            process.start()
            child_conn.close()
            self._workers.append(_Worker(index, process, parent_conn))
        for worker in self._workers:
            self._wait_ready(worker, gpu=visible[worker.index])

    def _wait_ready(self, worker: _Worker, gpu: str | None) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(5)
            raise RuntimeError(f"data-parallel worker {worker.index} exited (code "
                               f"{worker.process.exitcode}) while loading the model") from None
        if message[0] == "failed":
            raise RuntimeError(f"data-parallel worker {worker.index}: {message[1]}")
        _, worker.max_model_len, pid = message
        where = f"GPU {gpu}" if gpu is not None else self.device
        self.log(f"data parallel: worker {worker.index} ready (pid {pid}, {where})")

    def close(self) -> None:
        """Stop every worker (a ("stop",) message, then SIGKILL after 5 s); idempotent."""
        for worker in self._workers:
            if worker.alive:
                try:
                    worker.conn.send(("stop",))
                except (OSError, ValueError):
                    pass
        for worker in self._workers:
            worker.process.join(5)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(5)
            worker.alive = False
            worker.conn.close()

    def __enter__(self) -> DataParallelCoordinator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------- the engine interface
    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    @property
    def capacity(self) -> int:
        """Requests the workers hold at most together."""
        return self.max_outstanding * len(self._workers)

    @property
    def max_model_len(self) -> int:
        return min(w.max_model_len for w in self._workers)

    @property
    def worker_pids(self) -> list[int | None]:
        return [w.process.pid for w in self._workers]

    def num_outstanding(self, index: int) -> int:
        return len(self._workers[index].outstanding)

    @property
    def stats(self) -> EngineStats:
        return combine_stats([w.stats for w in self._workers if w.stats is not None])

    def add_request(self, request_id: str, prompt: str | None = None,
                    prompt_token_ids: list[int] | None = None,
                    params: SamplingParams | None = None) -> None:
        """Queue a request for the next deal. A request a worker refuses (ValueError there) comes
        back from step() as a RequestError. An unseeded request is given the seed one engine would
        have drawn for it here (else workers would draw the same seeds for their k-th requests)."""
        if prompt is None and prompt_token_ids is None:
            raise ValueError("a request needs a prompt or prompt_token_ids")
        params = params or SamplingParams()
        prompt_token_ids = self._checked_prompt(prompt, prompt_token_ids, params)
        if params.seed is None:
            params = replace(params, seed=unseeded_request_seed(self.spec.config.seed, self._num_arrivals))
        self._num_arrivals += 1
        request = WorkRequest(request_id, prompt,
                              None if prompt_token_ids is None else list(prompt_token_ids), params)
        self._backlog.append(request)

    def _checked_prompt(self, prompt: str | None, token_ids: list[int] | None,
                        params: SamplingParams) -> list[int] | None:
        """The prompt's token ids, checked against max_model_len as an engine would (ValueError)."""
        if token_ids is None and prompt is not None and self._tokenizer is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            token_ids = self._tokenizer.encode(prompt)
        if token_ids is None or params.truncate_prompt_tokens is not None:
            return token_ids
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("the prompt is empty (it must have at least one token)")
        room = self.max_model_len - (params.max_tokens > 0)
        if len(token_ids) > room:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; max_model_len is "
                             f"{self.max_model_len}, which leaves no room to generate")
        return token_ids

    def abort_request(self, request_id: str) -> bool:
        for index, request in enumerate(self._backlog):
            if request.request_id == request_id:
                del self._backlog[index]
                return True
        for worker in self._live():
            if worker.outstanding.pop(request_id, None) is not None:
                self._send(worker, ("abort", request_id))
                return True
        return False

    def has_unfinished_requests(self) -> bool:
        return bool(self._backlog or self._done or any(w.outstanding for w in self._workers))

    def step(self) -> list[RequestOutput | RequestError]:
        """Deal, wait up to a short poll interval for results, deal again; returns what finished."""
        self._deal()
        if not self._done and self.has_unfinished_requests():
            self._receive(_POLL_S)
            self._deal()
        done, self._done = self._done, []
        return done

    # ----------------------------------------------------------------- dealing and receiving
    def _live(self) -> list[_Worker]:
        return [w for w in self._workers if w.alive]

    def _deal(self) -> None:
        batches: dict[_Worker, list[WorkRequest]] = {}
        live = self._live()
        while self._backlog and live:
            worker = min(live, key=lambda w: len(w.outstanding))
            if len(worker.outstanding) >= self.max_outstanding:
                break
            request = self._backlog.popleft()
            if not worker.outstanding:  # the stall clock starts when an idle worker gets work
                worker.last_heard = time.monotonic()
            worker.outstanding[request.request_id] = request
            worker.num_dealt += 1
            batches.setdefault(worker, []).append(request)
        for worker, requests in batches.items():
            self._send(worker, ("add", requests))

    def _send(self, worker: _Worker, message) -> None:
        try:
            worker.conn.send(message)
        except (OSError, ValueError):
            self._lose(worker, "its pipe broke")

    def _receive(self, timeout: float) -> None:
        live = self._live()
        if not live:
            raise WorkersLostError(f"all {len(self._workers)} data-parallel workers died with "
                                   f"{len(self._backlog)} request(s) unfinished")
        ready = wait([w.conn for w in live] + [w.process.sentinel for w in live], timeout)
        for worker in live:
            if worker.conn in ready:
                self._drain(worker)
            if worker.alive and worker.process.sentinel in ready:
                self._drain(worker)  # what it sent before it ended still counts
                if worker.alive:
                    self._lose(worker, "its process ended")
        self._kill_stalled()

    def _kill_stalled(self) -> None:
        if self.stall_timeout_s is None:
            return
        now = time.monotonic()
        for worker in self._live():
            if worker.outstanding and now - worker.last_heard > self.stall_timeout_s:
                self._drain(worker)  # anything it sent before it stalled still counts
            if worker.alive and worker.outstanding and now - worker.last_heard > self.stall_timeout_s:
                self._lose(worker, f"it sent nothing for {self.stall_timeout_s:g} s while holding requests; "
                                   "killed")

    def _drain(self, worker: _Worker) -> None:
        try:
            while worker.alive and worker.conn.poll():
                self._handle(worker, worker.conn.recv())
        except Exception:  # noqa: BLE001 - EOF, a torn message from a killed worker: it is gone
            self._lose(worker, "its pipe closed")

    def _handle(self, worker: _Worker, message) -> None:
        worker.last_heard = time.monotonic()
        kind, results, stats = message
        if kind != "results":
            raise RuntimeError(f"data-parallel worker {worker.index} sent {kind!r} while running")
        worker.stats = stats
        for result in results:
            if worker.outstanding.pop(result.request_id, None) is not None:  # else: aborted meanwhile
                self._attempts.pop(result.request_id, None)
                self._done.append(result)

    def _lose(self, worker: _Worker, reason: str) -> None:
        """Mark a worker dead, make sure its process is gone, re-deal (or fail) its requests."""
        worker.alive = False
        self.num_workers_lost += 1
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(5)
        worker.conn.close()
        unfinished = list(worker.outstanding.values())
        worker.outstanding.clear()
        for request in reversed(unfinished):
            self._attempts[request.request_id] = self._attempts.get(request.request_id, 0) + 1
            if self._attempts[request.request_id] >= self.max_attempts:
                self._done.append(RequestError(request.request_id, (
                    f"{self.max_attempts} data-parallel workers died while running this request; "
                    "it was not retried again"), unfinished=True))
            else:
                self._backlog.appendleft(request)
        self.log(f"data parallel: worker {worker.index} (pid {worker.process.pid}) died ({reason}, "
                 f"exit code {worker.process.exitcode}); "
                 f"re-dealing its {len(unfinished)} unfinished request(s) to the "
                 f"{len(self._live())} worker(s) left")
