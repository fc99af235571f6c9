"""`offline-paged eval --tasks TASK ... [lm-eval run flags]`: lm-evaluation-harness on offline-paged.

lm-eval loads no model plugins by itself, so this command imports our backend (registering the model
type "offline-paged"), makes it the default `--model`, and hands every other flag to lm-eval's own
`run` command unchanged: `--model_args pretrained=DIR dtype=float32`, `--include_path`, `--limit`,
`--num_fewshot`, `--output_path`, `--log_samples`, ... Without `pretrained` the default model is used.
Exit code 2 when it cannot start (lm-eval not installed) or lm-eval stops with an error (a bad task name,
model argument or model): one "error:" line, never a traceback.
"""
from __future__ import annotations

import sys

import click

from offline_paged.cli.errors import CouldNotStart


@click.command("eval", context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
               add_help_option=False)
@click.argument("lm_eval_args", nargs=-1, type=click.UNPROCESSED)
def eval_command(lm_eval_args: tuple[str, ...]) -> None:
    """Run lm-evaluation-harness tasks on offline-paged; all flags are lm-eval's `run` flags
    (e.g. --tasks hellaswag --model_args pretrained=DIR --limit 100). --help shows them."""
    try:
        import offline_paged.entrypoints.lm_eval  # noqa: F401  (registers the "offline-paged" model type)
        from lm_eval.__main__ import cli_evaluate
    except ImportError as exc:
        raise CouldNotStart(f"lm-eval is not installed ({exc}); pip install 'offline-paged[eval]'") from None
    args = list(lm_eval_args)
    if "--help" in args or "-h" in args:
        click.echo(eval_command.help + "\n\nlm-eval's run flags:\n")
    elif not any(a in ("--model", "-M") or a.startswith("--model=") for a in args):
        args = ["--model", "offline-paged", *args]
    sys.argv = ["offline-paged eval", "run", *args]  # lm-eval's parser reads sys.argv
    try:
        cli_evaluate()
    except (SystemExit, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - a bad task name, model argument or model: one line, exit 2
        raise CouldNotStart(f"lm-eval stopped: {type(exc).__name__}: {exc}") from None
