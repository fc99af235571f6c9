"""Counter-based random stream: uniform numbers as a pure function of (seed, position, index).

Specified in ARCHITECTURE.md ("Random streams") so that a GPU kernel reproduces it bit for bit:

    x = seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + index   (mod 2**64)
    x = splitmix64 finaliser(x)
    u = ((x >> 11) + 0.5) / 2**53

u lies in (0, 1) in exact arithmetic, but in float64 the top mantissa (x >> 11 == 2**53 - 1) rounds
to exactly 1.0 (probability 2**-53 per draw); users of u must accept u == 1 (-log u == 0).

There is no state, so a draw never depends on batch composition, pool size or preemption.
`stream_seed(seed, sample_index)` gives each of the n parallel samples of one request its own
stream; sample 0 keeps the request's seed, so n=1 and the first of n samples draw alike.
"""
import numpy as np

_SEED_MULT = np.uint64(0x9E3779B97F4A7C15)
_POSITION_MULT = np.uint64(0xBF58476D1CE4E5B9)
_MIX_MULT_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_MULT_2 = np.uint64(0x94D049BB133111EB)
_SAMPLE_MULT = 0xD1B54A32D192ED03  # odd constant spacing the per-sample seeds apart
_MASK64 = 2**64 - 1
_TWO_POW_MINUS_53 = 2.0**-53


def _as_u64(values) -> np.ndarray:
    """Python ints (any size) or integer arrays -> uint64 array, reduced mod 2**64."""
    arr = np.asarray(values)
    if arr.dtype == object or arr.dtype.kind not in "iu":
        arr = np.asarray(np.vectorize(lambda v: int(v) & _MASK64, otypes=[np.uint64])(arr))
    return arr.astype(np.uint64, copy=False)


def mix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * _MIX_MULT_1
        x = x ^ (x >> np.uint64(27))
        x = x * _MIX_MULT_2
        return x ^ (x >> np.uint64(31))


def random_bits(seed, position, index) -> np.ndarray:
    """The 64-bit hash behind `uniform`; arguments broadcast like numpy arrays."""
    with np.errstate(over="ignore"):
        x = _as_u64(seed) * _SEED_MULT + _as_u64(position) * _POSITION_MULT + _as_u64(index)
    return mix64(x)


def uniform(seed, position, index) -> np.ndarray:
    """Float64 uniforms in (0, 1] (1.0 only at the top mantissa); arguments broadcast.

    Typical use: `uniform(seed, position, np.arange(vocab_size))` -> [vocab_size], one number
    per token for the exponential race at output position `position`.
    """
    mantissa = (random_bits(seed, position, index) >> np.uint64(11)).astype(np.float64)
    return (mantissa + 0.5) * _TWO_POW_MINUS_53


def stream_seed(seed: int, sample_index: int) -> int:
    """The seed of sample `sample_index` of a request seeded with `seed` (sample 0 keeps it)."""
    if sample_index < 0:
        raise ValueError(f"sample_index must be >= 0, got {sample_index}")
    if sample_index == 0:
        return int(seed) & _MASK64
    x = np.asarray((int(seed) + sample_index * _SAMPLE_MULT) & _MASK64, dtype=np.uint64)
    return int(mix64(x))


_UNSEEDED_INDEX = 0x5EED  # stream index used to derive an unseeded request's seed


def unseeded_request_seed(engine_seed: int, arrival: int) -> int:
    """The seed of a request that gave none: drawn from the engine seed at the request's arrival
    index (a data-parallel coordinator draws it from its own count, so workers never share one)."""
    return int(random_bits(engine_seed, arrival, _UNSEEDED_INDEX))
