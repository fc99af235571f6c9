"""CouldNotStart: the one way a subcommand says it could not start (or could not go on writing).

Every subcommand prints `error: <what and where>` on stderr and exits 2 for it; a bad option or
option combination is click's usage error (usage line, `Error: ...`, exit 2 too).
"""
import click

EXIT_FATAL = 2


class CouldNotStart(click.ClickException):
    exit_code = EXIT_FATAL

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)
