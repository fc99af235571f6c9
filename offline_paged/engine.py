"""LLMEngine: add requests, then step() until done. One step = schedule -> execute -> postprocess.

The engine owns the layers below it: a Backend (numpy/cupy + ops), an Executor (the model and the
ModelRunner, in this process or over tensor-parallel ranks), a BlockManager, the Scheduler and the
OutputProcessor. Its RequestProcessor turns prompts into SequenceGroups (validation, tokenisation,
seeds); the engine checks stop conditions (with a StopChecker) and builds RequestOutputs.
"""
from __future__ import annotations

import dataclasses
import math
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING

import numpy as np

from offline_paged.core.block_manager import BlockManager
from offline_paged.core.config import EngineConfig, fit_max_num_seqs
from offline_paged.core.engine_stats import StatsTracker
from offline_paged.core.host_cpus import HostCpus
from offline_paged.core.output_processor import OutputProcessor
from offline_paged.core.outputs import CompletionOutput, EngineStats, RequestError, RequestOutput
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.core.scheduler import Scheduler
from offline_paged.core.sequence import Sequence, SequenceGroup
from offline_paged.core.stop_checker import StopChecker
from offline_paged.executor.executor import Executor
from offline_paged.models.hub import resolve_model
from offline_paged.models.pooling import PoolingConfig
from offline_paged.request_processor import RequestProcessor
from offline_paged.worker.backend import checkpoint_dtype, select_backend
from offline_paged.worker.launched_step import LaunchedStep
from offline_paged.worker.pooling_runner import PoolingRunner
from offline_paged.worker.model_runner import DEFAULT_CPU_KV_CACHE_MEMORY, kv_block_bytes
from offline_paged.worker.sampler import Sampler
from offline_paged.worker.step_report import StepReport

if TYPE_CHECKING:
    from offline_paged.models.loader import LoadedModel



class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    `LLMEngine(config, loaded_model=None)`: loads `config.model` unless an already-loaded model
    (anything with .config, .weights, .tokenizer, e.g. a tiny random one in tests) is given.
    Requests are identified by caller-chosen string ids; `step()` returns each request once, in the
    step it finishes.
    The model and the runner sit behind an Executor (offline_paged/executor/): with `tensor_parallel_size`
    N > 1 this process is rank 0 (scheduler, block manager, sampling, shard 0) and the executor runs
    ranks 1..N-1; `loaded_model` may then also be a shard source (models/tp_source.py, e.g. a
    DummySource), and steps run synchronously. `close()` stops the ranks.
    """

    launch_ahead = True  # see `_launched_ahead` (off: the A/B's other side)

    def __init__(self, config: EngineConfig, loaded_model: LoadedModel | None = None) -> None:
        if loaded_model is None and config.model is not None:  # a hub id -> its local snapshot
            config = dataclasses.replace(config, model=str(resolve_model(config.model)))
        # dtype="auto" reads the checkpoint's config.json torch_dtype (before loading: loads convert on the way)
        source = getattr(loaded_model, "source", None) or config.model
        if loaded_model is None and config.model is None:
            from offline_paged.models.default_model import default_model_dir

            source = default_model_dir()
        self.backend = select_backend(config.device, config.dtype, checkpoint_dtype(source),
                                      f"{source}/config.json")
        # max_num_seqs and max_num_batched_tokens left to the device (None) are set here (core/config.py)
        seqs_left_to_device = config.max_num_seqs is None
        config = config.with_device_defaults(self.backend.name, self.backend.total_memory_bytes())
        self.config = config
        self.kv_cache_dtype = config.resolved_kv_cache_dtype(self.backend.name)  # "auto" | "fp8_e4m3"
        self.executor = Executor.create(config, self.backend, self.kv_cache_dtype, loaded_model)
        self._tokenizer = self.executor.tokenizer
        self.model_config = self.executor.model_config
        self.eos_token_ids = self._eos_token_ids(self._tokenizer, self.model_config)
        self.profiled_activation_bytes: int | None = None  # set when the KV pool is sized by profiling
        self.max_model_len, num_gpu_blocks, num_cpu_blocks = self._size_kv_pools(self.executor.model)
        if seqs_left_to_device:  # fewer sequences where the KV pool (sized for the device's choice) is short
            self.config = config = dataclasses.replace(config, max_num_seqs=fit_max_num_seqs(
                config.max_num_seqs, num_gpu_blocks * config.block_size, self.max_model_len))
        self.block_manager = BlockManager(num_gpu_blocks, num_cpu_blocks, config.block_size,
                                          config.watermark, config.enable_prefix_caching,
                                          self.max_model_len if config.kv_layout == "contiguous" else None)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.preemption, self.max_model_len,
                                   config.resolved_admission_batch(self.backend.name))
        self.runner = self.executor.init_runner(num_gpu_blocks, num_cpu_blocks, self.max_model_len,
                                                Sampler(self.eos_token_ids), config.max_num_seqs)
        self.processor = RequestProcessor(config, self._tokenizer, self.model_config.vocab_size, self.max_model_len,
                                          self.eos_token_ids)
        self.stop_checker = StopChecker(self._tokenizer, self.eos_token_ids, self.max_model_len)
        self.output_processor = OutputProcessor(self.scheduler, self.stop_checker)
        self._stats = StatsTracker(num_gpu_blocks, num_cpu_blocks, config.block_size)
        self.async_scheduling = self.executor.supports_async_scheduling and (
            config.async_scheduling if config.async_scheduling is not None else self.backend.name == "cuda")
        self._in_flight: LaunchedStep | None = None  # launched, outputs not yet processed
        # The next step's schedule, made while this step's structured-output masks filled (and how long it
        # took, reported as that step's schedule time); None: the next step schedules itself.
        self._scheduled_ahead: tuple | None = None
        # ... or that step launched too: (output, LaunchedStep, schedule s, launch s). Its launch queues this
        # step's sampling once the masks are in, after its own host work: only the device copies and the
        # replay are left between the masks and the next forward (`launch_ahead`; else the step loop queues
        # the sampling and the next step launches after it, all its host work between).
        self._launched_ahead: tuple | None = None
        self._groups: dict[str, SequenceGroup] = {}
        self._model_source = source  # where the model's sentence-transformers pooling files may be
        self._grammar_compiler = None  # built on the first structured-output request
        self._compiling: dict[str, tuple[SequenceGroup, Future]] = {}  # grammar not compiled yet: not scheduled

    # ----------------------------------------------------------------- set-up
    def close(self) -> None:
        """Stop the tensor-parallel ranks and the grammar compiler's threads (if any)."""
        self.executor.close()
        if self._grammar_compiler is not None:
            self._grammar_compiler.close()

    def _size_kv_pools(self, model) -> tuple[int, int, int]:
        """(max_model_len, device blocks, CPU blocks); see EngineConfig for the rules."""
        config = self.config
        block_bytes = kv_block_bytes(model.config, config.block_size, model.kv_cache_dtype)  # per rank
        model_len = config.max_model_len or self.model_config.max_position_embeddings
        num_gpu = config.num_kv_blocks or self._blocks_from_memory(block_bytes, model_len)
        if config.num_cpu_blocks is not None:
            num_cpu = config.num_cpu_blocks
        else:
            num_cpu = min(config.swap_space // block_bytes, num_gpu)
        usable = num_gpu - int(config.watermark * num_gpu)  # what one sequence can ever hold
        if usable * config.block_size < model_len:
            if config.max_model_len is not None:
                raise ValueError(
                    f"max_model_len={model_len} does not fit the KV cache ({usable * config.block_size} "
                    f"tokens in {num_gpu} blocks); raise kv_cache_memory / num_kv_blocks or lower max_model_len")
            model_len = usable * config.block_size
        if model_len < 2:
            raise ValueError(f"the KV cache ({num_gpu} blocks of {config.block_size}) is too small to run")
        return model_len, num_gpu, num_cpu

    def _cuda_kv_memory(self, model_len: int) -> int:
        """Bytes for the KV pool on CUDA (Executor.usable_kv_memory: measured by a profiling forward of the
        largest step)."""
        config = self.config
        num_tokens = min(config.max_num_batched_tokens, config.max_num_seqs * model_len)
        usable = self.executor.usable_kv_memory(num_tokens, self.eos_token_ids)
        self.profiled_activation_bytes = self.executor.profiled_activation_bytes
        return usable

    def _blocks_from_memory(self, block_bytes: int, model_len: int) -> int:
        config = self.config
        if config.kv_cache_memory is not None:
            memory = config.kv_cache_memory
        elif self.backend.name == "cuda":
            memory = self._cuda_kv_memory(model_len)
        else:
            memory = DEFAULT_CPU_KV_CACHE_MEMORY
        needed = config.max_num_seqs * math.ceil(model_len / config.block_size) + 1  # more is never used at once
        num_blocks = min(memory // block_bytes, needed)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={memory} bytes is less than one KV block ({block_bytes} bytes)")
        return int(num_blocks)

    @staticmethod
    def _eos_token_ids(tokenizer, model_config) -> tuple[int, ...]:
        ids = set(getattr(tokenizer, "eos_token_ids", ()) or ())
        ids |= set(model_config.eos_token_ids or ())
        return tuple(sorted(ids))

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def num_gpu_blocks(self) -> int:
        return self.runner.kv_cache.shape[2]

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
    ) -> None:
        """Queue one request. Give `prompt` text (tokenized by the RequestProcessor) or `prompt_token_ids` (then a
        `prompt` given too is only echoed back in the output).

        Raises ValueError for a duplicate id, an empty prompt, a prompt that leaves no room to
        generate within max_model_len, token ids outside the vocabulary (prompt or stop_token_ids),
        more samples than max_num_seqs, logprobs above max_logprobs, or beam search with
        penalties (its scores are raw log-probabilities; see beam_search.py).
        """
        params = self.processor.check_params(params)
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        group = self.processor.process(request_id, prompt, prompt_token_ids, params)
        grammar = None
        if group.params.structured_outputs is not None:
            grammar = self.grammar_compiler.submit(group.params.structured_outputs)
            if not grammar.done():  # compiles off the step loop; scheduled once it is ready
                self._compiling[request_id] = (group, grammar)
                self._groups[request_id] = group
                return
        self._admit(group, grammar)  # raises before anything is recorded
        self._groups[request_id] = group

    @property
    def grammar_compiler(self):
        """The GrammarCompiler of this engine's tokenizer (built on first use)."""
        if self._grammar_compiler is None:
            self.use_grammar_executor(None)
        return self._grammar_compiler

    @property
    def mask_server(self):
        """The MaskServer filling structured-output masks in worker processes, if one was started."""
        return None if self._grammar_compiler is None else self._grammar_compiler.mask_server

    def use_grammar_executor(self, executor) -> None:
        """Compile grammars on `executor` (a concurrent.futures.Executor; None: the compiler's own thread
        pool). Call before the first structured-output request."""
        from offline_paged.core.grammar_compiler import GrammarCompiler

        if self._grammar_compiler is not None:
            raise ValueError("the grammar compiler is already in use; choose its executor before the first "
                             "structured-output request")
        self._grammar_compiler = GrammarCompiler(self._tokenizer, self.model_config.vocab_size,
                                                 self.eos_token_ids, executor=executor,
                                                 mask_processes=self.config.resolved_grammar_mask_processes(
                                                     self.backend.name, self.async_scheduling,
                                                     HostCpus.read().usable_cores()))

    def _admit(self, group: SequenceGroup, grammar: Future | None) -> None:
        """Hand the group to the scheduler, its first sequence given a matcher of its compiled grammar.
        ValueError when the grammar did not compile or the scheduler refuses the group."""
        compiled = grammar.result() if grammar is not None else None  # re-raises the compile's ValueError
        self.scheduler.add_group(group)
        if compiled is not None:
            group.seqs[0].matcher = compiled.new_matcher()

    def _admit_compiled(self) -> list[RequestError]:
        """Schedule the requests whose grammar finished compiling (waiting for one when nothing else can
        run); a grammar that failed is its request's error."""
        if not self._compiling:
            return []
        if not self.scheduler.has_unfinished() and self._in_flight is None:
            wait_futures([future for _, future in self._compiling.values()], return_when=FIRST_COMPLETED)
        errors = []
        for request_id, (group, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                self._admit(group, future)
            except Exception as exc:  # noqa: BLE001 - a bad grammar fails its own request only
                del self._groups[request_id]
                errors.append(RequestError(request_id, str(exc) if isinstance(exc, ValueError)
                                           else f"{type(exc).__name__}: {exc}"))
        return errors

    def embed(self, prompts: list[str | list[int]], pooling: PoolingConfig | None = None) -> list[np.ndarray]:
        """Embeddings (float32 [hidden_size] each) of prompts given as text or token ids, pooled as
        `pooling` says (None: the model's sentence-transformers config, else last token, normalised).
        Runs at once in a scratch KV pool (worker/pooling_runner.py); generation in flight is untouched.
        Raises ValueError for a prompt that is empty, too long or outside the vocabulary."""
        self.executor.check_embeddings()
        pooling = PoolingConfig.from_dir(self._model_source) if pooling is None else pooling
        token_ids = [self.processor.prompt_token_ids(p if isinstance(p, str) else None,
                                                     None if isinstance(p, str) else p, generates=False)
                     for p in prompts]
        runner = PoolingRunner(self.runner.model, self.config.block_size, self.config.max_num_batched_tokens)
        return runner.embed(token_ids, pooling)

    def abort_request(self, request_id: str) -> bool:
        """Drop a queued or running request and free its blocks; True if it was unfinished."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        if self._compiling.pop(request_id, None) is None:  # one still compiling was never scheduled
            self.scheduler.abort_group(group)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or self._in_flight is not None

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput | RequestError]:
        """Run one iteration; returns the requests that finished in it (in finishing order). A request
        whose structured-output grammar failed to compile, or whose matcher failed mid-generation,
        comes back as a RequestError."""
        return self.step_with_report()[0]

    def step_with_report(self) -> tuple[list[RequestOutput], StepReport]:
        """`step`, plus the step's own StepReport (phase times, the forward's device timer).

        Synchronous loop: schedule -> launch -> wait and process this step's outputs.
        Async scheduling: schedule -> launch, then process the *previous* step's outputs while this one
        runs on the device. Its sequences were scheduled again before their tokens were known (the
        token is fed to the next step on the device); one that turns out finished has its extra token
        dropped by the output processor and its blocks freed. A step whose next inputs need its tokens
        on the host (beam search, n > 1 forks, penalties, bad words) is processed at once, as in the
        sync loop. A step with structured-output rows launches its forward only; its masks start filling
        once the previous step's tokens are known (fed to the matchers), while that step is processed and
        the forward runs; its sampling is queued by the next step's launch, or right after that processing
        when a MaskServer asks for it (LateSamples.early). The report splits the post phase: the wait for
        the previous step's samples, and the feeding and mask-fill start. While such masks fill, the next step
        is scheduled and launched (`_launched_ahead`), its launch queueing this step's sampling after its host
        work; a request added or aborted in between is seen one step later, as one aborted while its step is
        in flight already is.
        """
        t0 = time.perf_counter()
        outputs: list = self._admit_compiled()
        if self._launched_ahead is not None:
            (output, launched, schedule_s, execute_s), self._launched_ahead = self._launched_ahead, None
            t2 = time.perf_counter()
            schedule_s += t2 - t0
        else:
            if self._scheduled_ahead is not None:
                (output, schedule_s), self._scheduled_ahead = self._scheduled_ahead, None
            else:
                output, schedule_s = self._schedule(), None
            t1 = time.perf_counter()
            schedule_s = t1 - t0 if schedule_s is None else schedule_s + (t1 - t0)
            launched = self.executor.execute(output, self._in_flight, defer_grammar_sampling=self.async_scheduling)
            t2 = time.perf_counter()
            execute_s = t2 - t1
        previous, self._in_flight = self._in_flight, None
        token_wait = 0.0
        if previous is not None:
            previous.wait()  # its samples on the host (read again below, from the step's cache)
            token_wait = time.perf_counter() - t2
        mask_dispatch = 0.0
        if launched.sampling_deferred:
            t3 = time.perf_counter()
            if previous is not None:  # the matchers consume the previous step's tokens first
                self.stop_checker.feed_matchers_ahead(previous.output, previous.wait().results)
            launched = self.executor.launch_deferred_sampling(launched)  # its masks fill elsewhere...
            mask_dispatch = time.perf_counter() - t3
        if previous is not None:
            outputs += self._process(previous)  # ...while the previous step is processed
        in_flight = self.async_scheduling and output.scheduled and not _needs_host_tokens(output)
        if in_flight:
            self._in_flight = launched
        ahead_s = 0.0
        if in_flight and launched.samples_early:
            # The masks still fill (a MaskServer's fill outlasts the processing): schedule the next step now
            # rather than after queueing this step's sampling, so the host's wait for them does work. The next
            # step's device work is still queued after this sampling, by the next step's launch.
            t3 = time.perf_counter()
            ahead = self._schedule()
            t4 = time.perf_counter()
            if self.launch_ahead:
                self._launched_ahead = (ahead, self.executor.execute(ahead, launched, defer_grammar_sampling=True),
                                        t4 - t3, time.perf_counter() - t4)
            else:
                self._scheduled_ahead = (ahead, t4 - t3)
            ahead_s = time.perf_counter() - t3
        launched.queue_early_sampling()  # (masks from a MaskServer that asks for it; launched ahead: queued)
        if not in_flight:
            outputs += self._process(launched)
        report = StepReport(output.scheduled, schedule_s, execute_s, time.perf_counter() - t2 - ahead_s,
                            launched.forward_timer, launched.used_cuda_graph, token_wait, mask_dispatch)
        return outputs, report

    def _schedule(self):
        """The scheduler's next step, recorded in the stats. RuntimeError when it schedules nothing while
        requests wait and nothing is in flight (the KV cache is too small for them)."""
        output = self.scheduler.schedule()
        if output.is_empty and self._in_flight is None and self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler could not schedule anything although requests are "
                               "waiting; the KV cache is too small for them")
        self._stats.record_schedule(output, self.scheduler)
        return output

    def _process(self, launched: LaunchedStep) -> list[RequestOutput]:
        executed = launched.wait()
        finished = self.output_processor.process(launched.output, executed.results)
        self._stats.record_postprocess(executed.num_samples)
        return [self._finish(group) for group in finished]

    def _finish(self, group: SequenceGroup) -> RequestOutput | RequestError:
        del self._groups[group.request_id]
        failed = next((seq.error for seq in group.seqs if seq.error is not None), None)
        if failed is None and group.beam is not None:
            failed = group.beam.error  # every beam dropped by its grammar, no hypothesis left
        if failed is not None:  # a grammar matcher refused a token: the request ends with that error
            self._stats.record_finished(group)
            return RequestError(group.request_id, f"structured output failed: {failed}")
        seqs = group.seqs if group.beam is None else group.beam.best(group.params.n)
        if len(seqs) > group.params.n:  # best_of > n: keep the n most likely
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:group.params.n]
        outputs = [self._completion(index, seq) for index, seq in enumerate(seqs)]
        if group.scoring_only:
            outputs = [CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=0.0,
                                        logprobs=None, finish_reason="length")]
        self._stats.record_finished(group)
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt,
            prompt_token_ids=list(group.prompt_token_ids), prompt_logprobs=group.prompt_logprobs,
            outputs=outputs, finished=True, num_cached_tokens=group.num_cached_tokens,
        )

    def _completion(self, index: int, seq: Sequence) -> CompletionOutput:
        return CompletionOutput(
            index=index, text=self.stop_checker.final_text(seq), token_ids=seq.output_token_ids,
            cumulative_logprob=seq.cumulative_logprob, logprobs=seq.logprobs,
            finish_reason=seq.finish_reason.value, stop_reason=seq.stop_reason,
            finished_by_eos=seq.finished_by_eos,
        )

    @property
    def stats(self) -> EngineStats:
        return self._stats.snapshot(self.scheduler)


def _needs_host_tokens(output) -> bool:
    """Whether the next schedule needs this step's sampled tokens on the host: forks (n > 1 samples of
    a row), beam steps, penalties and bad words (the sampler reads the token history). Structured output
    does not: the next step's masks wait for this step's processing (`launch_deferred_sampling`)."""
    for item in output.scheduled:
        if not item.num_samples:
            continue
        params, group = item.seq.group.params, item.seq.group
        if item.num_samples > 1 or group.beam is not None or params.needs_token_history:
            return True
    return False
