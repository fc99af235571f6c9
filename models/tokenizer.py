"""Tokenizer: a `tokenizers.Tokenizer` plus the special ids and chat template of one model.

Chat prompts: `apply_chat_template` returns text that already contains the template's special
tokens (e.g. `<|im_start|>`, or a BOS the template writes), so encode it with
`add_special_tokens=False` — `encode_chat` does exactly that.
Streaming: see `models/detokenizer.py` (IncrementalDetokenizer) for text that grows token by token
without ever emitting half a multi-byte character.
"""
from __future__ import annotations

import contextlib
import functools

import json
from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer

from .chat_template import ChatTemplate

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Encode/decode text, know which ids end a sequence, render chat prompts."""

    def __init__(self, backend: BackendTokenizer, eos_token_ids: frozenset[int], bos_token_id: int | None,
                 chat_template: ChatTemplate | None = None, special_tokens: dict[str, str] | None = None,
                 add_bos_token: bool = False):
        self.backend = backend
        self.eos_token_ids = frozenset(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})  # e.g. {"bos_token": "<s>", "eos_token": "</s>"}
        self.add_bos_token = add_bos_token

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (e.g. BOS).

        Raises ValueError when the Rust tokenizer panics on this text (a tokenizer.json whose regex
        backtracks past onig's limit, say): pyo3's PanicException is a BaseException, which no
        `except Exception` would stop, so one text could otherwise end the whole job."""
        with _panic_as_value_error("this text"):
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """encode() of each text, in one call that the Rust tokenizer spreads over its threads without the GIL
        (SmolLM2's, ~1,000-character prompts: 0.24 ms a text one by one, 0.12-0.14 batched on 2 cores). ValueError as
        encode() when it panics on any of them (encode() of each then tells which)."""
        with _panic_as_value_error("one of these texts"):
            encodings = self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [encoding.ids for encoding in encodings]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for: from the byte-level vocabulary (so a token holding half
        of a UTF-8 character gives that half, not the bytes of U+FFFD); an added/special token's
        text; otherwise the UTF-8 of its decoded text."""
        token = self.backend.id_to_token(int(token_id))
        if token is None:
            return b""
        if self._byte_level and int(token_id) not in self._added_ids:
            try:
                return bytes(_UNICODE_TO_BYTE[c] for c in token)
            except KeyError:  # not a byte-level symbol after all
                pass
        if int(token_id) in self._added_ids:
            return token.encode("utf-8")
        return self.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")

    @functools.cached_property
    def _byte_level(self) -> bool:
        return type(self.backend.decoder).__name__ == "ByteLevel"

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template_kwargs: dict | None = None) -> str:
        """Render `messages` ([{"role", "content"}...]) with the model's template (bounded jinja2 sandbox).
        `chat_template_kwargs` (as in vLLM, e.g. {"enable_thinking": False}) become template variables.
        Raises ValueError (ChatTemplateError) naming the template for any rendering failure."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template (none in tokenizer_config.json, "
                             "chat_template.jinja or GGUF metadata); send plain prompts instead")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                         **(self.special_tokens | _template_kwargs(chat_template_kwargs)))

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None) -> list[int]:
        """Ids of the rendered chat prompt; the template supplies its own special tokens."""
        text = self.apply_chat_template(messages, add_generation_prompt, chat_template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (with the chat template) into `directory`."""
        directory = Path(directory)
        self.backend.save(str(directory / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": self.add_bos_token,
                  "model_max_length": 1 << 30, **self.special_tokens}
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template.source
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    @classmethod
    def from_dir(cls, directory: str | Path, extra_eos_ids: tuple[int, ...] = (),
                 bos_token_id: int | None = None) -> Tokenizer:
        """Load tokenizer.json plus tokenizer_config.json / chat_template.jinja / generation_config.json.
        EOS ids are the union of generation_config's, `extra_eos_ids` (config.json's) and the eos_token."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: tokenizer.json not found (only 'fast' tokenizer.json "
                                    "tokenizers are supported)")
        try:
            backend = BackendTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise ValueError(f"{path}: cannot load tokenizer ({exc})") from None
        tok_config = _read_json(directory / "tokenizer_config.json")
        gen_config = _read_json(directory / "generation_config.json")
        special = {name: _token_text(tok_config[name], directory / "tokenizer_config.json", name)
                   for name in _SPECIAL_NAMES if tok_config.get(name)}
        gen_path = directory / "generation_config.json"
        eos_ids = set(extra_eos_ids) | set(_ids(gen_config.get("eos_token_id"), gen_path, "eos_token_id"))
        if "eos_token" in special and backend.token_to_id(special["eos_token"]) is not None:
            eos_ids.add(backend.token_to_id(special["eos_token"]))
        if "bos_token" in special and backend.token_to_id(special["bos_token"]) is not None:
            bos_token_id = backend.token_to_id(special["bos_token"])
        bos_token_id = next(iter(_ids(gen_config.get("bos_token_id", bos_token_id), gen_path, "bos_token_id")), None)
        return cls(backend, frozenset(eos_ids), bos_token_id, _chat_template(directory, tok_config), special,
                   bool(tok_config.get("add_bos_token", False)))


def batch_ids(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]] | None:
    """The ids of each text from one encode_batch call of any engine tokenizer; None where that does not apply
    (fewer than two texts, a tokenizer without encode_batch) or fails (a text it panics on: encoded one by one,
    that text's error is its own)."""
    if len(texts) < 2 or not hasattr(tokenizer, "encode_batch"):
        return None
    try:
        return tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
    except ValueError:
        return None


def encode_all(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """The ids of each text, in one batch where that works, else one by one (a text the tokenizer fails on then
    raises its ValueError)."""
    batch = batch_ids(tokenizer, texts, add_special_tokens)
    if batch is not None:
        return batch
    return [tokenizer.encode(text, add_special_tokens=add_special_tokens) for text in texts]


def is_rust_panic(exc: BaseException) -> bool:
    """pyo3's PanicException (pyo3_runtime.PanicException; it cannot be imported by name)."""
    return type(exc).__name__ == "PanicException"


@contextlib.contextmanager
def _panic_as_value_error(what: str):
    """The Rust tokenizer's panic inside the block becomes ValueError naming `what`; anything else passes."""
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - only the tokenizer's panic is turned into an error
        if not is_rust_panic(exc):
            raise
        raise ValueError(f"the tokenizer failed on {what} ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def _template_kwargs(kwargs) -> dict:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise ValueError("chat_template_kwargs must be an object whose keys are identifiers")
    reserved = sorted(set(kwargs) & {"messages", "add_generation_prompt"})
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    return kwargs


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path}: not valid JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: must be a JSON object, got {type(value).__name__}")
    return value


def _token_text(value, path: Path, name: str) -> str:
    text = value.get("content") if isinstance(value, dict) else value
    if not isinstance(text, str):
        raise ValueError(f"{path}: {name} must be a string or {{'content': string}}, got {str(value)[:40]!r}")
    return text


def _ids(value, path: Path, name: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{path}: {name} must be an integer or a list of integers, got {str(value)[:40]!r}")
    return values


def _chat_template(directory: Path, tok_config: dict) -> ChatTemplate | None:
    jinja_path = directory / "chat_template.jinja"
    if jinja_path.is_file():
        try:
            source = jinja_path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{jinja_path}: not UTF-8 text ({exc})") from None
        return ChatTemplate(source, origin=str(jinja_path))
    source = tok_config.get("chat_template")
    origin = str(directory / "tokenizer_config.json")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
        if not all(isinstance(t, dict) for t in source):
            raise ValueError(f"{origin}: chat_template is a list whose entries are not "
                             "{'name': ..., 'template': ...} objects")
        named = {t.get("name"): t.get("template") for t in source}
        source = named.get("default") or next(iter(named.values()), None)
    if source is None or source == "":
        return None
    return ChatTemplate(source, origin=f"{origin} (chat_template)")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2 byte-level BPE's symbol for each byte, inverted: printable Latin-1 bytes stand for
    themselves; the other 68 bytes map, in byte order, to the code points from 256 upward."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbol_of = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbol_of:
            symbol_of[b] = chr(256 + extra)
            extra += 1
    return {symbol: b for b, symbol in symbol_of.items()}


_UNICODE_TO_BYTE = _byte_level_alphabet()
