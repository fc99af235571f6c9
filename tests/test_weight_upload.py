"""Streaming loads: peak host memory of a real load, conversions on a stand-in device, and the
pinned-buffer ring of StagedUpload driven by a stand-in for CuPy's few calls."""
from __future__ import annotations

import ctypes
import json
import math
import struct
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from offline_paged.models.checkpoint import open_checkpoint
from offline_paged.models.weight_upload import StagedUpload, load_tensors, to_device

BF16 = np.dtype(ml_dtypes.bfloat16)
MIB = 1 << 20


def write_bf16_shard(path, shapes: dict[str, tuple[int, ...]], pool: np.ndarray, rng) -> None:
    """A safetensors file of random bf16 tensors, each a window of `pool` at a random offset."""
    header, begin, parts = {}, 0, []
    for name, shape in shapes.items():
        count = math.prod(shape)
        start = int(rng.integers(0, pool.size - count))
        parts.append(pool[start:start + count])
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [begin, begin + 2 * count]}
        begin += 2 * count
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for part in parts:
            f.write(part.tobytes())


def llama_like_shapes(hidden=1024, inter=2816, layers=8, vocab=32000) -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (hidden, hidden),
                   p + "self_attn.v_proj.weight": (hidden, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                   p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,)}
    return shapes


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    """About 330 MB of bf16 in two shards of about 165 MB."""
    directory = tmp_path_factory.mktemp("big")
    rng = np.random.default_rng(0)
    pool = (rng.standard_normal(2 * 1024 * 32000, dtype=np.float32) * 0.02).astype(BF16)
    names = list(llama_like_shapes())
    shapes = llama_like_shapes()
    halves = (names[:len(names) // 2], names[len(names) // 2:])
    for k, part in enumerate(halves):
        write_bf16_shard(directory / f"model-{k + 1:05d}-of-00002.safetensors", {n: shapes[n] for n in part}, pool, rng)
    return directory


MEASURE = textwrap.dedent("""
    import sys
    import numpy as np
    from offline_paged.models.checkpoint import open_checkpoint
    from offline_paged.models.weight_upload import BFLOAT16, load_tensors

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    class Sink:
        '''A device that reads every byte it is given (as a real upload does) and keeps a checksum.'''
        __name__ = "sink"

        @staticmethod
        def asarray(host):
            return np.bitwise_xor.reduce(host.view(np.uint16).ravel())

    ckpt = open_checkpoint(sys.argv[1])
    baseline = status("VmRSS")
    out = load_tensors(ckpt, list(ckpt), Sink, BFLOAT16, progress=False)
    print(status("VmHWM") - baseline, ckpt.largest_shard_bytes(), len(out), ckpt.nbytes())
""")


def test_peak_host_memory_of_a_streaming_load(big_checkpoint):
    """The process's peak RSS (VmHWM) above its baseline stays under the largest shard + 64 MiB.
    Reading whole tensors and widening bf16 to fp32 (the old loader) peaked at ~2x the checkpoint."""
    result = subprocess.run([sys.executable, "-c", MEASURE, str(big_checkpoint)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    peak_above_baseline, largest_shard, num_tensors, total = map(int, result.stdout.split())
    assert num_tensors == len(llama_like_shapes()) and largest_shard < total
    assert peak_above_baseline <= largest_shard + 64 * MIB, (peak_above_baseline / MIB, largest_shard / MIB)


class NumpyDevice:
    """numpy behind another module's name: exercises the device branch of `to_device` on the CPU."""
    __name__ = "numpy_device"
    uint16, uint32, float32 = np.uint16, np.uint32, np.float32
    left_shift = staticmethod(np.left_shift)

    @staticmethod
    def asarray(host):
        return np.array(host, copy=True)


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("small")
    rng = np.random.default_rng(1)
    pool = rng.standard_normal(1 << 20, dtype=np.float32).astype(BF16)
    write_bf16_shard(directory / "model.safetensors", {"big": (1024, 600), "small": (7, 5)}, pool, rng)
    return directory


@pytest.mark.parametrize("xp", [np, NumpyDevice], ids=["numpy", "device"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=["fp32", "fp16", "bf16"])
def test_to_device_converts_whole_and_sliced_views(small_checkpoint, xp, dtype):
    ckpt = open_checkpoint(small_checkpoint)
    big = ckpt["big"]
    assert isinstance(big, np.memmap) and big.dtype == BF16 and not big.flags.writeable
    exact = np.asarray(big).astype(np.float64)
    for view, expected in ((big, exact), (big[100:300], exact[100:300]), (big[:, 8:40], exact[:, 8:40]),
                           (ckpt["small"], np.asarray(ckpt["small"]).astype(np.float64))):
        out = to_device(view, xp, dtype)
        assert out.dtype == np.dtype(dtype) and out.shape == view.shape
        np.testing.assert_array_equal(out.astype(np.float64), expected.astype(dtype).astype(np.float64))


class FakeCupy:
    """The calls StagedUpload makes on CuPy, on host memory: copies happen at once; `log` records
    which ring buffer each chunk went through and that every buffer's event was waited on first."""
    __name__ = "fake_cupy"
    uint8, uint16, uint32, float32 = np.uint8, np.uint16, np.uint32, np.float32
    left_shift = staticmethod(np.left_shift)

    def __init__(self):
        self.log = []
        device = self

        class Event:
            def __init__(self, block=False, disable_timing=True):
                self.recorded = False

            def record(self, stream=None):
                self.recorded = True

            def synchronize(self):
                assert self.recorded
                device.log.append("wait")

        class Stream:
            def __init__(self, non_blocking=True):
                self.ptr = 0

            def synchronize(self):
                pass

            def record(self):
                event = Event()
                event.record()
                return event

            def wait_event(self, event):
                assert event.recorded

        def memcpy_async(dst, src, size, kind, stream):
            assert kind == 1
            ctypes.memmove(dst, src, size)
            device.log.append(("copy", src, size))

        current = Stream()
        self.cuda = SimpleNamespace(Event=Event, Stream=Stream, alloc_pinned_memory=bytearray,
                                    get_current_stream=lambda: current,
                                    runtime=SimpleNamespace(memcpyAsync=memcpy_async))

    @staticmethod
    def empty(shape, dtype):
        array = np.empty(shape, dtype)
        return FakeDeviceArray(array)


class FakeDeviceArray(np.ndarray):
    def __new__(cls, array):
        return array.view(cls)

    @property
    def data(self):
        return SimpleNamespace(ptr=self.ctypes.data)


@pytest.mark.parametrize("dtype", [None, np.float32, np.float16], ids=["as-is", "fp32", "fp16"])
def test_staged_upload_chunks_through_the_ring(small_checkpoint, dtype):
    ckpt = open_checkpoint(small_checkpoint)
    device = FakeCupy()
    staged = StagedUpload(device, chunk_bytes=64 * 1024, num_buffers=3)
    big = staged.tensor(ckpt, "big", dtype)
    small = staged.tensor(ckpt, "small", dtype)
    for out, name in ((big, "big"), (small, "small")):
        expected = np.asarray(ckpt[name]).astype(dtype or BF16)
        assert out.dtype == expected.dtype and out.shape == expected.shape
        np.testing.assert_array_equal(np.asarray(out).astype(np.float64), expected.astype(np.float64))
    copies = [entry for entry in device.log if entry != "wait"]
    num_chunks = math.ceil(1024 * 600 * 2 / (64 * 1024)) + 1
    assert len(copies) == num_chunks and all(size <= 64 * 1024 for _, _, size in copies)
    buffers = [b.ctypes.data for b in staged.buffers]
    assert [src for _, src, _ in copies] == [buffers[k % 3] for k in range(num_chunks)]
    assert device.log.count("wait") == num_chunks - 3  # every reuse waited for the buffer's last copy


@pytest.mark.gpu
def test_load_tensors_on_cuda_equals_numpy(small_checkpoint):
    cupy = pytest.importorskip("cupy")
    ckpt = open_checkpoint(small_checkpoint)
    for dtype in (np.float16, np.float32, BF16):
        on_device = load_tensors(ckpt, list(ckpt), cupy, dtype, progress=False)
        on_host = load_tensors(ckpt, list(ckpt), np, dtype, progress=False)
        for name, array in on_host.items():
            assert on_device[name].dtype == array.dtype
            np.testing.assert_array_equal(cupy.asnumpy(on_device[name]).astype(np.float64),
                                          array.astype(np.float64))


@pytest.mark.gpu
def test_staged_upload_ring_on_cuda(small_checkpoint):
    """Many chunks through three pinned buffers on a real device: the ring's waits are real events."""
    cupy = pytest.importorskip("cupy")
    ckpt = open_checkpoint(small_checkpoint)
    staged = StagedUpload(cupy, chunk_bytes=64 * 1024, num_buffers=3)
    for dtype in (None, np.float16, np.float32, BF16):
        out = staged.tensor(ckpt, "big", dtype)
        staged.synchronize()
        expected = np.asarray(ckpt["big"]).astype(dtype or BF16)
        assert out.dtype == expected.dtype
        np.testing.assert_array_equal(cupy.asnumpy(out).astype(np.float64), expected.astype(np.float64))
