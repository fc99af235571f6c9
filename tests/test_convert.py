"""convert_gguf (models/convert.py): a GGUF written out as an HF directory loads back identically —
weights, config, tokenizer and chat template."""
from __future__ import annotations

import numpy as np

from offline_paged.models.loader import load_model

from test_gguf_import import TEXTS, ours, smol_gguf  # noqa: F401 (fixtures)


def test_convert_round_trip_loads_back_identically(ours, smol_gguf, tmp_path):
    from offline_paged.models.convert import convert_gguf

    config, weights, tokenizer = ours
    loaded = load_model(convert_gguf(smol_gguf, tmp_path / "hf"))
    assert loaded.config == config
    assert set(loaded.weights) == set(weights)
    for name, array in weights.items():
        np.testing.assert_array_equal(loaded.weights[name], array, err_msg=name)
    for text in TEXTS:
        assert loaded.tokenizer.encode(text) == tokenizer.encode(text)
    assert loaded.tokenizer.eos_token_ids == tokenizer.eos_token_ids
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert loaded.tokenizer.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)


def test_the_converted_weights_file_gets_the_mode_of_the_other_files(tmp_path):
    """safetensors creates its file 0600; a converted model must be readable by whoever can read the rest."""
    import os

    from fixtures_tiny_model import write_tiny_model

    from offline_paged.models.convert import write_hf_dir

    tiny = load_model(write_tiny_model(tmp_path / "src"))
    old_umask = os.umask(0o022)
    try:
        out = write_hf_dir(tmp_path / "out", tiny.config, {k: np.asarray(v) for k, v in tiny.weights.items()},
                           tiny.tokenizer)
    finally:
        os.umask(old_umask)
    modes = {path.name: path.stat().st_mode & 0o777 for path in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o644
