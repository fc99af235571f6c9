"""One message style and one exit code when a subcommand cannot start: `error: ...` on stderr, exit 2."""
import pytest
from click.testing import CliRunner

from offline_paged.cli.main import cli


@pytest.mark.parametrize("args", [
    ["convert", "{tmp}/missing.gguf", "{tmp}/out"],
    ["bench", "--model", "{tmp}/no-such-model", "--device", "cpu", "--num-requests", "1"],
    ["generate", "{tmp}/in.jsonl", "-o", "{tmp}/out.jsonl", "--model", "{tmp}/no-such-model", "--device", "cpu"],
])
def test_could_not_start_is_error_colon_and_exit_2(tmp_path, args):
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "x"}\n')
    result = CliRunner().invoke(cli, [a.format(tmp=tmp_path) for a in args])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: "), result.output
    assert "no-such-model" in result.output or "missing.gguf" in result.output
    assert "Traceback" not in result.output
