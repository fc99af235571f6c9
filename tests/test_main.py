"""The `offline-paged` group (cli/main.py): every subcommand registered, -h and --version, and Ctrl-C
inside any command exits 130 with "interrupted" instead of click's "Aborted!"."""
from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from offline_paged.cli.main import EXIT_INTERRUPTED, _Group, cli


def test_every_subcommand_is_registered_and_listed_in_help():
    assert set(cli.commands) == {"generate", "pull", "convert", "bench", "eval"}
    result = CliRunner().invoke(cli, ["-h"])
    assert result.exit_code == 0, result.output
    for name in cli.commands:
        assert f"  {name}" in result.output


def test_version_names_the_package():
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0, result.output
    assert "version" in result.output


@pytest.mark.parametrize("exc, code", [(KeyboardInterrupt, EXIT_INTERRUPTED), (click.ClickException("no"), 1)])
def test_keyboard_interrupt_in_a_command_exits_130_other_errors_unchanged(exc, code):
    @click.group(cls=_Group)
    def group() -> None:
        pass

    @group.command()
    def work() -> None:
        raise exc

    result = CliRunner().invoke(group, ["work"])
    assert result.exit_code == code, result.output
    assert "Aborted!" not in result.output
    assert ("interrupted" in result.output) == (code == EXIT_INTERRUPTED)
