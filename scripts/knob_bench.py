"""`offline-paged` with module or class attributes set first: the device A/Bs of experiment knobs that have no flag
(e.g. `LLMEngine.launch_ahead`, `bench.RECORD_HOST_LOAD`).

    python3 scripts/knob_bench.py DOTTED.NAME=VALUE [...] bench ARGS...
    e.g. BENCH="python3 scripts/knob_bench.py offline_paged.engine.LLMEngine.launch_ahead=False" \\
         scripts/device_structured.sh

DOTTED.NAME: a module's path, then the attribute (a class's too); VALUE: a Python literal. A name that does not
exist already is refused, so a typo never runs the bench unchanged.
"""
import ast
import importlib
import sys


def set_knob(assignment: str) -> None:
    name, _, text = assignment.partition("=")
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        break
    else:
        raise SystemExit(f"knob_bench.py: {name}: no module to import in it")
    try:
        for part in parts[split:-1]:
            target = getattr(target, part)
        getattr(target, parts[-1])
    except AttributeError:
        raise SystemExit(f"knob_bench.py: {name} does not exist") from None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise SystemExit(f"knob_bench.py: {assignment}: the value is not a Python literal") from None
    setattr(target, parts[-1], value)
    print(f"knob_bench.py: {name} = {value!r}", file=sys.stderr)


def run_with_knobs(argv: list[str]) -> None:
    """Set the leading DOTTED.NAME=VALUE arguments (none is fine), then run `offline-paged` on the rest."""
    count = 0
    while count < len(argv) and "=" in argv[count] and not argv[count].startswith("-"):
        set_knob(argv[count])
        count += 1
    from offline_paged.cli.main import cli

    cli(argv[count:], prog_name="offline-paged")


def main(argv: list[str]) -> None:
    if not argv or "=" not in argv[0] or argv[0].startswith("-"):
        raise SystemExit("usage: knob_bench.py DOTTED.NAME=VALUE [...] bench ARGS...")
    run_with_knobs(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
