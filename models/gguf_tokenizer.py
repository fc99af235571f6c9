"""build_tokenizer: a `tokenizers` byte-level BPE rebuilt from a GGUF file's tokenizer metadata.

The split rule before BPE comes from `tokenizer.ggml.pre` (as llama.cpp reads it): GPT-2's regex,
GPT-2's regex after isolating every digit (StarCoder / SmolLM family), or Llama 3's regex.
Tokens the file marks CONTROL become special added tokens (matched whole, skipped when decoding),
USER_DEFINED ones plain added tokens.
"""
from __future__ import annotations

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from .chat_template import ChatTemplate
from .config import LlamaConfig
from .tokenizer import Tokenizer

_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_PRE = ("default", "gpt-2", "gpt2")
_DIGITS_PRE = ("smollm", "starcoder", "refact", "codeshell", "exaone", "minerva", "command-r")
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "dbrx")
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def build_tokenizer(meta, config: LlamaConfig) -> Tokenizer:
    """Tokenizer from GGUF metadata (`meta` is a GgufMetadata); raises ValueError naming the file."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{meta.path}: GGUF tokenizer model {kind!r} is not supported "
                         "(supported: 'gpt2' byte-level BPE)")
    tokens = meta.get("tokenizer.ggml.tokens")
    pre = meta.get("tokenizer.ggml.pre", "default")
    backend = BackendTokenizer(models.BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=[tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges")],
        ignore_merges=pre in _LLAMA3_PRE))
    backend.pre_tokenizer = _pre_tokenizer(pre, meta.path)
    backend.decoder = decoders.ByteLevel()
    _add_marked_tokens(backend, tokens, meta.get("tokenizer.ggml.token_type", []))
    special = {name: tokens[meta.get(f"tokenizer.ggml.{key}")] for name, key in _SPECIAL_IDS.items()
               if f"tokenizer.ggml.{key}" in meta}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    bos_id = meta.get("tokenizer.ggml.bos_token_id", None)
    backend.post_processor = _post_processor(add_bos, special.get("bos_token"), bos_id)
    eos_ids = {int(meta.get(k)) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta}
    template = meta.get("tokenizer.chat_template", None)
    chat = ChatTemplate(template, origin=f"{meta.path} (tokenizer.chat_template)") if template else None
    return Tokenizer(backend, frozenset(eos_ids | set(config.eos_token_ids)), bos_id, chat, special, add_bos)


def _pre_tokenizer(pre: str, path):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRE:
        return byte_level
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _LLAMA3_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    supported = ", ".join(_GPT2_PRE + _DIGITS_PRE + _LLAMA3_PRE)
    raise ValueError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported (supported: {supported})")


def _add_marked_tokens(backend: BackendTokenizer, tokens: list[str], token_types: list[int]) -> None:
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, token_types) if k == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, token_types) if k == _USER_DEFINED]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def _post_processor(add_bos: bool, bos_token: str | None, bos_id: int | None):
    if not add_bos or bos_token is None:
        return processors.ByteLevel(trim_offsets=False)
    return processors.TemplateProcessing(single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B",
                                         special_tokens=[(bos_token, int(bos_id))])
