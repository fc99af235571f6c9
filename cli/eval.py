"""`offline-paged eval --tasks TASK ... [lm-eval run flags]`: lm-evaluation-harness on offline-paged.

lm-eval loads no model plugins by itself, so this command imports our backend (registering the model
type "offline-paged"), makes it the default `--model`, and hands every other flag to lm-eval's own
`run` command unchanged: `--model_args pretrained=DIR dtype=float32`, `--include_path`, `--limit`,
`--num_fewshot`, `--output_path`, `--log_samples`, ... Without `pretrained` the default model is used.
The engine options of `generate` and `bench` (cli/engine_options.py) are ours to parse, with the same
validation; those given go to lm-eval as one more `--model_args`, under the EngineConfig / LLM names
(they win over the same keys earlier in --model_args). --model, --device and --seed are lm-eval's own.
Exit code 2 when it cannot start (lm-eval not installed) or lm-eval stops with an error (a bad task name,
model argument or model): one "error:" line, never a traceback.
"""
from __future__ import annotations

import sys

import click

from offline_paged.cli.engine_options import engine_options, given_engine_options
from offline_paged.cli.errors import CouldNotStart

# lm-eval's `run` has its own --model (the backend type), --device (handed to the backend) and --seed.
_LM_EVAL_OWN = ("model", "device", "seed")


@click.command("eval", context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
               add_help_option=False)
@engine_options(exclude=_LM_EVAL_OWN)
@click.argument("lm_eval_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def eval_command(ctx: click.Context, lm_eval_args: tuple[str, ...], **engine_values) -> None:
    """Run lm-evaluation-harness tasks on offline-paged; the other flags are lm-eval's `run` flags
    (e.g. --tasks hellaswag --model_args pretrained=DIR --limit 100). --help shows them."""
    args = _run_args(ctx, list(lm_eval_args))
    try:
        import offline_paged.entrypoints.lm_eval  # noqa: F401  (registers the "offline-paged" model type)
        from lm_eval.__main__ import cli_evaluate
    except ImportError as exc:
        raise CouldNotStart(f"lm-eval is not installed ({exc}); pip install 'offline-paged[eval]'") from None
    if "--help" in args or "-h" in args:
        click.echo(ctx.get_help() + "\n\nlm-eval's run flags:\n")
    sys.argv = ["offline-paged eval", "run", *args]  # lm-eval's parser reads sys.argv
    try:
        cli_evaluate()
    except (SystemExit, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - a bad task name, model argument or model: one line, exit 2
        raise CouldNotStart(f"lm-eval stopped: {type(exc).__name__}: {exc}") from None


def _run_args(ctx: click.Context, args: list[str]) -> list[str]:
    """lm-eval's `run` arguments: --model offline-paged unless another is named, and the engine options
    given here as one more --model_args (for our backend only)."""
    own_model = not any(a in ("--model", "-M") or a.startswith("--model=") for a in args)
    given = given_engine_options(ctx)
    if given and not own_model:
        flags = [p.opts[-1] for p in ctx.command.params if p.name in given]
        raise click.UsageError(f"{', '.join(flags)}: engine options of offline-paged's backend; with another "
                               "lm-eval --model give that backend's own --model_args")
    if own_model and "--help" not in args and "-h" not in args:
        args = ["--model", "offline-paged", *args]
    if given:
        args += ["--model_args", ",".join(f"{name}={value}" for name, value in given.items())]
    return args
