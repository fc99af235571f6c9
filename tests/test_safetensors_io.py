"""The safetensors reader validates the whole header before reading: every hostile header is one
ValueError naming the file, the tensor and the field."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from offline_paged.models.safetensors_io import SafetensorsFile, read_safetensors


def write_raw(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def entry(begin, end, shape=(2,), dtype="F32"):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def test_reads_what_safetensors_writes(tmp_path):
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float16),
              "empty": np.zeros((0, 3), np.float32)}
    save_file(arrays, str(tmp_path / "m.safetensors"))
    out = read_safetensors(tmp_path / "m.safetensors")
    assert set(out) == set(arrays)
    for name, array in arrays.items():
        np.testing.assert_array_equal(out[name], array)
    assert SafetensorsFile(tmp_path / "m.safetensors").entries["a"].shape == (2, 3)


HOSTILE = {
    "negative_begin": ({"w": entry(-8, 0)}, r"tensor w: 'data_offsets' \[-8, 0\] is not a range"),
    "end_before_begin": ({"w": entry(8, 0)}, r"tensor w: 'data_offsets' \[8, 0\] is not a range"),
    "overlap": ({"w": entry(0, 8), "v": entry(4, 12)}, r"tensors w and v overlap"),
    "same_range": ({"w": entry(0, 8), "v": entry(0, 8)}, r"tensors (w and v|v and w) overlap"),
    "wrapping_shape": ({"w": entry(0, 16, shape=(2**62, 4))},
                       r"tensor w: byte range does not match shape \(4611686018427387904, 4\)"),
    "wrapping_shape_to_zero": ({"w": entry(0, 0, shape=(2**62, 4))}, r"tensor w: byte range does not match"),
    "not_an_object": ({"w": [1, 2, 3]}, r"tensor w: header entry is not an object \(got list\)"),
    "missing_shape": ({"w": {"dtype": "F32", "data_offsets": [0, 8]}}, r"tensor w: 'shape' must be"),
    "string_offsets": ({"w": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}},
                       r"tensor w: 'data_offsets' must be \[begin, end\] integers"),
    "one_offset": ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8]}}, r"'data_offsets' must be"),
    "negative_dim": ({"w": entry(0, 8, shape=(-2, -1))}, r"tensor w: 'shape' must be a list of non-negative"),
    "float_dim": ({"w": entry(0, 8, shape=(2.0,))}, r"'shape' must be a list of non-negative integers"),
    "bool_dim": ({"w": entry(0, 8, shape=(True, 2))}, r"'shape' must be a list of non-negative integers"),
    "unknown_dtype": ({"w": entry(0, 8, dtype="F128")}, r"tensor w: unknown dtype 'F128'"),
    "past_the_end": ({"w": entry(0, 8), "v": entry(8, 4096, shape=(1022,))}, r"truncated safetensors file"),
    "metadata_not_object": ({"__metadata__": [1], "w": entry(0, 8)}, r"__metadata__ is not an object"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_header_is_one_clear_error(tmp_path, name):
    header, message = HOSTILE[name]
    path = tmp_path / "hostile.safetensors"
    write_raw(path, header, bytes(16))
    with pytest.raises(ValueError, match=r"hostile\.safetensors: " + r".*" + message):
        read_safetensors(path, {"w"})  # the whole header is checked, not only the wanted tensor


def test_negative_offset_never_reads_header_bytes(tmp_path):
    """The defect: begin = -len(header) read the JSON header as weights and the model ran on garbage."""
    raw = json.dumps({"w": entry(0, 8)}).encode()
    header = {"w": entry(-len(raw), -len(raw) + 8)}
    path = tmp_path / "neg.safetensors"
    write_raw(path, header, bytes(8))
    with pytest.raises(ValueError, match=r"neg\.safetensors: tensor w: 'data_offsets'"):
        read_safetensors(path)


@pytest.mark.parametrize("raw,message", [(b"[" * 100_000, "corrupt safetensors header"),
                                         (b'"just a string"', r"corrupt safetensors header \(not a JSON object"),
                                         (b"\xff\xfe", "corrupt safetensors header")])
def test_malformed_header_json(tmp_path, raw, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(ValueError, match=rf"bad\.safetensors: {message}"):
        read_safetensors(path)
