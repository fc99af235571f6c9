"""load_model on HF directories: what loads, and every bad input failing with the file and the problem
(finding the shards: test_checkpoint.py)."""
from __future__ import annotations

import json
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from offline_paged.models.loader import load_model
from tiny_llama import make_tiny_hf_model, write_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_hf_model(path, seed=3)
    write_tiny_tokenizer(path, 97)
    return path


@pytest.fixture
def copy_dir(tiny_dir, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_dir, dst)
    return dst


def test_loads_config_weights_tokenizer(tiny_dir):
    loaded = load_model(tiny_dir)
    assert loaded.config.num_hidden_layers == 3 and loaded.config.head_dim == 8
    reference = load_file(tiny_dir / "model.safetensors")
    assert set(loaded.weights) == set(reference)
    for name, array in reference.items():
        np.testing.assert_array_equal(loaded.weights[name], array)
    assert loaded.tokenizer.eos_token_ids >= {2}
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": "w5 w6"}])
    assert ids == [1, 0, 8, 9, 2, 1, 0]  # <|im_start|> user(unk) w5 w6 <|im_end|> <|im_start|> assistant(unk)


def test_bfloat16_loads_as_views_and_converts_exactly(copy_dir):
    """Lazy views keep the checkpoint dtype; a load with xp/dtype converts to fp32, fp16 or bf16,
    bit-exact with torch's own casts."""
    weights = load_file(copy_dir / "model.safetensors")
    import torch
    from safetensors.torch import save_file as save_torch

    bf16 = {n: torch.from_numpy(w).to(torch.bfloat16) for n, w in weights.items()}
    save_torch(bf16, str(copy_dir / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    lazy = load_model(copy_dir).weights
    assert isinstance(lazy[name], np.ndarray) and lazy[name].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(lazy[name].astype(np.float32), bf16[name].float().numpy())
    for dtype, torch_dtype in ((np.float32, torch.float32), (np.float16, torch.float16),
                               (ml_dtypes.bfloat16, torch.bfloat16)):
        loaded = load_model(copy_dir, xp=np, dtype=dtype).weights
        assert set(loaded) == set(weights)
        for n, array in loaded.items():
            assert type(array) is np.ndarray and array.dtype == dtype and array.flags.c_contiguous, n
            assert _owns_memory(array), n
            expected = bf16[n].to(torch_dtype).float().numpy()
            np.testing.assert_array_equal(array.astype(np.float32), expected, err_msg=n)


def _owns_memory(array: np.ndarray) -> bool:
    """True when the array's memory is its own allocation (not a view of a file map)."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array.flags.owndata


def test_float32_checkpoint_converts_to_bfloat16_and_float16(copy_dir):
    import torch

    weights = load_file(copy_dir / "model.safetensors")
    name = "model.layers.1.self_attn.o_proj.weight"
    for dtype, torch_dtype in ((ml_dtypes.bfloat16, torch.bfloat16), (np.float16, torch.float16)):
        loaded = load_model(copy_dir, xp=np, dtype=dtype).weights
        expected = torch.from_numpy(weights[name]).to(torch_dtype).float().numpy()
        np.testing.assert_array_equal(loaded[name].astype(np.float32), expected)


def test_missing_path():
    with pytest.raises(FileNotFoundError, match="no-such-model: no such model"):
        load_model("/nonexistent/no-such-model")


def test_missing_config(copy_dir):
    (copy_dir / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json: config\.json not found"):
        load_model(copy_dir)


def test_unknown_architecture(copy_dir):
    config = json.loads((copy_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (copy_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: unsupported architecture \['GPT2LMHeadModel'\]"):
        load_model(copy_dir)


def test_unsupported_rope_scaling(copy_dir):
    config = json.loads((copy_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500.0}
    (copy_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: unsupported rope scaling type 'yarn'"):
        load_model(copy_dir)


def test_truncated_safetensors(copy_dir):
    path = copy_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"model\.safetensors: truncated safetensors file"):
        load_model(copy_dir)


def test_wrong_shape_names_file_and_tensor(copy_dir):
    weights = load_file(copy_dir / "model.safetensors")
    weights["model.layers.2.self_attn.k_proj.weight"] = np.zeros((4, 48), np.float32)
    save_file(weights, str(copy_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor model\.layers\.2\.self_attn\.k_proj\.weight "
                                         r"has shape \(4, 48\), expected \(16, 48\)"):
        load_model(copy_dir)


def test_unsupported_dtype(copy_dir):
    weights = load_file(copy_dir / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"].astype(np.int8)
    save_file(weights, str(copy_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor model\.norm\.weight has unsupported dtype I8"):
        load_model(copy_dir)


def test_missing_tensor(copy_dir):
    weights = load_file(copy_dir / "model.safetensors")
    del weights["model.layers.0.mlp.down_proj.weight"]
    save_file(weights, str(copy_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors \['model\.layers\.0\.mlp\.down_proj\.weight'\]"):
        load_model(copy_dir)


def test_garbage_header(copy_dir):
    (copy_dir / "model.safetensors").write_bytes(struct.pack("<Q", 10) + b"not json!!")
    with pytest.raises(ValueError, match=r"model\.safetensors: corrupt safetensors header"):
        load_model(copy_dir)


def test_missing_tokenizer(copy_dir):
    (copy_dir / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json: tokenizer\.json not found"):
        load_model(copy_dir)


def test_old_rope_spelling_reads_like_new():
    from offline_paged.models.config import LlamaConfig

    base = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2)
    old = LlamaConfig.from_dict(base | {"rope_theta": 5e5, "rope_scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    new = LlamaConfig.from_dict(base | {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert old == new and old.rope_theta == 5e5 and old.rope_scaling.factor == 8.0


def test_mistral_sliding_window_is_read():
    from offline_paged.models.config import LlamaConfig

    config = LlamaConfig.from_dict(dict(architectures=["MistralForCausalLM"], vocab_size=10, hidden_size=8,
                                        intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                        sliding_window=4096))
    assert config.sliding_window == 4096


# --------------------------------------------------------------------------- refuse what we do not compute
def _edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | changes))


def test_layer_count_is_checked_against_the_checkpoint_before_sizing(copy_dir, monkeypatch):
    """A hostile num_hidden_layers sizes nothing: the per-layer tensor list is never built (counted)."""
    from offline_paged.models import loader, weight_spec

    sized = []
    for module in (loader, weight_spec):
        monkeypatch.setattr(module, "expected_weight_shapes", lambda config: sized.append(config) or {})
    _edit_config(copy_dir, num_hidden_layers=1000)
    with pytest.raises(ValueError, match=r"config\.json; model\.safetensors\): num_hidden_layers is 1000 in "
                                         r"config\.json, but the checkpoint holds 3 layers"):
        load_model(copy_dir)
    assert sized == []


def test_extra_bias_tensor_is_refused_by_name(copy_dir):
    """A relabelled Qwen2 checkpoint (q/k/v biases) must not load as a Llama and compute something else."""
    weights = load_file(copy_dir / "model.safetensors")
    weights["model.layers.1.self_attn.q_proj.bias"] = np.zeros(48, np.float32)
    save_file(weights, str(copy_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.safetensors\): unexpected tensors "
                                         r"\['model\.layers\.1\.self_attn\.q_proj\.bias'\]"):
        load_model(copy_dir)


def test_rotary_inv_freq_buffers_are_tolerated(copy_dir):
    weights = load_file(copy_dir / "model.safetensors")
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    save_file(weights, str(copy_dir / "model.safetensors"))
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in load_model(copy_dir).weights


def test_untied_config_without_lm_head(copy_dir):
    weights = load_file(copy_dir / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, str(copy_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"config\.json sets tie_word_embeddings to false, but the checkpoint "
                                         r"has no lm_head\.weight"):
        load_model(copy_dir)


def test_tied_config_with_a_different_lm_head(copy_dir):
    _edit_config(copy_dir, tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"model\.safetensors: lm_head\.weight differs from "
                                         r"model\.embed_tokens\.weight, but config\.json sets tie_word_embeddings"):
        load_model(copy_dir)
    weights = load_file(copy_dir / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].copy()
    save_file(weights, str(copy_dir / "model.safetensors"))
    loaded = load_model(copy_dir)  # a redundant copy equal to the embeddings is fine
    assert loaded.config.tie_word_embeddings and "lm_head.weight" not in loaded.weights


def test_eos_outside_the_vocabulary_is_named(copy_dir):
    (copy_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 500]}))
    with pytest.raises(ValueError, match=r"end-of-sequence token id 500 .* outside the vocabulary \(vocab_size 97"):
        load_model(copy_dir)


def test_hostile_safetensors_header_fails_the_load(copy_dir):
    path = copy_dir / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["model.norm.weight"]["data_offsets"] = [-64, -64 + 4 * 48]
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor model\.norm\.weight: 'data_offsets'"):
        load_model(copy_dir)


@pytest.mark.parametrize("file,content,message", [
    ("tokenizer_config.json", "[1, 2]", r"tokenizer_config\.json: must be a JSON object, got list"),
    ("tokenizer_config.json", b"\xff\xfe{}", r"tokenizer_config\.json: not valid JSON \(UnicodeDecodeError"),
    ("tokenizer_config.json", '{"eos_token": 5}', r"tokenizer_config\.json: eos_token must be a string"),
    ("generation_config.json", '{"eos_token_id": "2"}', r"generation_config\.json: eos_token_id must be an integer"),
    ("generation_config.json", '{"bos_token_id": 1000}', r"beginning-of-sequence token id 1000 .* outside"),
    ("chat_template.jinja", b"\xff{{ x }}", r"chat_template\.jinja: not UTF-8 text"),
    ("chat_template.jinja", "{% for %}", r"chat_template\.jinja: invalid Jinja template"),
])
def test_hostile_tokenizer_files(copy_dir, file, content, message):
    path = copy_dir / file
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_model(copy_dir)


@pytest.mark.gpu
def test_load_to_cuda_equals_numpy(copy_dir):
    """load_model(xp=cupy) streams a bf16 checkpoint through the pinned ring: same values as numpy."""
    cupy = pytest.importorskip("cupy")
    import torch
    from safetensors.torch import save_file as save_torch

    weights = load_file(copy_dir / "model.safetensors")
    save_torch({n: torch.from_numpy(w).to(torch.bfloat16) for n, w in weights.items()},
               str(copy_dir / "model.safetensors"))
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32):
        on_device = load_model(copy_dir, xp=cupy, dtype=dtype).weights
        on_host = load_model(copy_dir, xp=np, dtype=dtype).weights
        for name, array in on_host.items():
            assert isinstance(on_device[name], cupy.ndarray) and on_device[name].dtype == array.dtype
            np.testing.assert_array_equal(cupy.asnumpy(on_device[name]).astype(np.float32),
                                          array.astype(np.float32), err_msg=name)
