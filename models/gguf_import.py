"""import_gguf: a llama, qwen2 or qwen3 .gguf file -> (LlamaConfig, HF-named float32 weights, Tokenizer).

Weights are dequantized with the `gguf` package. For `llama` files llama.cpp's converter permutes the
rows of Q and K (it pairs RoPE dimensions (2i, 2i+1); HF pairs (i, i + D/2)); the permutation is
undone here. qwen2/qwen3 files use HF's pairing (llama.cpp's NEOX RoPE) and are not permuted.
Qwen2 adds q/k/v biases (`blk.N.attn_q.bias`), Qwen3 per-head q/k norms (`blk.N.attn_q_norm.weight`)
and an explicit head size (`qwen3.attention.key_length`).
Llama 3.1-style RoPE scaling travels as a `rope_freqs.weight` tensor of per-frequency divisors and no
metadata; the llama3 parameters are recovered from it (the original context length from
`llama.rope.scaling.original_context_length`, else Llama 3's 8192: only ratios matter) and the
divisors they give are checked against the tensor, so a file with any other scaling is refused.
The tokenizer is rebuilt as a `tokenizers` byte-level BPE from tokenizer.ggml.tokens/merges, with the
pre-tokenizer that `tokenizer.ggml.pre` names, and control tokens registered as special tokens.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .config import LlamaConfig, RopeScaling
from .gguf_tokenizer import build_tokenizer
from .rope import inverse_frequencies
from .tokenizer import Tokenizer
from .weight_spec import check_checkpoint_names, expected_weight_shapes

SUPPORTED_QUANT_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# GGUF architecture -> HF architecture; `llama` Q/K rows are permuted by llama.cpp.
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# The GGUF key each LlamaConfig field comes from ({a}: the architecture), so that a refused value
# names the key in the file.
_CONFIG_KEYS = {"vocab_size": "{a}.vocab_size (or the length of tokenizer.ggml.tokens)",
                "hidden_size": "{a}.embedding_length", "intermediate_size": "{a}.feed_forward_length",
                "num_hidden_layers": "{a}.block_count", "num_attention_heads": "{a}.attention.head_count",
                "num_key_value_heads": "{a}.attention.head_count_kv",
                "head_dim": "{a}.attention.key_length (or {a}.rope.dimension_count)",
                "rms_norm_eps": "{a}.attention.layer_norm_rms_epsilon", "rope_theta": "{a}.rope.freq_base",
                "max_position_embeddings": "{a}.context_length", "bos_token_id": "tokenizer.ggml.bos_token_id",
                "eos_token_id": "tokenizer.ggml.eos_token_id",
                "rope scaling": "{a}.rope.scaling.factor (or the rope_freqs.weight tensor)"}
_LLAMA3_ORIGINAL_CONTEXT = 8192


def import_gguf(path: str | Path) -> tuple[LlamaConfig, dict[str, np.ndarray], Tokenizer]:
    """Config, HF-named float32 weights and tokenizer of a llama GGUF. Every problem is a ValueError
    naming the file and the metadata key or tensor; names and shapes are checked before dequantizing."""
    path = Path(path)
    reader = open_gguf(path)
    metadata = GgufMetadata(reader, path)
    config = config_from_reader(reader, metadata)
    tensors = {name: t for t in reader.tensors if (name := hf_tensor_name(t.name, path)) is not None}
    _check_tensors(path, config, tensors)
    tokenizer = build_tokenizer(metadata, config)
    weights = {}
    permuted = metadata.get("general.architecture") == "llama"
    for name, tensor in tensors.items():
        array = dequantize_tensor(tensor, path)
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            n_head = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            array = unpermute_rows(array, n_head)
        weights[name] = array
    return config, weights, tokenizer


def _check_tensors(path: Path, config: LlamaConfig, tensors: dict) -> None:
    try:
        check_checkpoint_names(config, set(tensors))
    except ValueError as exc:
        arch = next(a for a, hf in _ARCHITECTURES.items() if hf == config.architecture)
        message = str(exc).replace("num_hidden_layers is", f"{arch}.block_count is").replace(" in config.json", "")
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


def config_from_reader(reader, meta: GgufMetadata) -> LlamaConfig:
    """The config of an opened GGUF file (metadata, plus the tensors that carry config: whether
    `output.weight` exists, and `rope_freqs.weight`)."""
    by_name = {t.name: t for t in reader.tensors}
    rope_freqs = by_name.get("rope_freqs.weight")
    divisors = None if rope_freqs is None else dequantize_tensor(rope_freqs, meta.path).ravel().astype(np.float64)
    return config_from_metadata(meta, "output.weight" in by_name, divisors)


def config_from_metadata(meta: GgufMetadata, has_output: bool, rope_divisors: np.ndarray | None = None) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"{meta.path}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(_ARCHITECTURES)})")
    num_heads = meta.get_int(f"{arch}.attention.head_count")
    hidden = meta.get_int(f"{arch}.embedding_length")
    if num_heads <= 0:
        raise ValueError(f"{meta.path}: GGUF metadata {arch}.attention.head_count must be > 0, got {num_heads}")
    head_dim = _head_dim(meta, arch, hidden // num_heads)
    vocab_size = meta.get_int(f"{arch}.vocab_size", None) or len(meta.list_of("tokenizer.ggml.tokens", str))
    eos = meta.get_int("tokenizer.ggml.eos_token_id", None)
    try:
        rope_theta = float(meta.get_float(f"{arch}.rope.freq_base", 10000.0))
        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden,
            intermediate_size=meta.get_int(f"{arch}.feed_forward_length"),
            num_hidden_layers=meta.get_int(f"{arch}.block_count"),
            num_attention_heads=num_heads,
            num_key_value_heads=meta.get_int(f"{arch}.attention.head_count_kv", num_heads),
            head_dim=head_dim,
            rms_norm_eps=_shortest(meta.get_float(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=_rope_scaling(meta, arch, head_dim, rope_theta, rope_divisors),
            max_position_embeddings=meta.get_int(f"{arch}.context_length", 4096),
            tie_word_embeddings=not has_output,
            architecture=_ARCHITECTURES[arch],
            bos_token_id=meta.get_int("tokenizer.ggml.bos_token_id", None),
            eos_token_ids=() if eos is None else (eos,),
        )
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0] if not str(exc).startswith("rope scaling") else "rope scaling"
        key = _CONFIG_KEYS.get(field)
        raise ValueError(f"{meta.path}: {f'GGUF metadata {key.format(a=arch)}: ' if key else ''}{exc}") from None


def _head_dim(meta: GgufMetadata, arch: str, default: int) -> int:
    """`key_length` (Qwen3 sets it apart from hidden / heads), else the RoPE dimension count; RoPE
    over part of a head and a value size other than the key size are refused."""
    rope_dims = meta.get_int(f"{arch}.rope.dimension_count", None)
    head_dim = meta.get_int(f"{arch}.attention.key_length", rope_dims if rope_dims is not None else default)
    if rope_dims is not None and rope_dims != head_dim:
        raise ValueError(f"{meta.path}: GGUF metadata {arch}.rope.dimension_count ({rope_dims}) differs from the "
                         f"key length ({head_dim}): partial RoPE is not supported")
    if meta.get_int(f"{arch}.attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{meta.path}: GGUF metadata {arch}.attention.value_length differs from the key length "
                         f"({head_dim}); not supported")
    return head_dim


def _shortest(value) -> float:
    """GGUF stores float32; 1e-5 reads back as 9.999999747e-06. Take the shortest float32 spelling."""
    return float(str(np.float32(value)))


def _rope_scaling(meta: GgufMetadata, arch: str, head_dim: int, rope_theta: float,
                  divisors: np.ndarray | None) -> RopeScaling | None:
    kind = meta.get_str(f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        raise ValueError(f"{meta.path}: GGUF metadata {arch}.rope.scaling.type {kind!r} is not supported "
                         "(supported: none, linear); convert the original HF checkpoint instead")
    if divisors is not None:
        if kind != "none":
            raise ValueError(f"{meta.path}: GGUF has both {arch}.rope.scaling.type {kind!r} and a rope_freqs.weight "
                             "tensor; refusing to guess which scaling applies")
        original = meta.get_int(f"{arch}.rope.scaling.original_context_length", _LLAMA3_ORIGINAL_CONTEXT)
        return llama3_from_rope_freqs(divisors, head_dim, rope_theta, original, meta.path)
    if kind == "none":
        return None
    return RopeScaling("linear", float(meta.get_float(f"{arch}.rope.scaling.factor")))


def llama3_from_rope_freqs(divisors: np.ndarray, head_dim: int, rope_theta: float, original: int,
                           path: Path) -> RopeScaling:
    """The llama3 scaling whose per-frequency divisors (inverse frequency = base / divisor) are
    `divisors`: 1 for short wavelengths, `factor` for long ones, 1 / ((1 - s) / factor + s) between,
    with s linear in 1 / wavelength. Raises ValueError naming rope_freqs.weight when no llama3
    scaling gives them (within float32 rounding)."""
    where = f"{path}: tensor rope_freqs.weight"
    if divisors.shape != (head_dim // 2,) or not np.all(np.isfinite(divisors)) or divisors.min() < 1 - 1e-6:
        raise ValueError(f"{where} must hold {head_dim // 2} finite divisors >= 1, got shape {divisors.shape}")
    factor = float(divisors.max())
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [D/2]
    medium = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    if factor <= 1 + 1e-6 or medium.sum() < 2:
        raise ValueError(f"{where}: not a llama3 RoPE scaling (needs a factor > 1 and at least two "
                         "frequencies on the ramp between 1 and the factor)")
    smooth = (1 / divisors[medium] - 1 / factor) / (1 - 1 / factor)  # [M] s on the ramp
    slope, intercept = np.polyfit(inv_freq[medium] / (2 * np.pi), smooth, 1)
    span = original / slope  # high_freq_factor - low_freq_factor
    low = -intercept * span
    try:
        scaling = RopeScaling("llama3", factor, float(low), float(low + span), original)
        rebuilt = inverse_frequencies(LlamaConfig(vocab_size=1, hidden_size=head_dim, intermediate_size=1,
                                              num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                                              head_dim=head_dim, rope_theta=rope_theta, rope_scaling=scaling))
    except ValueError as exc:
        raise ValueError(f"{where}: not a llama3 RoPE scaling ({exc})") from None
    if not np.allclose(rebuilt, inv_freq / divisors, rtol=1e-5, atol=0):
        raise ValueError(f"{where}: the divisors are not those of a llama3 RoPE scaling (recovered "
                         f"factor {factor:g}, low {low:g}, high {low + span:g}); not supported")
    return scaling


def hf_tensor_name(gguf_name: str, path: Path) -> str | None:
    """HF name for a GGUF tensor name; None for rope_freqs (read into the config's RoPE scaling)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if gguf_name == "rope_freqs.weight":
        return None
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    raise ValueError(f"{path}: unexpected tensor {gguf_name!r} (not a tensor of a llama, qwen2 or qwen3 model)")


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
