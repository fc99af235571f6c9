"""Ray Data integration: `ds.map_batches(Processor, ...)` runs the JSONL job's records on a cluster.

    ds = ray.data.read_text("job.jsonl")  # one raw JSONL line per row, in column "text"
    out = ds.map_batches(Processor, fn_constructor_kwargs={"model": "/models/x", "raw_column": "text"},
                         concurrency=4, num_gpus=1, batch_size=256)

`Processor` is a callable class, so Ray builds one per actor: one LLMEngine per actor (per GPU with
`num_gpus=1`; Ray sets the actor's CUDA_VISIBLE_DEVICES). Each batch goes through the JSONL job's
own JobRunner, so a whole batch is continuously batched in the engine, the input records are the
job's (native, scoring and OpenAI batch lines) and so are the output records. Rows are either raw
JSONL lines (`raw_column`) or structured columns named like the job's fields (e.g. read from
Parquet); None / NaN cells are absent fields.

Output: exactly one row per input row, whatever its cells hold (a blank or None row, a datetime,
bytes that are not UTF-8: an error row each), in input order, with columns `id` (the id or custom_id), `error`
(None, or the error message: a bad row is data, never an exception that kills the stage), `text`
(the first completion's text for native completion records, else None) and `record` (the job's
output record as JSON). A row without an id gets `line-N`, N its position in its batch: give rows
ids when they must be unique across batches; duplicates are found within a batch only.
Nothing here imports Ray; the optional extra `offline-paged[ray]` installs it.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from offline_paged.job.job_input import LineError, default_id
from offline_paged.job.job_output import is_error
from offline_paged.job.job_runner import JobRunner, is_blank


class Processor:
    """One engine; `__call__(batch) -> batch` runs a batch of job records through it.

    `Processor(model=None, *, raw_column=None, defaults=None, model_name=None, **engine_kwargs)`:
    engine_kwargs are EngineConfig fields (device, dtype, max_num_seqs, ...); `defaults` are the
    job-wide sampling defaults (`generate --max-tokens` etc.), a row's own fields win.
    """

    def __init__(self, model: str | None = None, *, raw_column: str | None = None,
                 defaults: Mapping[str, Any] | None = None, model_name: str | None = None,
                 **engine_kwargs: Any) -> None:
        from offline_paged.core.config import EngineConfig
        from offline_paged.engine import LLMEngine

        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self.raw_column = raw_column
        self.defaults = dict(defaults or {})
        self.model_name = model_name or model or "default"

    def __call__(self, batch) -> dict[str, list]:
        lines = self._lines(batch)  # one per row, blank ones included: row N is always line N
        collector = _Collector()
        JobRunner(self.engine, collector, defaults=self.defaults, model_name=self.model_name,
                  max_pending=max(len(lines), 1)).run(lines)
        records = sorted(collector.records, key=_line_number)  # completion order -> input order
        return {
            "id": [r.get("custom_id") or r.get("id") for r in records],
            "error": [_error_message(r) for r in records],
            "text": [r.get("text") if "outputs" in r else None for r in records],
            "record": [json.dumps(r, ensure_ascii=False) for r in records],
        }

    def _lines(self, batch) -> list[str | _BadRow]:
        rows = _rows(batch)
        if self.raw_column is not None:
            return [_non_blank(_raw_line(row.get(self.raw_column))) for row in rows]
        return [_row_line(row) for row in rows]


@dataclass(frozen=True, slots=True)
class _BadRow:
    """A row that cannot become a job line; JobRunner turns it into that row's error record."""

    reason: str

    def error(self, line_number: int) -> LineError:
        return LineError(line_number, default_id(line_number), "invalid_request",
                         f"line {line_number}: {self.reason}")


class _NotJson(ValueError):
    pass


def _non_blank(line: str) -> str | _BadRow:
    return _BadRow("the row is blank (no JSON object)") if is_blank(line) else line


def _row_line(row) -> str | _BadRow:
    if not isinstance(row, Mapping):
        return _BadRow(f"the row is {type(row).__name__}, not a set of columns")
    try:
        return json.dumps(_plain_row(row), ensure_ascii=False, allow_nan=False)
    except _NotJson as exc:
        return _BadRow(str(exc))
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        return _BadRow(f"the row cannot be written as JSON ({type(exc).__name__}: {str(exc)[:200]})")


class _Collector:
    """The job writer's seam: keeps records instead of appending them to a file."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)


def _rows(batch) -> list[dict[str, Any]]:
    """A Ray batch (dict of columns, a pandas DataFrame or a pyarrow Table) as a list of row dicts."""
    if hasattr(batch, "to_pylist"):  # pyarrow.Table
        return batch.to_pylist()
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas.DataFrame
        return batch.to_dict("records")
    columns = {name: list(values) for name, values in batch.items()}
    num_rows = len(next(iter(columns.values()), []))
    return [{name: values[i] for name, values in columns.items()} for i in range(num_rows)]


def _raw_line(value) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="surrogateescape")
    return "" if value is None else str(value)


def _plain_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """Cells as JSON values: NumPy scalars and arrays become Python ones; None / NaN mean absent."""
    return {name: _plain(value) for name, value in row.items() if not _missing(value)}


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _plain(value):
    if hasattr(value, "tolist"):  # numpy array or scalar
        value = value.tolist()
    if isinstance(value, Decimal):  # a Parquet decimal column
        value = int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, (bytes, bytearray)):  # a binary column: its text, when it is UTF-8
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise _NotJson("a cell holds bytes that are not UTF-8 text") from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        return int(value)  # an int column with gaps arrives as floats (max_tokens 16.0)
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items() if not _missing(v)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is not None and not isinstance(value, (str, int, float, bool)):
        raise _NotJson(f"a cell holds a {type(value).__name__}, which is not a JSON value")
    return value


def _line_number(record: dict[str, Any]) -> int:
    if "line" in record:
        return record["line"]
    return int(record["id"].rsplit("line", 1)[1])  # OpenAI envelope: batch_req_<run>_line<N>


def _error_message(record: dict[str, Any]) -> str | None:
    if not is_error(record):
        return None
    if "custom_id" in record:
        body = (record.get("response") or {}).get("body") or {}
        return ((body.get("error") or {}).get("message")
                or (record.get("error") or {}).get("message") or "error")
    return record["error"]["message"]
