"""GGUF import vs transformers' own GGUF loading (weights and tokenizer), dequantization per type
and bad GGUF input (the convert round trip: test_convert.py)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from offline_paged.models.gguf_import import SUPPORTED_QUANT_TYPES, import_gguf, open_gguf
from offline_paged.models.loader import load_model

TEXTS = [
    "Hello, world!", "  leading spaces and\ttabs\n\nnewlines", "naïve café, Straße, 東京, Ελληνικά, русский",
    "emoji: 😀👍🏽 🇫🇷 👨‍👩‍👧", "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < 10; ++i) {}",
    "numbers 12345 and 3.14159, year 2024", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|> between <repo_name> specials", "",
]


@pytest.fixture(scope="module")
def smol_gguf(tmp_path_factory):
    from offline_paged.models.default_model import extract_gguf

    return extract_gguf(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def ours(smol_gguf):
    return import_gguf(smol_gguf)


@pytest.fixture(scope="module")
def hf_from_gguf(smol_gguf):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=smol_gguf.name)
    model = AutoModelForCausalLM.from_pretrained(smol_gguf.parent, dtype=torch.float32, **kwargs)
    return model, AutoTokenizer.from_pretrained(smol_gguf.parent, **kwargs)


def test_weights_equal_transformers_gguf_loading(ours, hf_from_gguf):
    config, weights, _ = ours
    state = {k: v.numpy() for k, v in hf_from_gguf[0].state_dict().items()}
    assert config.tie_word_embeddings and "lm_head.weight" not in weights
    assert set(weights) == set(state) - {"lm_head.weight"}
    for name, array in weights.items():
        np.testing.assert_array_equal(array, state[name], err_msg=name)


def test_config_matches_published_smollm2(ours):
    config = ours[0]
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.vocab_size) == (30, 576, 9, 3, 64, 49152)
    assert config.rope_theta == 1e5 and config.rms_norm_eps == 1e-5


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_ids_equal_transformers(ours, hf_from_gguf, text):
    tokenizer = ours[2]
    hf_tok = hf_from_gguf[1]
    assert tokenizer.encode(text) == hf_tok(text)["input_ids"]
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_special_tokens_and_chat_template(ours):
    tokenizer = ours[2]
    assert tokenizer.eos_token_ids == frozenset({2})
    assert tokenizer.encode("<|im_start|><|im_end|>") == [1, 2]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode([1, 28120, 2]) == "hello"  # specials skipped by default


def test_digits_are_split_one_by_one(ours):
    """tokenizer.ggml.pre = 'smollm': every digit is its own pre-token (as llama.cpp and the HF original)."""
    tokenizer = ours[2]
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode("x=2024")]
    assert pieces[-4:] == ["2", "0", "2", "4"]


# Q5_0 / Q5_1 are read by gguf too, but transformers has no dequantizer for them to compare with.
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1",
                                  "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_dequantize_matches_transformers(tmp_path, kind):
    """Random raw blocks of each type, written to a GGUF, read back by us and by transformers' dequant."""
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    from offline_paged.models.gguf_import import dequantize_tensor

    qtype = GGMLQuantizationType[kind]
    block, type_size = GGML_QUANT_SIZES[qtype]
    rows, cols = 4, 512
    raw = _random_blocks(np.random.default_rng(qtype.value), kind, rows * cols // block, type_size)
    path = tmp_path / "q.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", raw.reshape(rows, -1), raw_dtype=qtype)  # [rows, row bytes]
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    tensor = open_gguf(path).tensors[0]
    ours = dequantize_tensor(tensor, path)  # [rows, cols]
    assert ours.shape == (rows, cols) and ours.dtype == np.float32
    theirs = hf_dequantize(torch.from_numpy(raw.copy()), qtype.value).reshape(rows, cols).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)


def _random_blocks(rng, kind, num_blocks, type_size):
    """Random block bytes whose fp16 scale fields are finite, small numbers (0.01-1)."""
    raw = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    halves = (rng.uniform(0.01, 1.0, size=(num_blocks, type_size // 2))).astype(np.float16).view(np.uint8)
    scale_bytes = {"Q8_0": [0, 2], "Q4_0": [0, 2], "Q5_0": [0, 2], "Q4_1": [0, 4], "Q5_1": [0, 4],
                   "Q2_K": [type_size - 4, type_size], "Q3_K": [type_size - 2, type_size],
                   "Q4_K": [0, 4], "Q5_K": [0, 4], "Q6_K": [type_size - 2, type_size]}
    lo, hi = scale_bytes[kind]
    raw[:, lo:hi] = halves[:, lo:hi]
    return raw


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_float_tensors_read_exactly(tmp_path, dtype):
    from gguf import GGUFWriter

    from offline_paged.models.gguf_import import dequantize_tensor

    values = np.random.default_rng(0).standard_normal((6, 40)).astype(dtype)  # [rows, cols]
    path = tmp_path / "f.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", values)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    ours = dequantize_tensor(open_gguf(path).tensors[0], path)
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, values.astype(np.float32))


def test_unsupported_quant_type_is_named(tmp_path):
    from gguf import GGMLQuantizationType, GGUFWriter

    path = tmp_path / "iq.gguf"
    writer = GGUFWriter(str(path), "llama")
    raw = np.zeros((1, 66), np.uint8)  # one IQ2_XXS block of 256 values
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=GGMLQuantizationType.IQ2_XXS)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    from offline_paged.models.gguf_import import dequantize_tensor

    with pytest.raises(ValueError, match=r"iq\.gguf: tensor blk\.0\.ffn_up\.weight has unsupported type IQ2_XXS"):
        dequantize_tensor(open_gguf(path).tensors[0], path)
    assert "IQ2_XXS" not in SUPPORTED_QUANT_TYPES


def test_unknown_architecture_is_named(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "phi.gguf"
    writer = GGUFWriter(str(path), "phi2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"phi\.gguf: GGUF architecture 'phi2' is not supported"):
        import_gguf(path)


def test_truncated_gguf_is_named(smol_gguf, tmp_path):
    path = tmp_path / "cut.gguf"
    with smol_gguf.open("rb") as f:
        path.write_bytes(f.read(1_000_000))
    with pytest.raises(ValueError, match=r"cut\.gguf: not a readable GGUF file"):
        import_gguf(path)


def test_missing_gguf_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf: GGUF file not found"):
        import_gguf(tmp_path / "nope.gguf")


def test_unpermute_inverts_llama_cpp_permute():
    """llama.cpp's convert permutes with reshape(n_head, 2, rows/n_head/2, cols).swapaxes(1, 2)."""
    from offline_paged.models.gguf_import import unpermute_rows

    w = np.arange(24 * 5, dtype=np.float32).reshape(24, 5)  # [rows, cols], 3 heads of 8 rows
    permuted = w.reshape(3, 2, 4, 5).swapaxes(1, 2).reshape(24, 5)
    np.testing.assert_array_equal(unpermute_rows(permuted, 3), w)
    assert not np.array_equal(permuted, w)


# --------------------------------------------------------------------------- hostile GGUF files
from tiny_gguf import DROP, write_tiny_gguf  # noqa: E402

HOSTILE_GGUF = {
    "bos_1e9": (dict(overrides={"tokenizer.ggml.bos_token_id": 10**9}),
                r"GGUF metadata tokenizer\.ggml\.bos_token_id: bos_token_id 1000000000 is not a token id"),
    "eot_1e9": (dict(overrides={"tokenizer.ggml.eot_token_id": 10**9}),
                r"GGUF metadata tokenizer\.ggml\.eot_token_id = 1000000000 is not a token id"),
    "heads_zero": (dict(overrides={"llama.attention.head_count": 0}),
                   r"GGUF metadata llama\.attention\.head_count must be > 0"),
    "heads_string": (dict(overrides={"llama.attention.head_count": "two"}),
                     r"GGUF metadata llama\.attention\.head_count must be an integer, got 'two'"),
    "blocks_1e9": (dict(overrides={"llama.block_count": 10**9}), r"GGUF metadata llama\.block_count: num_hidden"),
    "blocks_more_than_tensors": (dict(overrides={"llama.block_count": 5}),
                                 r"llama\.block_count is 5, but the checkpoint holds 2 layers"),
    "no_tokens": (dict(overrides={"tokenizer.ggml.tokens": DROP}), r"key 'tokenizer\.ggml\.tokens' is missing"),
    "tokens_not_strings": (dict(overrides={"tokenizer.ggml.tokens": [1, 2, 3]}),
                           r"tokenizer\.ggml\.tokens must be an array of str"),
    "bad_merge": (dict(overrides={"tokenizer.ggml.merges": ["ab"]}), r"tokenizer\.ggml\.merges has an entry"),
    "short_token_types": (dict(overrides={"tokenizer.ggml.token_type": [3]}),
                          r"tokenizer\.ggml\.token_type has 1 entries for 32 tokens"),
    "eps_negative": (dict(overrides={"llama.attention.layer_norm_rms_epsilon": -1.0}),
                     r"llama\.attention\.layer_norm_rms_epsilon: rms_norm_eps must be a finite number > 0"),
    "rope_yarn": (dict(overrides={"llama.rope.scaling.type": "yarn"}),
                  r"GGUF metadata llama\.rope\.scaling\.type 'yarn' is not supported"),
    "theta_zero": (dict(overrides={"llama.rope.freq_base": 0.0}), r"llama\.rope\.freq_base: rope_theta must be"),
    "vocab_mismatch": (dict(overrides={"llama.vocab_size": 1000}),
                       r"tensor token_embd\.weight has shape \(32, 16\), expected \(1000, 16\)"),
    "bad_layer_index": (dict(extra_tensors={"blk.x.attn_q.weight": np.zeros((2, 2), np.float32)}),
                        r"unexpected tensor 'blk\.x\.attn_q\.weight'"),
    "bias_tensor": (dict(extra_tensors={"blk.0.attn_q.bias": np.zeros(16, np.float32)}),
                    r"unexpected tensors \['model\.layers\.0\.self_attn\.q_proj\.bias'\]"),
}


def test_tiny_gguf_loads(tmp_path):
    loaded = load_model(write_tiny_gguf(tmp_path / "tiny.gguf"))
    assert loaded.config.num_hidden_layers == 2 and loaded.config.vocab_size == 32
    assert loaded.tokenizer.encode("ab") == [30]


@pytest.mark.parametrize("name", sorted(HOSTILE_GGUF))
def test_hostile_gguf_is_one_clear_error(tmp_path, name):
    kwargs, message = HOSTILE_GGUF[name]
    path = write_tiny_gguf(tmp_path / "hostile.gguf", **kwargs)
    with pytest.raises(ValueError, match=r"hostile\.gguf: .*" + message):
        load_model(path)


# --------------------------------------------------------------------------- llama / qwen2 / qwen3 GGUFs
# A tiny transformers model per family, saved as safetensors and loaded by our safetensors path, then
# written as a GGUF the way llama.cpp's converter lays it out; the GGUF import must give the same
# config, the same weights and transformers' logits. "llama-rope3" carries Llama 3.1 RoPE scaling as
# rope_freqs.weight (thresholds chosen so that two of head_dim 8's four frequencies sit on the ramp).
from fixtures_gguf_family import llama3_divisors, write_family_gguf  # noqa: E402
from tiny_llama import hf_logits, make_tiny_hf_model, random_prompts, write_tiny_tokenizer  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 16.0,
               "original_max_position_embeddings": 256}
PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}


def _tokens(vocab_size: int) -> list[str]:
    return ["a", "b", "ab"] + [f"t{i}" for i in range(vocab_size - 3)]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "llama-rope3"])
def family_gguf(request, tmp_path_factory):
    """(transformers model, safetensors-path LoadedModel, import_gguf result, gguf path, rope divisors)."""
    return _build_family_gguf(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def rope3_gguf(tmp_path_factory):
    return _build_family_gguf("llama-rope3", tmp_path_factory)


def _build_family_gguf(variant: str, tmp_path_factory):
    family = variant.split("-")[0]
    path = tmp_path_factory.mktemp(variant)
    overrides = {"rope_scaling": LLAMA3_ROPE} if variant == "llama-rope3" else {}
    hf_model = make_tiny_hf_model(path, seed=11, family=family, **overrides)
    write_tiny_tokenizer(path, hf_model.config.vocab_size)
    loaded = load_model(path)
    weights = {name: np.asarray(w, dtype=np.float32) for name, w in loaded.weights.items()}
    divisors = llama3_divisors(loaded.config, loaded.config.rope_scaling) if overrides else None
    gguf_path = write_family_gguf(path / "model.gguf", loaded.config, weights, _tokens(loaded.config.vocab_size),
                                  ["a b"], PRE[family], divisors)
    return hf_model, loaded, import_gguf(gguf_path), gguf_path, divisors


def test_family_gguf_gives_the_safetensors_config_and_weights(family_gguf):
    from offline_paged.models.rope import inverse_frequencies

    _, loaded, (config, weights, _), _, divisors = family_gguf
    expected = loaded.config
    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps",
                  "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(config, field) == getattr(expected, field), field
    assert (config.rope_scaling is None) == (divisors is None)
    np.testing.assert_allclose(inverse_frequencies(config), inverse_frequencies(expected), rtol=1e-6, atol=0)
    assert set(weights) == set(loaded.weights)
    for name, array in weights.items():
        np.testing.assert_array_equal(array, np.asarray(loaded.weights[name], dtype=np.float32), err_msg=name)


def test_family_gguf_logits_match_transformers(family_gguf):
    from offline_paged.models.llama import Llama
    from offline_paged.ops.ops_numpy import NumpyOps
    from offline_paged.models.simple_runner import SimpleRunner

    hf_model, _, (config, weights, _), _, _ = family_gguf
    runner = SimpleRunner(Llama(config, weights, NumpyOps()), 100, 4, seed=2)
    prompts = random_prompts(5, [40, 9], config.vocab_size)
    for prompt, logits in zip(prompts, runner.step(list(enumerate(prompts)), all_logits=True)):
        np.testing.assert_allclose(logits, hf_logits(hf_model, prompt), atol=1e-4, rtol=0)


def test_rope_freqs_changes_the_model(rope3_gguf):
    """Dropping rope_freqs.weight (what the importer used to do) changes the frequencies a lot: the
    logits test above would catch an importer that ignores it."""
    from offline_paged.models.rope import inverse_frequencies

    _, _, (config, _, _), _, _ = rope3_gguf
    plain = dataclasses.replace(config, rope_scaling=None)
    assert np.abs(inverse_frequencies(plain) / inverse_frequencies(config) - 1).max() > 0.5


def test_transformers_reads_our_family_gguf_identically(family_gguf):
    """An independent reader of the same file (transformers' GGUF loader: its own name map and its
    own Q/K un-permute for llama only) gives the same tensors."""
    import torch
    from transformers import AutoModelForCausalLM

    _, _, (config, weights, _), gguf_path, _ = family_gguf
    if config.head_dim != config.hidden_size // config.num_attention_heads:
        pytest.skip("transformers' GGUF reader ignores attention.key_length (it would build head_dim 128)")
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    for name, array in weights.items():
        np.testing.assert_array_equal(array, state[name], err_msg=name)


@pytest.mark.parametrize("change,message", [
    ("random", r"rope_freqs\.weight: (the divisors are not those of a llama3|not a llama3)"),
    ("short", r"rope_freqs\.weight must hold 4 finite divisors"),
    ("linear_too", r"both llama\.rope\.scaling\.type 'linear' and a rope_freqs\.weight tensor"),
])
def test_rope_freqs_that_is_not_llama3_is_refused(rope3_gguf, tmp_path, change, message):
    _, loaded, _, _, divisors = rope3_gguf
    weights = {name: np.asarray(w, dtype=np.float32) for name, w in loaded.weights.items()}
    extra = {}
    if change == "random":
        divisors = np.array([1.0, 2.7, 1.3, 4.0], np.float32)
    elif change == "short":
        divisors = divisors[:3]
    else:
        extra = {"llama.rope.scaling.type": "linear"}
    path = write_family_gguf(tmp_path / "bad.gguf", loaded.config, weights, _tokens(loaded.config.vocab_size),
                             ["a b"], "llama-bpe", divisors, extra)
    with pytest.raises(ValueError, match=r"bad\.gguf: .*" + message):
        import_gguf(path)
