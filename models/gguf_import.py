"""import_gguf: a llama-architecture .gguf file -> (LlamaConfig, HF-named float32 weights, Tokenizer).

Weights are dequantized with the `gguf` package. llama.cpp's converter permutes the rows of Q and K
(it pairs RoPE dimensions (2i, 2i+1); HF pairs (i, i + D/2)); the permutation is undone here.
The tokenizer is rebuilt as a `tokenizers` byte-level BPE from tokenizer.ggml.tokens/merges, with the
pre-tokenizer that `tokenizer.ggml.pre` names, and control tokens registered as special tokens.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .config import LlamaConfig, RopeScaling
from .gguf_tokenizer import build_tokenizer
from .tokenizer import Tokenizer
from .weight_spec import check_checkpoint_names, expected_weight_shapes

SUPPORTED_QUANT_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# The GGUF key each LlamaConfig field comes from, so that a refused value names the key in the file.
_CONFIG_KEYS = {"vocab_size": "llama.vocab_size (or the length of tokenizer.ggml.tokens)",
                "hidden_size": "llama.embedding_length", "intermediate_size": "llama.feed_forward_length",
                "num_hidden_layers": "llama.block_count", "num_attention_heads": "llama.attention.head_count",
                "num_key_value_heads": "llama.attention.head_count_kv", "head_dim": "llama.rope.dimension_count",
                "rms_norm_eps": "llama.attention.layer_norm_rms_epsilon", "rope_theta": "llama.rope.freq_base",
                "max_position_embeddings": "llama.context_length", "bos_token_id": "tokenizer.ggml.bos_token_id",
                "eos_token_id": "tokenizer.ggml.eos_token_id", "rope scaling": "llama.rope.scaling.factor"}


def import_gguf(path: str | Path) -> tuple[LlamaConfig, dict[str, np.ndarray], Tokenizer]:
    """Config, HF-named float32 weights and tokenizer of a llama GGUF. Every problem is a ValueError
    naming the file and the metadata key or tensor; names and shapes are checked before dequantizing."""
    path = Path(path)
    reader = open_gguf(path)
    metadata = GgufMetadata(reader, path)
    config = config_from_metadata(metadata, has_output=any(t.name == "output.weight" for t in reader.tensors))
    tensors = {name: t for t in reader.tensors if (name := hf_tensor_name(t.name, path)) is not None}
    _check_tensors(path, config, tensors)
    tokenizer = build_tokenizer(metadata, config)
    weights = {}
    for name, tensor in tensors.items():
        array = dequantize_tensor(tensor, path)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            n_head = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            array = unpermute_rows(array, n_head)
        weights[name] = array
    return config, weights, tokenizer


def _check_tensors(path: Path, config: LlamaConfig, tensors: dict) -> None:
    try:
        check_checkpoint_names(config, set(tensors))
    except ValueError as exc:
        message = str(exc).replace("num_hidden_layers is", "llama.block_count is").replace(" in config.json", "")
        raise ValueError(f"{path}: {message} (GGUF tensor names are mapped to HF names)") from None
    for name, shape in expected_weight_shapes(config).items():
        found = tuple(int(n) for n in reversed(tensors[name].shape))
        if found != shape:
            raise ValueError(f"{path}: tensor {tensors[name].name} has shape {found}, expected {shape} from "
                             "the GGUF metadata")


def open_gguf(path: Path):
    from gguf import GGUFReader

    if not path.is_file():
        raise FileNotFoundError(f"{path}: GGUF file not found")
    try:
        return GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError/IndexError/struct errors on bad files
        raise ValueError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None


class GgufMetadata:
    """Typed access to a GGUF file's key/value metadata."""

    _MISSING = object()

    def __init__(self, reader, path: Path):
        self.fields = reader.fields
        self.path = path

    def get(self, key: str, default=_MISSING):
        field = self.fields.get(key)
        if field is None:
            if default is self._MISSING:
                raise ValueError(f"{self.path}: GGUF metadata key {key!r} is missing")
            return default
        try:
            return field.contents()
        except (IndexError, ValueError, TypeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.path}: GGUF metadata {key} cannot be read ({type(exc).__name__}: {exc})") from None

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def get_int(self, key: str, default=_MISSING):
        value = self.get(key, default)
        if value is not default and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
            raise ValueError(f"{self.path}: GGUF metadata {key} must be an integer, got {str(value)[:40]!r}")
        return value if value is default else int(value)

    def get_float(self, key: str, default=_MISSING):
        value = self.get(key, default)
        if value is not default and (isinstance(value, bool) or not isinstance(value, (int, float, np.number))):
            raise ValueError(f"{self.path}: GGUF metadata {key} must be a number, got {str(value)[:40]!r}")
        return value

    def get_str(self, key: str, default=_MISSING):
        value = self.get(key, default)
        if value is not default and not isinstance(value, str):
            raise ValueError(f"{self.path}: GGUF metadata {key} must be a string, got {str(value)[:40]!r}")
        return value

    def list_of(self, key: str, kind: type, default=_MISSING) -> list:
        value = self.get(key, default)
        if value is default:
            return value
        if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
            raise ValueError(f"{self.path}: GGUF metadata {key} must be an array of {kind.__name__}")
        return value


def config_from_metadata(meta: GgufMetadata, has_output: bool) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{meta.path}: GGUF architecture {arch!r} is not supported (supported: llama)")
    num_heads = meta.get_int("llama.attention.head_count")
    hidden = meta.get_int("llama.embedding_length")
    if num_heads <= 0:
        raise ValueError(f"{meta.path}: GGUF metadata llama.attention.head_count must be > 0, got {num_heads}")
    head_dim = meta.get_int("llama.rope.dimension_count", hidden // num_heads)
    if meta.get_int("llama.attention.key_length", head_dim) != head_dim:
        raise ValueError(f"{meta.path}: rope dimension count differs from the key length (partial RoPE unsupported)")
    vocab_size = meta.get_int("llama.vocab_size", None) or len(meta.list_of("tokenizer.ggml.tokens", str))
    eos = meta.get_int("tokenizer.ggml.eos_token_id", None)
    try:
        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden,
            intermediate_size=meta.get_int("llama.feed_forward_length"),
            num_hidden_layers=meta.get_int("llama.block_count"),
            num_attention_heads=num_heads,
            num_key_value_heads=meta.get_int("llama.attention.head_count_kv", num_heads),
            head_dim=head_dim,
            rms_norm_eps=_shortest(meta.get_float("llama.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(meta.get_float("llama.rope.freq_base", 10000.0)),
            rope_scaling=_rope_scaling(meta),
            max_position_embeddings=meta.get_int("llama.context_length", 4096),
            tie_word_embeddings=not has_output,
            bos_token_id=meta.get_int("tokenizer.ggml.bos_token_id", None),
            eos_token_ids=() if eos is None else (eos,),
        )
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0] if not str(exc).startswith("rope scaling") else "rope scaling"
        key = _CONFIG_KEYS.get(field)
        raise ValueError(f"{meta.path}: {f'GGUF metadata {key}: ' if key else ''}{exc}") from None


def _shortest(value) -> float:
    """GGUF stores float32; 1e-5 reads back as 9.999999747e-06. Take the shortest float32 spelling."""
    return float(str(np.float32(value)))


def _rope_scaling(meta: GgufMetadata) -> RopeScaling | None:
    kind = meta.get_str("llama.rope.scaling.type", "none")
    if "rope_freqs.weight" in meta.fields or kind not in ("none", "linear"):
        raise ValueError(f"{meta.path}: GGUF RoPE scaling {kind!r} / rope_freqs is not supported "
                         "(supported: none, linear); convert the original HF checkpoint instead")
    if kind == "none":
        return None
    return RopeScaling("linear", float(meta.get_float("llama.rope.scaling.factor")))


def hf_tensor_name(gguf_name: str, path: Path) -> str | None:
    """HF name for a GGUF tensor name; None for tensors the model does not use (rope_freqs)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if gguf_name == "rope_freqs.weight":
        return None
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    raise ValueError(f"{path}: unexpected tensor {gguf_name!r} for a llama model")


def dequantize_tensor(tensor, path: Path) -> np.ndarray:
    """float32 array in numpy (row-major) shape, i.e. GGUF's shape reversed."""
    from gguf.quants import dequantize

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_QUANT_TYPES:
        raise ValueError(f"{path}: tensor {tensor.name} has unsupported type {kind} "
                         f"(supported: {', '.join(SUPPORTED_QUANT_TYPES)})")
    shape = tuple(int(n) for n in reversed(tensor.shape))
    try:
        values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
        return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
    except ValueError as exc:
        raise ValueError(f"{path}: tensor {tensor.name} ({kind}, shape {shape}) cannot be read ({exc})") from None


def unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, rows were interleaved (first half, second half)."""
    rows, cols = weight.shape
    return weight.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)
