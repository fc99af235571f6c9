"""`offline-paged generate PROMPTS.jsonl [-o OUT.jsonl]`: run a JSONL job through the engine.

Exit codes: 0 every line succeeded; 1 some lines have error records (in this run or, when
resuming, earlier ones); 2 the job could not start (bad option, model, unreadable input, an output
or stats file that cannot be written, is not a regular file, is not ours or is locked by another
job, the same file as another of them), its output could not be written mid-run (disk full), the
input changed since OUT was written, or requests were left unwritten because their data-parallel
workers died; 3 an internal failure (a bug; traceback on stderr); 130 interrupted (Ctrl-C, SIGTERM
or SIGHUP, also during model load or shutdown, and a second one) — everything finished is on disk
and running the same command again resumes. Output and stats files are opened (and the output
locked) before the model loads, so a bad path costs nothing.
"""
import json
import os
import signal
import stat
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import click

from offline_paged.cli.engine_options import engine_config, engine_options
from offline_paged.cli.errors import CouldNotStart
from offline_paged.core.sampling_params import SamplingParams
from offline_paged.dp.dp_coordinator import WorkersLostError
from offline_paged.job.job_file import JsonlWriter, OutputWriteError, ResumeState, open_output
from offline_paged.job.job_input import default_max_line_bytes, read_lines
from offline_paged.job.job_runner import InputChangedError, JobRunner, JobSummary

# CLI flag -> SamplingParams field; only flags given on the command line become job defaults
_SAMPLING_FLAGS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
                   "repetition_penalty", "presence_penalty", "frequency_penalty", "n", "logprobs",
                   "prompt_logprobs")


@click.command("generate")
@click.argument("prompts", metavar="PROMPTS.jsonl", type=click.Path(allow_dash=True, dir_okay=False))
@click.option("-o", "--output", default="-", show_default=True, metavar="OUT.jsonl",
              type=click.Path(allow_dash=True, dir_okay=False), help="Output JSONL ('-' = stdout).")
@click.option("--served-model-name", default=None, help="The \"model\" of OpenAI responses (default: --model's value).")
@engine_options()
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Jinja chat template file for 'messages' lines (instead of the model's own).")
@click.option("--dp-stall-timeout", type=click.FloatRange(min=0, min_open=True), default=600.0,
              show_default=True, metavar="SECONDS",
              help="A data-parallel worker that holds requests and reports nothing for this long "
                   "(stopped, hung) is killed and its requests re-dealt.")
@click.option("--resume/--no-resume", default=True, show_default=True,
              help="Append to an existing OUT, skipping ids already done (--no-resume overwrites it).")
@click.option("--fsync", is_flag=True, help="fsync after every record (survives power loss; slower).")
@click.option("--stats-json", type=click.Path(dir_okay=False), default=None, help="Write the summary as JSON.")
@click.option("--max-pending", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Requests read ahead into the engine at most.")
@click.option("--max-line-bytes", type=click.IntRange(min=1), default=None,
              help="Longest input line read (longer ones get an error record unread); default "
                   "max(1 MiB, 64 B x max_model_len + 64 KiB).")
@click.option("--progress/--no-progress", default=None, help="Progress bar on stderr (default: when a terminal).")
@click.option("--max-tokens", type=int, default=None, help="Default max_tokens (a line's own value wins).")
@click.option("--min-tokens", type=int, default=None)
@click.option("--temperature", type=float, default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--top-k", type=int, default=None)
@click.option("--min-p", type=float, default=None)
@click.option("--repetition-penalty", type=float, default=None)
@click.option("--presence-penalty", type=float, default=None)
@click.option("--frequency-penalty", type=float, default=None)
@click.option("--n", "n", type=int, default=None)
@click.option("--logprobs", type=int, default=None)
@click.option("--prompt-logprobs", type=int, default=None, help="Default prompt_logprobs (top-k per prompt token).")
@click.option("--stop", multiple=True, help="Default stop string (repeatable).")
@click.option("--stop-token-ids", default=None, metavar="ID[,ID...]", help="Default stop_token_ids, comma-separated.")
@click.option("--ignore-eos", is_flag=True, default=None)
def generate(prompts: str, output: str, **options: Any) -> None:
    """Generate completions for every line of PROMPTS.jsonl; one JSON line per request in OUT.

    \b
    Input lines (one JSON object each; blank lines are skipped):
      {"id": "a", "prompt": "text", ...sampling fields}      plain completion
      {"id": "b", "messages": [{"role": "user", ...}]}       chat (the model's template)
      {"id": "c", "prompt_token_ids": [1, 2, 3]}             token ids
      {"id": "d", "context": "...", "continuation": "..."}   score: loglikelihood, is_greedy
      {"custom_id": "e", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
                                                              OpenAI Batch (/v1/completions too)
    Sampling fields use vLLM's names (max_tokens, temperature, top_p, n, stop, logprobs, ...);
    the flags below set defaults that a line's own values override.

    \b
    Exit codes: 0 every line succeeded; 1 some lines have error records (a bad line never stops
    the job); 2 could not start, the output could not be written mid-run (disk full), or requests
    were left for a rerun (data-parallel workers died); 3 internal failure (a bug);
    130 interrupted. Running the same command again resumes: finished ids are skipped.
    """
    with _sigterm_interrupts():  # SIGTERM / SIGHUP outside the job loop (loading, closing) exit 130
        defaults = _sampling_defaults(options)
        _check_paths(prompts, output, options["stats_json"])
        _check_identities(prompts, output, options["stats_json"], options["model"])
        writer, resume = _open_output(output, options)
        engine = None
        try:
            stats_file = _open_stats(options["stats_json"])
            engine = _build_engine(options)
            if not options["resume"]:
                writer.start_over()
            summary = _run(engine, writer, resume, prompts, defaults, options)
        except KeyboardInterrupt:
            click.echo(f"\naborted: {_resume_hint(output)}", err=True)
            raise
        finally:
            writer.close()
            if hasattr(engine, "close"):  # data parallel: stop the worker processes
                engine.close()
        _report(summary, stats_file, output)
    sys.exit(summary.exit_code)


def _run(engine, writer: JsonlWriter, resume: ResumeState, prompts: str,
         defaults: dict[str, Any], options: dict[str, Any]) -> JobSummary:
    progress = _progress(options["progress"], prompts)
    stop = _StopFlag()
    # data parallel: read ahead enough to keep every worker full while results come back
    max_pending = max(options["max_pending"], 2 * getattr(engine, "capacity", 0))
    max_line_bytes = options["max_line_bytes"] or default_max_line_bytes(engine.max_model_len)
    try:
        with _input_lines(prompts, max_line_bytes, stop.is_set) as lines, stop.installed():
            model_name = options["served_model_name"] or options["model"] or "SmolLM2-135M-Instruct"
            runner = JobRunner(engine, writer, defaults=defaults, model_name=model_name,
                               done_keys=resume.done_keys, done_hashes=resume.hashes,
                               done_error_keys=resume.error_keys,
                               max_pending=max_pending, progress=progress,
                               should_stop=stop.is_set)
            return runner.run(lines)
    except (OutputWriteError, InputChangedError) as exc:
        _fatal(str(exc))
    except WorkersLostError as exc:
        _fatal(f"{exc}; the records written are complete, rerun to resume")
    finally:
        if progress is not None:
            progress.close()


def _sampling_defaults(options: dict[str, Any]) -> dict[str, Any]:
    defaults = {k: options[k] for k in _SAMPLING_FLAGS if options[k] is not None}
    if options["stop"]:
        defaults["stop"] = list(options["stop"])
    if options["ignore_eos"]:
        defaults["ignore_eos"] = True
    if options["stop_token_ids"] is not None:
        defaults["stop_token_ids"] = _int_list("--stop-token-ids", options["stop_token_ids"])
    try:
        SamplingParams.from_dict(defaults)
    except ValueError as exc:
        raise click.UsageError(f"invalid default sampling flag: {exc}") from None
    return defaults


def _check_paths(prompts: str, output: str, stats_json: str | None) -> None:
    if prompts != "-":
        if not os.path.exists(prompts):
            _fatal(f"{prompts}: no such file")
        if os.path.isdir(prompts):
            _fatal(f"{prompts}: is a directory")
        if not os.access(prompts, os.R_OK):
            _fatal(f"{prompts}: cannot read it (permission denied)")
        mode = os.stat(prompts).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
            _fatal(f"{prompts}: the input must be a regular file, a pipe or '-' for stdin")


def _check_identities(prompts: str, output: str, stats_json: str | None, model: str | None) -> None:
    """The input (stdin too), OUT (stdout too), --stats-json and the model's files are compared by
    (device, inode), so a hard link, a symlink or /dev/stdin under another name is caught; exit 2
    before anything is opened for writing."""
    named = [("the input", _identity(prompts, 0)), ("the output", _identity(output, 1)),
             ("--stats-json", _identity(stats_json, None))]
    named += [(f"the model's file {name}", identity) for name, identity in _model_identities(model)]
    files = [Path(p).resolve() for p in (prompts, output, stats_json) if p not in (None, "-")]
    if len(set(files)) != len(files):  # the same name, before the files exist
        _fatal("the input, output and stats files must be three different files")
    seen: dict[tuple[int, int], str] = {}
    for what, identity in named:
        if identity is None:
            continue
        if identity in seen:
            _fatal(f"{seen[identity]} and {what} are the same file; they must be different files")
        seen[identity] = what


def _identity(path: str | None, std_fd: int | None) -> tuple[int, int] | None:
    """(device, inode) of a regular file: `path`, or for '-' the standard stream `std_fd`."""
    try:
        if path == "-" and std_fd is not None:
            info = os.fstat(std_fd)
        elif path is not None and path != "-":
            info = os.stat(path)
        else:
            return None
    except (OSError, ValueError):
        return None
    return (info.st_dev, info.st_ino) if stat.S_ISREG(info.st_mode) else None


def _model_identities(model: str | None):
    """The model's files (a .gguf file, or the files at the top of an HF directory; the default
    model's directory in the cache when no model is named)."""
    if model in (None, "default"):
        from offline_paged.models.default_model import default_model_dir

        model = str(default_model_dir())
    if not os.path.exists(model):
        return
    paths = [model] if not os.path.isdir(model) else \
        [e.path for e in os.scandir(model) if e.is_file()][:10_000]
    for path in paths:
        yield os.path.basename(path), _identity(path, None)


def _open_output(output: str, options: dict[str, Any]) -> tuple[JsonlWriter, ResumeState]:
    """The output writer, opened and locked before anything else runs; exit 2 if it can't be."""
    if output == "-":
        return JsonlWriter(sys.stdout.buffer, options["fsync"]), ResumeState()
    try:
        writer, state = open_output(output, options["resume"], options["fsync"])
    except (ValueError, OSError) as exc:
        _fatal(str(exc))
    if state.num_records or state.num_torn_bytes:
        click.echo(f"resuming {output}: {state.num_records} records already done"
                   + (f", cut a torn last line ({state.num_torn_bytes} bytes)"
                      if state.num_torn_bytes else ""), err=True)
    return writer, state


def _open_stats(stats_json: str | None) -> IO[str] | None:
    """Opened now (without truncating), so an unwritable path fails before the job, not after."""
    if stats_json is None:
        return None
    if not Path(stats_json).parent.is_dir():
        _fatal(f"{stats_json}: directory {str(Path(stats_json).parent)!r} does not exist")
    if os.path.exists(stats_json) and not stat.S_ISREG(os.stat(stats_json).st_mode):
        _fatal(f"{stats_json}: --stats-json must be a regular file")
    try:
        return open(stats_json, "a", encoding="utf-8")
    except OSError as exc:
        _fatal(f"{stats_json}: cannot open for writing ({exc.strerror})")


def _build_engine(options: dict[str, Any]):
    from offline_paged.engine import LLMEngine

    config = engine_config(options)
    if config.tensor_parallel_size != 1 and options["data_parallel_size"] != 1:
        raise click.UsageError("--tensor-parallel-size and --data-parallel-size cannot be combined yet")
    template = _read_chat_template(options["chat_template"])
    if options["data_parallel_size"] != 1:
        engine = _build_coordinator(config, options["data_parallel_size"], options["dp_stall_timeout"])
    else:
        try:
            engine = LLMEngine(config)
        except (ValueError, OSError, RuntimeError) as exc:
            _fatal(f"cannot start the engine: {exc}")
        click.echo(engine_line(engine), err=True)
    if template is not None and engine.tokenizer is not None:
        engine.tokenizer.chat_template = template  # chat lines are rendered here, in this process
    return engine


def engine_line(engine) -> str:
    """What the engine chose where the flags left it to the device, as a job's log names it before the first line
    runs: backend and dtype, the step budgets, the KV pool."""
    config, manager = engine.config, engine.block_manager
    return (f"engine: {engine.backend.name} {engine.backend.dtype.name}, max_num_seqs {config.max_num_seqs}, "
            f"max_num_batched_tokens {config.max_num_batched_tokens}, max_model_len {engine.max_model_len}, "
            f"KV pool {manager.num_gpu_blocks:,} blocks of {config.block_size} tokens")


def _int_list(flag: str, text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of token ids", param_hint=flag) from None


def _read_chat_template(path: str | None):
    """The --chat-template file as a ChatTemplate (read before the model loads: a bad file costs nothing)."""
    if path is None:
        return None
    from offline_paged.models.chat_template import ChatTemplate

    try:
        return ChatTemplate(Path(path).read_text(encoding="utf-8"), origin=path)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise click.BadParameter(f"{path}: {exc}", param_hint="--chat-template") from None


def _build_coordinator(config, data_parallel_size: int, stall_timeout_s: float):
    from offline_paged.dp.dp_coordinator import DataParallelCoordinator, worker_devices
    from offline_paged.dp.dp_worker import WorkerSpec

    try:
        worker_devices(config.device, data_parallel_size)
    except ValueError as exc:
        raise click.UsageError(f"--data-parallel-size: {exc}") from None
    try:
        return DataParallelCoordinator(WorkerSpec(config), data_parallel_size, stall_timeout_s=stall_timeout_s)
    except (ValueError, OSError, RuntimeError) as exc:
        _fatal(f"cannot start the engine: {exc}")


@contextmanager
def _input_lines(prompts: str, max_line_bytes: int, should_stop):
    """The input's lines, read as bytes and split on b"\\n" only, each at most `max_line_bytes`
    (see job_input.read_lines)."""
    if prompts == "-":
        yield read_lines(sys.stdin.buffer, max_line_bytes, should_stop)
        return
    try:
        f = open(prompts, "rb")
    except OSError as exc:
        _fatal(f"{prompts}: cannot read ({exc.strerror})")
    with f:
        yield read_lines(f, max_line_bytes, should_stop)


def count_lines(prompts: str) -> int | None:
    """Non-blank lines, for the progress bar; a pipe (stdin, <(...)) is not read twice. Read in
    1 MiB chunks, so one huge line is never held whole."""
    if prompts == "-" or not os.path.isfile(prompts):
        return None
    count, content = 0, False  # content: the line in progress holds more than blanks
    with open(prompts, "rb") as f:
        while chunk := f.read(2**20):
            *ended, rest = chunk.split(b"\n")
            for part in ended:
                count += content or bool(part.strip(b" \t\r"))
                content = False
            content = content or bool(rest.strip(b" \t\r"))
    return count + content


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGHUP: the terminal went away


@contextmanager
def _sigterm_interrupts():
    """SIGTERM and SIGHUP act like Ctrl-C (KeyboardInterrupt; the cli group turns it into exit 130)
    from the start of the command until the process exits: loading, the job (see _StopFlag), closing
    the workers, the report and the interpreter's own shutdown. The handlers are never put back, so a
    signal that lands after the command returned still exits 130, not 143."""
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _raise_interrupt)
    yield


class _StopFlag:
    """First Ctrl-C / SIGTERM asks the job to stop after the current step; a second one kills."""

    def __init__(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def _handle(self, signum, frame) -> None:
        if self._set:
            raise KeyboardInterrupt
        self._set = True
        click.echo("\nstopping after the current step (again to abort now)...", err=True)

    @contextmanager
    def installed(self):
        previous = {s: signal.signal(s, self._handle) for s in _STOP_SIGNALS}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


class _TqdmProgress:
    def __init__(self, total: int | None) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)

    def update(self, summary: JobSummary, engine_stats: Any) -> None:
        done = summary.num_succeeded + summary.num_failed + summary.num_skipped
        self._bar.update(done - self._bar.n)
        # the engine counts tokens every step: the rate shows from the first step, not the first finish
        generated = getattr(engine_stats, "num_generated_tokens", summary.num_generated_tokens)
        rate = generated / max(summary.elapsed_s, 1e-9)
        kv = getattr(engine_stats, "kv_block_usage_current", 0.0)
        self._bar.set_postfix_str(f"{rate:.1f} tok/s, KV {kv:.0%}, failed {summary.num_failed}",
                                  refresh=False)

    def close(self) -> None:
        self._bar.close()


def _progress(wanted: bool | None, prompts: str) -> _TqdmProgress | None:
    if wanted is False or (wanted is None and not sys.stderr.isatty()):
        return None
    return _TqdmProgress(count_lines(prompts))


def _resume_hint(output: str) -> str:
    if output == "-":  # nothing on disk: a rerun starts over
        return "the records finished so far went to stdout; there is no file to resume from"
    return "finished records are on disk; run the same command to resume"


def _report(summary: JobSummary, stats_file: IO[str] | None, output: str) -> None:
    d = summary.to_dict()
    e = d["engine"]
    lines = [
        f"requests: {d['requests']} ({d['succeeded']} ok, {d['failed']} failed, "
        f"{d['skipped_already_done']} already done)",
        f"tokens: {d['prompt_tokens']} prompt, {d['generated_tokens']} generated in {d['elapsed_s']:.1f} s "
        f"({d['generation_tokens_per_s']:.1f} gen tok/s, {d['total_tokens_per_s']:.1f} total tok/s)",
        f"KV cache: utilization {e.get('kv_utilization_average', 0):.1%} avg, "
        f"block usage peak {e.get('kv_block_usage_peak', 0):.1%}; "
        f"prefix-cache hit rate {e.get('prefix_cache_hit_rate', 0):.1%}; "
        f"preemptions {e.get('num_preemptions_recompute', 0) + e.get('num_preemptions_swap', 0)}",
    ]
    failed = d["failed"] + d["failed_in_earlier_runs"]
    if failed:
        lines.append(f"{failed} line(s) have error records in the output")
    if summary.num_unfinished:
        lines.append(f"{summary.num_unfinished} request(s) were on data-parallel workers that died and are "
                     "not written: run the same command again to run them")
    if summary.interrupted:
        lines.append(f"interrupted: {_resume_hint(output)}")
    click.echo("\n".join(lines), err=True)
    if stats_file is not None:
        _write_stats(stats_file, d)


def _write_stats(stats_file: IO[str], summary: dict[str, Any]) -> None:
    try:
        with stats_file:
            stats_file.truncate(0)
            stats_file.write(json.dumps(summary, indent=2) + "\n")
    except OSError as exc:
        _fatal(f"{stats_file.name}: cannot write the stats ({exc.strerror}); the job's records "
               "are complete")


def _fatal(message: str):
    raise CouldNotStart(message)
