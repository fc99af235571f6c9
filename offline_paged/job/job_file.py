"""The job's output file: append-only JSONL, one record per line, resumable after any crash.

Durability rule: each record goes out as ONE write() of the complete line (newline included),
followed by a flush. Once write() returns, the bytes are in the kernel's page cache, so a killed
process (SIGKILL included) never loses a finished record. A crash can only leave a *torn last
line* (no trailing newline) — JSON lines never contain a raw newline — and resuming truncates it.
fsync after every record is opt-in (`fsync=True`): it guards against power loss / OS crash, not
against process death, and costs a disk round trip per record. close() always fsyncs a file.

`open_output` is how a job gets its file: it must be a regular file (a device such as /dev/full, a
FIFO or a directory is refused), and the job holds an exclusive `flock` on it for its whole run, so
a second process on the same output is refused instead of writing every id twice. A write that
fails (disk full, ...) cuts the file back to the end of the last complete record and raises
OutputWriteError, so nothing already written is lost and resuming picks up cleanly.
"""
import errno
import fcntl
import io
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from offline_paged.job.job_output import is_error, record_key


@dataclass(slots=True)
class ResumeState:
    """What an existing output file already holds."""

    done_keys: set[str] = field(default_factory=set)
    error_keys: set[str] = field(default_factory=set)  # the done keys whose record is an error
    hashes: dict[str, str] = field(default_factory=dict)  # key -> request_hash (records that carry one)
    num_records: int = 0
    num_errors: int = 0
    num_torn_bytes: int = 0  # bytes of a torn last line that were cut off


STDOUT_NAME = "<stdout>"


class OutputWriteError(Exception):
    """Writing a record failed; the file ends with the last complete record."""

    def __init__(self, name: str, cause: OSError) -> None:
        if cause.errno in (errno.ENOSPC, errno.EDQUOT):
            reason = "disk full (no space left on device)"
        elif cause.errno == errno.EPIPE:
            reason = "the reader closed the pipe"
        else:
            reason = f"cannot write ({cause.strerror or cause})"
        if name == STDOUT_NAME:  # nothing on disk to resume from
            super().__init__(f"stdout: {reason}; the job stopped. Its output went to a pipe or terminal, "
                             "so there is nothing to resume: write to a file with -o OUT.jsonl to resume later")
        else:
            super().__init__(f"{name}: {reason}; the records written before are complete on disk: "
                             "fix this and run the same command again to resume")
        self.errno = cause.errno


def open_output(path: str | Path, resume: bool, fsync: bool = False) -> tuple["JsonlWriter", ResumeState]:
    """Open and lock the job's output file; with `resume`, scan it (see scan_and_repair).

    Without `resume` the file is left as it is until the caller calls `writer.start_over()` (the
    CLI does so once the model has loaded, so a job that cannot start destroys nothing).
    Raises ValueError naming the path when it cannot be the output: not a regular file, a missing
    directory, not writable, locked by another process, or not ours.
    """
    fd = _open_locked(str(path))
    try:
        state = scan_and_repair(path, fd) if resume else ResumeState()
    except BaseException:
        os.close(fd)
        raise
    stream = open(fd, "ab", buffering=0)  # the lock lives as long as this file stays open
    return JsonlWriter(stream, fsync, owns_stream=True, name=str(path)), state


def _open_locked(path: str) -> int:
    parent = Path(path).parent
    if not parent.is_dir():
        raise ValueError(f"{path}: directory {str(parent)!r} does not exist")
    _require_regular(path, os.stat(path).st_mode if os.path.exists(path) else stat.S_IFREG)
    try:  # O_NONBLOCK: a FIFO made after the check must not hang the open
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        raise ValueError(f"{path}: cannot open for writing ({exc.strerror})") from None
    try:
        _require_regular(path, os.fstat(fd).st_mode)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"{path}: another process is writing this output file (it holds the "
                         "file's lock); wait for it to finish or choose another output") from None
    except BaseException:
        os.close(fd)
        raise
    os.set_blocking(fd, True)
    return fd


def _require_regular(path: str, mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO (named pipe)",
             stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device",
             stat.S_ISSOCK: "a socket"}
    kind = next((name for test, name in kinds.items() if test(mode)), "not a regular file")
    raise ValueError(f"{path}: the output must be a regular file (or '-' for stdout), "
                     f"and this is {kind}")


def scan_and_repair(path: str | Path, fd: int | None = None) -> ResumeState:
    """Read the records in `path`, truncate a torn last line, return the keys already done.

    `fd`: an open descriptor of `path` to read and truncate through (the locked one), else the
    path is opened here. Raises ValueError if a complete line is not a JSON record (the file is not
    ours, or was edited): resuming onto it could duplicate or lose work, so the user must decide.
    """
    state = ResumeState()
    with (open(path, "r+b") if fd is None else open(os.dup(fd), "rb")) as f:
        f.seek(0)
        offset = 0
        for line_number, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                state.num_torn_bytes = len(raw)
                os.ftruncate(f.fileno(), offset)
                break
            _count(state, _parse_record(path, line_number, raw))
            offset += len(raw)
    return state


def _parse_record(path: str | Path, line_number: int, raw: bytes) -> dict[str, Any]:
    try:
        record = json.loads(raw)
        if not is_output_record(record):
            raise ValueError("not a record")
        record_key(record)
        return record
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        raise ValueError(f"{path}:{line_number}: not a job output record; refusing to resume "
                         "onto it (fix the file, or pass --no-resume to overwrite it)") from None


def is_output_record(record: Any) -> bool:
    """The shape of a record this program writes (native, scoring or OpenAI batch), which no input
    line has: an input file given as OUT must never make its own lines count as done."""
    if not isinstance(record, dict) or "error" not in record:
        return False
    if "custom_id" in record:
        return isinstance(record.get("response"), dict) and "id" in record
    return isinstance(record.get("line"), int) and isinstance(record.get("id"), (str, int))


def _count(state: ResumeState, record: dict[str, Any]) -> None:
    key = record_key(record)
    state.done_keys.add(key)
    state.num_records += 1
    state.num_errors += is_error(record)
    if is_error(record):
        state.error_keys.add(key)
    if isinstance(record.get("request_hash"), str):
        state.hashes[key] = record["request_hash"]


class JsonlWriter:
    """Writes records to a binary stream, one complete line per write(), flushed at once."""

    def __init__(self, stream: BinaryIO, fsync: bool = False, owns_stream: bool = False,
                 name: str = STDOUT_NAME) -> None:
        self._stream = stream
        self._fsync = fsync
        self._owns_stream = owns_stream  # stdout is flushed at close, never closed
        self.name = name  # for error messages

    def write(self, record: dict[str, Any]) -> None:
        """Append one record; raises OutputWriteError (the file cut back to its last complete
        record) when the bytes cannot be written."""
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
        # a lone surrogate can only sit inside a JSON string, where its escape (\ud800) is valid JSON
        data = line.encode("utf-8", errors="backslashreplace")
        size_before = self._file_size()
        try:
            self._write_all(data)
        except OSError as exc:
            self._cut_back(size_before)
            raise OutputWriteError(self.name, exc) from None

    def start_over(self) -> None:
        """Empty the file (a fresh run over an existing output); nothing to do for a stream."""
        if self._file_size() is not None:
            os.ftruncate(self._stream.fileno(), 0)

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:  # a regular file takes it in one call; loop in case of a short write
            written = self._stream.write(view)
            view = view[written if written is not None else len(view):]
        self._stream.flush()
        if self._fsync:
            self._sync()

    def _file_size(self) -> int | None:
        try:
            info = os.fstat(self._stream.fileno())
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):  # in memory
            return None
        return info.st_size if stat.S_ISREG(info.st_mode) else None

    def _cut_back(self, size: int | None) -> None:
        """Drop the torn part of a failed record (truncating needs no free space)."""
        if size is None:
            return
        try:
            os.ftruncate(self._stream.fileno(), size)
        except OSError:
            pass  # resuming cuts a torn last line anyway

    def close(self) -> None:
        """Flush, fsync and (for a file) close. Never raises: every record was flushed when it
        was written, and a failure there was reported then."""
        try:
            self._stream.flush()
        except (OSError, ValueError):
            pass
        self._sync()
        if self._owns_stream:
            self._stream.close()

    def _sync(self) -> None:
        try:
            os.fsync(self._stream.fileno())
        except (OSError, ValueError, AttributeError):  # a pipe or a terminal cannot be synced
            pass
