"""The job's output file: append-only JSONL, one record per line, resumable after any crash.

Durability rule: each record goes out as ONE write() of the complete line (newline included),
followed by a flush. Once write() returns, the bytes are in the kernel's page cache, so a killed
process (SIGKILL included) never loses a finished record. A crash can only leave a *torn last
line* (no trailing newline) — JSON lines never contain a raw newline — and resuming truncates it.
fsync after every record is opt-in (`fsync=True`): it guards against power loss / OS crash, not
against process death, and costs a disk round trip per record. close() always fsyncs a file.
"""
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from offline_paged.job_output import is_error, record_key


@dataclass(slots=True)
class ResumeState:
    """What an existing output file already holds."""

    done_keys: set[str] = field(default_factory=set)
    num_records: int = 0
    num_errors: int = 0
    num_torn_bytes: int = 0  # bytes of a torn last line that were cut off


def scan_and_repair(path: str | Path) -> ResumeState:
    """Read the records in `path`, truncate a torn last line, return the keys already done.

    Raises ValueError if a complete line is not a JSON record (the file is not ours, or was
    edited): resuming onto it could duplicate or lose work, so the user must decide.
    """
    state = ResumeState()
    with open(path, "r+b") as f:
        offset = 0
        for line_number, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                state.num_torn_bytes = len(raw)
                f.truncate(offset)
                break
            _count(state, _parse_record(path, line_number, raw))
            offset += len(raw)
    return state


def _parse_record(path: str | Path, line_number: int, raw: bytes) -> dict[str, Any]:
    try:
        record = json.loads(raw)
        record_key(record)
        return record
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        raise ValueError(f"{path}:{line_number}: not a job output record; refusing to resume "
                         "onto it (fix the file, or pass --no-resume to overwrite it)") from None


def _count(state: ResumeState, record: dict[str, Any]) -> None:
    state.done_keys.add(record_key(record))
    state.num_records += 1
    state.num_errors += is_error(record)


class JsonlWriter:
    """Writes records to a binary stream, one complete line per write(), flushed at once."""

    def __init__(self, stream: BinaryIO, fsync: bool = False, owns_stream: bool = False) -> None:
        self._stream = stream
        self._fsync = fsync
        self._owns_stream = owns_stream  # stdout is flushed at close, never closed

    @classmethod
    def open(cls, path: str | Path, append: bool, fsync: bool = False) -> "JsonlWriter":
        """Unbuffered file: append (resume) or truncate (fresh start)."""
        return cls(open(path, "ab" if append else "wb", buffering=0), fsync, owns_stream=True)

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
        # a lone surrogate can only sit inside a JSON string, where its escape (\ud800) is valid JSON
        data = line.encode("utf-8", errors="backslashreplace")
        view = memoryview(data)
        while view:  # a regular file takes it in one call; loop in case of a short write
            written = self._stream.write(view)
            view = view[written if written is not None else len(view):]
        self._stream.flush()
        if self._fsync:
            self._sync()

    def close(self) -> None:
        self._stream.flush()
        self._sync()
        if self._owns_stream:
            self._stream.close()

    def _sync(self) -> None:
        try:
            os.fsync(self._stream.fileno())
        except (OSError, ValueError, AttributeError):  # a pipe or a terminal cannot be synced
            pass
