"""build_tokenizer: a `tokenizers` byte-level BPE rebuilt from a GGUF file's tokenizer metadata.

The split rule before BPE comes from `tokenizer.ggml.pre` (as llama.cpp reads it): GPT-2's regex,
GPT-2's regex after isolating every digit (StarCoder / SmolLM family), Llama 3's regex, or Qwen2's
(Llama 3's with single digits, after NFC normalization, as Qwen2/2.5/3's own tokenizer.json does).
Tokens the file marks CONTROL become special added tokens (matched whole, skipped when decoding),
USER_DEFINED ones plain added tokens.
"""
from __future__ import annotations

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from .chat_template import ChatTemplate
from .config import LlamaConfig
from .tokenizer import Tokenizer

_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_GPT2_PRE = ("default", "gpt-2", "gpt2")
_QWEN2_PRE = ("qwen2",)
_DIGITS_PRE = ("smollm", "starcoder", "refact", "codeshell", "exaone", "minerva", "command-r")
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "dbrx")
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def build_tokenizer(meta, config: LlamaConfig) -> Tokenizer:
    """Tokenizer from GGUF metadata (`meta` is a GgufMetadata); raises ValueError naming the file and key."""
    kind = meta.get_str("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{meta.path}: GGUF tokenizer model {kind!r} is not supported "
                         "(supported: 'gpt2' byte-level BPE)")
    tokens = meta.list_of("tokenizer.ggml.tokens", str)
    if len(tokens) > config.vocab_size:
        raise ValueError(f"{meta.path}: GGUF metadata tokenizer.ggml.tokens has {len(tokens)} tokens, more than "
                         f"the model's vocabulary ({config.vocab_size} rows in token_embd.weight)")
    pre = meta.get_str("tokenizer.ggml.pre", "default")
    merges = meta.list_of("tokenizer.ggml.merges", str)
    bad = next((m for m in merges if len(m.split(" ")) != 2), None)
    if bad is not None:
        raise ValueError(f"{meta.path}: GGUF metadata tokenizer.ggml.merges has an entry that is not two "
                         f"tokens separated by one space: {bad[:40]!r}")
    try:
        backend = BackendTokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)},
                                              merges=[tuple(m.split(" ")) for m in merges],
                                              ignore_merges=pre in _LLAMA3_PRE))
    except Exception as exc:  # tokenizers raises plain Exceptions for a merge of unknown tokens
        raise ValueError(f"{meta.path}: GGUF tokenizer metadata (tokenizer.ggml.tokens / merges) "
                         f"is inconsistent ({exc})") from None
    backend.pre_tokenizer = _pre_tokenizer(pre, meta.path)
    if pre in _QWEN2_PRE:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    token_types = meta.list_of("tokenizer.ggml.token_type", int, [])
    if token_types and len(token_types) != len(tokens):
        raise ValueError(f"{meta.path}: GGUF metadata tokenizer.ggml.token_type has {len(token_types)} entries "
                         f"for {len(tokens)} tokens")
    _add_marked_tokens(backend, tokens, token_types)
    ids = {key: _token_id(meta, f"tokenizer.ggml.{key}", len(tokens))
           for key in (*_SPECIAL_IDS.values(), "eot_token_id")}
    special = {name: tokens[ids[key]] for name, key in _SPECIAL_IDS.items() if ids[key] is not None}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    bos_id = ids["bos_token_id"]
    backend.post_processor = _post_processor(add_bos, special.get("bos_token"), bos_id)
    eos_ids = {i for i in (ids["eos_token_id"], ids["eot_token_id"]) if i is not None}
    template = meta.get("tokenizer.chat_template", None)
    chat = ChatTemplate(template, origin=f"{meta.path} (tokenizer.chat_template)") if template is not None else None
    return Tokenizer(backend, frozenset(eos_ids | set(config.eos_token_ids)), bos_id, chat, special, add_bos)


def _token_id(meta, key: str, num_tokens: int) -> int | None:
    value = meta.get_int(key, None)
    if value is not None and not 0 <= value < num_tokens:
        raise ValueError(f"{meta.path}: GGUF metadata {key} = {value} is not a token id "
                         f"(tokenizer.ggml.tokens has {num_tokens} tokens)")
    return value


def _pre_tokenizer(pre: str, path):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRE:
        return byte_level
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _LLAMA3_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre in _QWEN2_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    supported = ", ".join(_GPT2_PRE + _DIGITS_PRE + _LLAMA3_PRE + _QWEN2_PRE)
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
