"""SamplingParams: how one request is decoded. Names and defaults follow vLLM.

Choices that vLLM leaves open or that differ between its versions:
- `top_k`: 0 means "off" (the default); -1 is accepted as vLLM's older spelling of "off" and is
  stored as 0, so the engine only ever sees 0 or a positive k.
- Beam search: `use_beam_search=True` keeps `beam_width = best_of` beams (best_of defaults to n)
  and returns the n best. As in vLLM's beam search it is deterministic, so it requires
  temperature == 0 and leaves top_k / top_p / min_p off.
- Without beam search, `best_of > n` draws best_of samples and returns the n with the highest
  cumulative log-probability.
- `seed=None` leaves the seed to the engine (derived from the engine seed and the request);
  a seeded request yields the same tokens whatever else is in the batch.
- `logprobs=k` returns the top-k log-probabilities per generated token plus the sampled token's;
  `logprobs=0` returns the sampled token's only. `prompt_logprobs` works the same for prompt tokens.
  Log-probabilities are those of the raw model distribution (log-softmax of the logits, before
  penalties, temperature and filters), as in vLLM v1's default.
- `max_tokens=0` scores the prompt only (with `prompt_logprobs`): nothing is returned as generated.
  `prompt_logprobs_start` (ours, not vLLM's) leaves prompt positions before it unscored (None), so a
  prefix-cache hit on them is not recomputed: lm-eval's shared multiple-choice contexts run once.
- Token constraints, applied before the penalties as in vLLM v1: `allowed_token_ids` (only these
  may be sampled), `bad_words` (strings whose token sequences may not be completed; tokenized by the
  engine with and without a leading space, as vLLM does), `logit_bias` ({token id: added to the logit}).
- `detokenize=False` returns empty text (token ids only) and refuses stop strings, as vLLM does.
  `spaces_between_special_tokens` is accepted and, as in vLLM with fast (tokenizer.json) tokenizers —
  the only kind we load — changes nothing.
- `structured_outputs=StructuredOutputsParams(json=... | regex=... | choice=[...] | grammar=... |
  json_object=True)` constrains the output (core/structured_outputs.py; a dict of its fields is accepted
  too); `guided_decoding=` (vLLM's older name, GuidedDecodingParams) is the same thing. With beam search
  every beam follows the grammar (core/beam_search.py).
- `truncate_prompt_tokens=k` keeps the last k prompt tokens (-1: as many as max_model_len allows).
- A temperature below 1e-5 is stored as 0 (greedy), as vLLM does: dividing logits by 5e-324
  overflows to inf and NaN.
- Costs are capped (ValueError naming the cap): samples x max_tokens x (logprobs + 1) at most
  MAX_OUTPUT_ENTRIES (`check_output_cost`, called by the job, which knows max_model_len); at most MAX_STOP_STRINGS stop strings and MAX_BAD_WORDS bad words, each list
  at most MAX_STRING_LIST_BYTES of UTF-8.
"""
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from offline_paged.core.structured_outputs import StructuredOutputsParams

_MAX_SEED = 2**64
# n and best_of are capped before anything is sized by them (a request builds one random-stream seed
# and, once running, one sequence per sample); the engine further limits them to max_num_seqs.
MAX_SAMPLES = 1024
# What one request may cost, capped before it runs (a 104-byte line once asked for a 74 MB record):
# samples x max_tokens x (logprobs + 1) output entries, and the stop strings / bad words checked
# at every step (their count and their total UTF-8 bytes).
MAX_OUTPUT_ENTRIES = 2_000_000
MAX_STOP_STRINGS = 1024
MAX_BAD_WORDS = 4096
MAX_STRING_LIST_BYTES = 256 * 1024
GREEDY_BELOW_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS: a smaller temperature decodes greedily


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Immutable, validated decoding settings of one request (see the module docstring)."""

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    use_beam_search: bool = False
    skip_special_tokens: bool = True
    # vLLM's output and constraint fields (see the module docstring)
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    prompt_logprobs_start: int = 0
    # Structured output (StructuredOutputsParams, or its fields as a dict); guided_decoding is vLLM's older
    # spelling and is moved into structured_outputs.
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None
    # vLLM fields we do not implement: accepted as None only, so setting one says "not supported".
    logits_processors: Any = None
    output_kind: Any = None
    extra_args: Any = None
    # Set by the engine from bad_words and its tokenizer; not a user field.
    _bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False, compare=False)
    # Derived once in __post_init__ (see has_penalties / needs_token_history); not user fields.
    _has_penalties: bool = field(default=False, init=False, repr=False, compare=False)
    _needs_token_history: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._normalise()
        self._check_counts()
        self._check_sampling()
        self._check_penalties()
        self._check_stops()
        self._check_constraints()
        self._check_costs()
        if self.use_beam_search:
            self._check_beam_search()
        penalties = (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                     or self.frequency_penalty != 0.0)
        _set(self, "_has_penalties", penalties)
        _set(self, "_needs_token_history", penalties or bool(self.bad_words) or bool(self._bad_words_token_ids))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SamplingParams":
        """Build from a JSON object (one job line's sampling fields); unknown keys are an error."""
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling parameters must be an object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(FIELD_NAMES) - set(UNSUPPORTED_FIELD_NAMES)  # those say "not supported"
                         - set(ALIAS_FIELD_NAMES))
        if unknown:
            raise ValueError(
                f"unknown sampling field(s): {', '.join(unknown)} "
                f"(known: {', '.join(FIELD_NAMES)})"
            )
        return cls(**dict(d))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict of every field (tuples become lists)."""
        return {
            name: list(v) if isinstance(v, tuple) else v.to_dict() if isinstance(v, StructuredOutputsParams) else v
            for name in FIELD_NAMES
            for v in [getattr(self, name)]
        }

    @property
    def beam_width(self) -> int:
        """Number of beams kept by beam search (best_of, or n when best_of is unset)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def num_samples(self) -> int:
        """Sequences the engine runs for this request (best_of when set, else n)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def has_penalties(self) -> bool:
        """Whether a repetition, presence or frequency penalty is set (not at its neutral value)."""
        return self._has_penalties

    @property
    def needs_token_history(self) -> bool:
        """Whether sampling reads the sequence's tokens so far: penalties count them, bad words match
        their ends. Such a request's next step needs this step's token on the host, and the decode
        graph's sampler (which sees no history) cannot draw for it."""
        return self._needs_token_history

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def _normalise(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            _set(self, name, _float(name, getattr(self, name)))
        for name in ("ignore_eos", "use_beam_search", "skip_special_tokens", "detokenize",
                     "spaces_between_special_tokens", "include_stop_str_in_output"):
            _bool(name, getattr(self, name))
        if 0.0 < self.temperature < GREEDY_BELOW_TEMPERATURE:
            _set(self, "temperature", 0.0)
        _set(self, "top_k", 0 if _int("top_k", self.top_k) == -1 else self.top_k)
        _set(self, "stop", _stop_tuple(self.stop))
        _set(self, "stop_token_ids", _int_tuple("stop_token_ids", self.stop_token_ids))
        if self.allowed_token_ids is not None:
            _set(self, "allowed_token_ids", _int_tuple("allowed_token_ids", self.allowed_token_ids))
        _set(self, "bad_words", _string_tuple("bad_words", self.bad_words))
        if self.logit_bias is not None:
            _set(self, "logit_bias", _logit_bias(self.logit_bias))
        self._normalise_structured()

    def _normalise_structured(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("give structured_outputs or guided_decoding (its older name), not both")
            _set(self, "structured_outputs", self.guided_decoding)
            _set(self, "guided_decoding", None)
        if self.structured_outputs is not None:
            _set(self, "structured_outputs", StructuredOutputsParams.from_dict(self.structured_outputs))

    def _check_counts(self) -> None:
        _at_most("n", _at_least("n", self.n, 1), MAX_SAMPLES)
        if self.best_of is not None:
            _at_most("best_of", _at_least("best_of", self.best_of, 1), MAX_SAMPLES)
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        if _at_least("max_tokens", self.max_tokens, 0) == 0 and (self.num_samples > 1 or self.use_beam_search):
            raise ValueError("max_tokens=0 only scores the prompt; n, best_of and use_beam_search need "
                             "max_tokens >= 1")
        if _at_least("min_tokens", self.min_tokens, 0) > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({_show(self.max_tokens)}), "
                f"got {_show(self.min_tokens)}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _at_least(name, getattr(self, name), 0)
        if self.seed is not None and not 0 <= _int("seed", self.seed) < _MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**64), got {_show(self.seed)}")

    def _check_sampling(self) -> None:
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 1, or 0 / -1 to disable, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    def _check_penalties(self) -> None:
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")

    def _check_stops(self) -> None:
        if any(s == "" for s in self.stop):
            raise ValueError("stop must not contain empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {_show(list(self.stop_token_ids))}")

    def _check_constraints(self) -> None:
        for name in UNSUPPORTED_FIELD_NAMES:
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is not supported")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty (leave it None to allow every token)")
        if any(t < 0 for t in self.allowed_token_ids or ()):
            raise ValueError(f"allowed_token_ids must be >= 0, got {list(self.allowed_token_ids)}")
        if any(not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must not contain empty strings")
        if self.truncate_prompt_tokens is not None and not (
                _int("truncate_prompt_tokens", self.truncate_prompt_tokens) >= 1
                or self.truncate_prompt_tokens == -1):
            raise ValueError(f"truncate_prompt_tokens must be >= 1, or -1 for max_model_len, "
                             f"got {self.truncate_prompt_tokens}")
        if _at_least("prompt_logprobs_start", self.prompt_logprobs_start, 0) and self.prompt_logprobs is None:
            raise ValueError("prompt_logprobs_start needs prompt_logprobs")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (use stop_token_ids instead)")

    def check_output_cost(self, max_model_len: int | None = None) -> None:
        """Raise ValueError when samples x max_tokens x (logprobs + 1) is over MAX_OUTPUT_ENTRIES;
        max_tokens counts at most `max_model_len` (no sequence grows longer), when it is known."""
        limits = [t for t in (self.max_tokens, max_model_len) if t is not None]  # None: "up to the context"
        tokens = min(limits, default=0)
        entries = self.num_samples * tokens * ((self.logprobs or 0) + 1)
        if entries > MAX_OUTPUT_ENTRIES:
            raise ValueError(f"n (or best_of) x max_tokens x (logprobs + 1) = {entries:,} is over the cap of "
                             f"{MAX_OUTPUT_ENTRIES:,} output entries per request; ask for fewer samples, "
                             "tokens or logprobs")

    def _check_costs(self) -> None:
        _check_string_list("stop", self.stop, MAX_STOP_STRINGS)
        _check_string_list("bad_words", self.bad_words, MAX_BAD_WORDS)

    def _check_beam_search(self) -> None:
        if self.temperature != 0.0:
            raise ValueError("temperature must be 0 when use_beam_search is true")
        for name, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)):
            if getattr(self, name) != off:
                raise ValueError(f"{name} must be left off ({off}) when use_beam_search is true")


UNSUPPORTED_FIELD_NAMES = ("logits_processors", "output_kind", "extra_args")
ALIAS_FIELD_NAMES = ("guided_decoding",)  # accepted, always moved into structured_outputs
FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams) if not f.name.startswith("_")
                                     and f.name not in UNSUPPORTED_FIELD_NAMES + ALIAS_FIELD_NAMES)


def _set(obj: SamplingParams, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # normalising a frozen instance inside __post_init__


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {_show(value)}")
    return value


def _at_least(name: str, value: Any, lowest: int) -> int:
    if _int(name, value) < lowest:
        raise ValueError(f"{name} must be >= {lowest}, got {_show(value)}")
    return value


def _at_most(name: str, value: int, highest: int) -> int:
    if value > highest:
        raise ValueError(f"{name} must be <= {highest} (the cap on samples per request), "
                         f"got {_show(value)}")
    return value


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {_show(value)}")
    try:
        number = float(value)  # an integer past ~1.8e308 has no float
    except OverflowError:
        raise ValueError(f"{name} is too large, got {_show(value)}") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {_show(value)}")
    return number


def _show(value: Any, limit: int = 60) -> str:
    """A value for an error message, cut short: a hostile line may hold megabytes in one field."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int past the digit limit, a deeply nested list
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {_show(value)}")


def _check_string_list(name: str, values: tuple[str, ...], max_count: int) -> None:
    if len(values) > max_count:
        raise ValueError(f"{name} holds {len(values):,} strings, over the cap of {max_count:,}")
    size = sum(len(v.encode("utf-8", "surrogatepass")) for v in values)
    if size > MAX_STRING_LIST_BYTES:
        raise ValueError(f"{name} holds {size:,} bytes, over the cap of {MAX_STRING_LIST_BYTES:,}")


def _stop_tuple(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise ValueError(f"stop must be a string or a list of strings, got {_show(value)}")


def _string_tuple(name: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise ValueError(f"{name} must be a list of strings, got {_show(value)}")


def _logit_bias(value: Any) -> dict[int, float]:
    """{token id: bias}; string keys (OpenAI's JSON spelling) are read as ids, as vLLM does."""
    if not isinstance(value, Mapping):
        raise ValueError(f"logit_bias must be an object {{token id: bias}}, got {value!r}")
    bias = {}
    for key, amount in value.items():
        try:
            token_id = int(key) if isinstance(key, str) else _int("logit_bias", key)
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        if token_id < 0:
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {key!r}")
        bias[token_id] = _float("logit_bias", amount)
    return bias


def _int_tuple(name: str, value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of integers, got {_show(value)}")
    return tuple(_int(name, v) for v in value)
