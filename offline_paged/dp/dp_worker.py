"""One data-parallel worker: an LLMEngine in its own process, fed requests over a pipe.

`run_worker(index, visible_device, spec, conn)` is the target of a process started with the "spawn"
context (never fork: a forked CUDA context is unusable). It pins the process to its GPU
(CUDA_VISIBLE_DEVICES) before anything imports CuPy, builds the engine from `spec` exactly as a
single-process run would, and then loops: take every message waiting (blocking only when the engine
is idle), step the engine, send back what finished.

Messages in:  ("add", [WorkRequest, ...]), ("abort", request_id), ("stop",).
Messages out: ("ready", max_model_len, pid), ("failed", message) when the engine cannot be built,
              ("results", [RequestOutput | RequestError, ...], EngineStats).
A closed pipe (the coordinator died) ends the worker, so it never outlives its coordinator.
This module imports only the standard library and the pure config at import time: spawn unpickles
the arguments before `run_worker` runs, and nothing may import CuPy before the device is pinned.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import NamedTuple

from offline_paged.core import gc_pacing
from offline_paged.core.config import EngineConfig
from offline_paged.core.sampling_params import SamplingParams

_STATS_EVERY_S = 1.0  # an idle-looking worker still reports its stats (the progress bar's KV use)
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What every worker builds: the same EngineConfig a single-process run takes (device resolved),
    or random weights of a bench preset; `warm_up` runs a few requests before saying ready (bench);
    `cpu_threads` caps BLAS threads per worker on the CPU (None = the library's default)."""

    config: EngineConfig
    dummy_preset: str | None = None
    weights_seed: int = 0
    warm_up: bool = False
    cpu_threads: int | None = None


class WorkRequest(NamedTuple):
    """One request as it travels to a worker (the arguments of LLMEngine.add_request)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams


def run_worker(index: int, visible_device: str | None, spec: WorkerSpec, conn) -> None:
    """Process entry point; see the module docstring."""
    if visible_device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_device
    if spec.cpu_threads is not None:
        for name in _THREAD_VARIABLES:
            os.environ.setdefault(name, str(spec.cpu_threads))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the coordinator decides
    try:
        engine = _build_engine(spec)
    except Exception as exc:  # noqa: BLE001 - any failure to start is reported, not a traceback
        _send(conn, ("failed", f"{type(exc).__name__}: {exc}"))
        return
    if _send(conn, ("ready", engine.max_model_len, os.getpid())):
        _serve(engine, conn)


def _build_engine(spec: WorkerSpec):
    from offline_paged.engine import LLMEngine

    loaded = None
    if spec.dummy_preset is not None:
        from offline_paged.worker.backend import select_backend
        from offline_paged.models.dummy_weights import dummy_model

        backend = select_backend(spec.config.device, spec.config.dtype)
        loaded = dummy_model(spec.dummy_preset, backend.xp, backend.dtype, spec.weights_seed)
    engine = LLMEngine(spec.config, loaded_model=loaded)
    if spec.warm_up:
        from offline_paged.benchmark.bench import warm_up

        warm_up(engine, engine.model_config.vocab_size)
    return engine


def _serve(engine, conn) -> None:
    """Messages in, steps, results out, until ("stop",) or the pipe closes."""
    from offline_paged.core.outputs import RequestError

    last_sent = time.monotonic()
    with gc_pacing.paced():
        while True:
            refused: list[RequestError] = []
            if not _take_messages(engine, conn, refused):
                return
            finished = engine.step() if engine.has_unfinished_requests() else []
            now = time.monotonic()
            if refused or finished or now - last_sent > _STATS_EVERY_S:
                if not _send(conn, ("results", refused + finished, engine.stats)):
                    return
                last_sent = now


def _take_messages(engine, conn, refused: list) -> bool:
    """Apply every waiting message (wait for one when the engine has nothing to do); False = stop."""
    from offline_paged.core.outputs import RequestError

    while not engine.has_unfinished_requests() or conn.poll():
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return False
        if message[0] == "stop":
            return False
        if message[0] == "abort":
            engine.abort_request(message[1])
            continue
        for request in message[1]:
            try:
                engine.add_request(request.request_id, prompt=request.prompt,
                                   prompt_token_ids=request.prompt_token_ids, params=request.params)
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone, as in a single engine
                reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
                refused.append(RequestError(request.request_id, reason))
        if refused and not engine.has_unfinished_requests():
            return True  # nothing to step: hand the refusals back now
    return True


def _send(conn, message) -> bool:
    try:
        conn.send(message)
        return True
    except (OSError, ValueError):  # the coordinator is gone
        return False
