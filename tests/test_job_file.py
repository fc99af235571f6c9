"""The job's output file under faults: refused targets, the lock, failed writes cut back cleanly."""
import errno
import io
import json
import os

import pytest

from offline_paged.job import job_file
from offline_paged.job.job_file import JsonlWriter, OutputWriteError, open_output, scan_and_repair

RECORD = {"id": "a", "line": 1, "text": "x", "error": None}


@pytest.mark.parametrize("device", ["/dev/full", "/dev/zero", "/dev/null"])
def test_a_device_is_refused_as_output(device):
    if not os.path.exists(device):
        pytest.skip(f"{device} is missing here")
    with pytest.raises(ValueError, match=f"{device}: the output must be a regular file.*character device"):
        open_output(device, resume=True)


def test_a_fifo_is_refused_by_name_without_blocking(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"pipe: the output must be a regular file.*FIFO"):
        open_output(fifo, resume=True)


def test_a_directory_and_a_missing_directory_are_refused(tmp_path):
    with pytest.raises(ValueError, match="a directory"):
        open_output(tmp_path, resume=False)
    with pytest.raises(ValueError, match="'.*nope' does not exist"):
        open_output(tmp_path / "nope" / "out.jsonl", resume=False)


def test_a_read_only_filesystem_is_refused_naming_the_path(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):  # as os.open fails on a read-only mount (root included)
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(job_file.os, "open", read_only)
    with pytest.raises(ValueError, match="out.jsonl: cannot open for writing .Read-only file system"):
        open_output(tmp_path / "out.jsonl", resume=True)


def test_a_second_writer_is_refused_and_changes_nothing(tmp_path):
    out = tmp_path / "out.jsonl"
    first, _ = open_output(out, resume=False)
    first.start_over()
    first.write(RECORD)
    with pytest.raises(ValueError, match="another process is writing this output file"):
        open_output(out, resume=False)  # --no-resume must not truncate under the lock
    assert json.loads(out.read_text()) == RECORD
    first.close()
    second, state = open_output(out, resume=True)  # the lock goes with the first writer
    assert state.done_keys == {"a"}
    second.close()


def test_open_output_resumes_through_the_locked_descriptor(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(RECORD) + '\n{"id": "b", "li')
    writer, state = open_output(out, resume=True)
    assert state.done_keys == {"a"} and state.num_torn_bytes > 0
    writer.write({**RECORD, "id": "b"})
    writer.close()
    assert scan_and_repair(out).done_keys == {"a", "b"}


class DiskFullAfter(io.FileIO):
    """A real file that takes `budget` more bytes, then fails like a full disk (half a record)."""

    def __init__(self, path, budget: int) -> None:
        super().__init__(path, "ab")
        self.budget = budget

    def write(self, data) -> int:
        if self.budget <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        taken = super().write(bytes(data)[: self.budget])
        self.budget -= taken
        return taken


def test_disk_full_mid_record_says_so_and_leaves_only_complete_records(tmp_path):
    out = tmp_path / "out.jsonl"
    first_line = json.dumps(RECORD, separators=(",", ":")) + "\n"
    writer = JsonlWriter(DiskFullAfter(out, len(first_line) + 10), owns_stream=True, name=str(out))
    writer.write(RECORD)
    with pytest.raises(OutputWriteError, match=f"{out}: disk full") as info:
        writer.write({**RECORD, "id": "b"})
    assert info.value.errno == errno.ENOSPC and "run the same command again" in str(info.value)
    writer.close()
    assert out.read_text() == first_line  # the torn half record was cut back


def test_another_write_failure_names_its_cause():
    class Broken(io.BytesIO):
        def write(self, data):
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    writer = JsonlWriter(Broken(), name="out.jsonl")
    with pytest.raises(OutputWriteError, match="out.jsonl: the reader closed the pipe"):
        writer.write(RECORD)
    writer.close()  # never raises


def test_a_closed_stdout_says_there_is_nothing_to_resume():
    """`generate ... | head -1`: stdout is a pipe, so "rerun to resume" would be a false promise."""
    class Broken(io.BytesIO):
        def write(self, data):
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    with pytest.raises(OutputWriteError, match="stdout: the reader closed the pipe") as info:
        JsonlWriter(Broken()).write(RECORD)
    assert "nothing to resume" in str(info.value) and "run the same command again" not in str(info.value)


def test_without_resume_the_file_is_kept_until_start_over(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("not ours\n")
    writer, state = open_output(out, resume=False)
    assert state.done_keys == set() and out.read_text() == "not ours\n"
    writer.start_over()
    writer.write(RECORD)
    writer.close()
    assert json.loads(out.read_text()) == RECORD
