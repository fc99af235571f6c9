"""The `offline-paged` command: a click group; each subcommand lives in its own module."""
import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
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
