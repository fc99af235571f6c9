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
