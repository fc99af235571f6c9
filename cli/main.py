"""The `offline-paged` command: a click group; each subcommand lives in its own module."""
import traceback

import click

EXIT_INTERNAL = 3  # a bug: an exception nothing expected (its traceback goes to stderr)
EXIT_INTERRUPTED = 130


class _Group(click.Group):
    """Ctrl-C that reaches a command (during model load, or a second one during a job) exits 130,
    instead of click's "Aborted!" and exit 1; an unexpected exception (an internal failure, never a
    bad line) exits 3 with its traceback, so that exit 1 keeps meaning "some lines have error records"."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except BaseException as exc:  # noqa: BLE001 - anything else (a Rust panic too) is our bug
            if isinstance(exc, (SystemExit, GeneratorExit)):
                raise
            click.echo(traceback.format_exc(), err=True, nl=False)
            click.echo(f"internal error (exit {EXIT_INTERNAL}): this is a bug in offline-paged; the records "
                       "already written are complete and running the same command again resumes", err=True)
            ctx.exit(EXIT_INTERNAL)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="offline-paged")
def cli() -> None:
    """Offline batch LLM inference on PagedAttention: JSONL prompts in, JSONL completions out."""


# Subcommands register here, one line each (imports kept below the group on purpose).
from offline_paged.cli.generate import generate  # noqa: E402
cli.add_command(generate)
from offline_paged.cli.model_commands import pull  # noqa: E402
cli.add_command(pull)
from offline_paged.cli.model_commands import convert  # noqa: E402
cli.add_command(convert)
from offline_paged.cli.bench import bench  # noqa: E402
cli.add_command(bench)
from offline_paged.cli.eval import eval_command  # noqa: E402
cli.add_command(eval_command)
