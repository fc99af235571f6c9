"""Llama: the decoder forward over a paged KV cache, written once against `ops` / `ops.xp`.

One decoder for every supported family; the config's `ArchSpec` (models/arch_spec.py) switches on
what a family adds: q/k/v biases (Qwen2), RMSNorm of each q and k head before RoPE (Qwen3), a
sliding attention window on every layer (Mistral; `config.sliding_window`, passed to ops.attention).

Legend for shape comments:
    T  tokens in the batch (all sequences' new tokens, concatenated)   K  rows that need logits
    E  hidden size   I  intermediate size   V  vocab size
    H  query heads   Hkv  key/value heads   D  head dim
    L  layers   N  physical KV blocks   B  block size

Weights are kept [in, out] so every projection is `x @ W`; q/k/v are fused into one [E, (H+2Hkv)D]
matrix and gate/up into one [E, 2I] matrix, so a layer is four matmuls.
KV cache: [L, 2, N, B, Hkv, D] (kv[l, 0] = K, kv[l, 1] = V); see offline_paged/ops/attention.py.
Its element type is the model dtype, or `kv_cache_dtype` (float8_e4m3fn: the FP8 KV cache; uint8 bits on CUDA);
then every layer has a KvScales (offline_paged/ops/kv_scales.py) that the write and attention get.

Tensor parallel (`tp`, a models/tp_shard.py TensorParallelShard): the config and weights are one rank's
shard (H, Hkv, I divided by N, V its padded vocabulary slice); the forward all-reduces the embedding
and the outputs of o_proj and down, and all-gathers the logits to the full vocabulary.
"""
from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from offline_paged.ops.attention import AttentionMetadata, split_qkv
from offline_paged.ops.fp8_linear import QUANTIZATIONS, Fp8Linear
from offline_paged.ops.kv_scales import KvScales, is_fp8
from .checkpoint_scales import FUSED_LINEARS, fused_parts, layer_kv_scales, quantized_modules
from .config import LlamaConfig
from .rope import cos_sin_cache
from .weight_spec import check_weights

# FP8 weights (quantization="fp8", FP8 checkpoints) on the CUDA backend: the one switch. Their GPU tests
# (tests/test_ops_cuda_fp8_linear.py, tests/test_gpu_engine_fp8_weights.py) had not run on a device when it was
# turned on; False refuses them on CUDA again (the CPU backend is unaffected).
FP8_WEIGHTS_ON_CUDA = True


@dataclass(slots=True)
class LlamaLayer:
    input_norm: Any  # [E]
    qkv: Any  # [E, (H + 2 Hkv) D]
    o_proj: Any  # [H D, E]
    post_norm: Any  # [E]
    gate_up: Any  # [E, 2 I]
    down: Any  # [I, E]
    qkv_bias: Any = None  # [(H + 2 Hkv) D] (Qwen2)
    q_norm: Any = None  # [D] (Qwen3)
    k_norm: Any = None  # [D] (Qwen3)
    kv_scales: KvScales | None = None  # this layer's K / V scales when the KV cache is FP8


class Llama:
    """A Llama-layout decoder. `weights` maps HF tensor names to host arrays ([out, in] for linears);
    they are checked against the config, rearranged to [in, out], fused and uploaded through `ops.xp`.
    The RoPE table covers positions [0, max_positions) (default: the config's max_position_embeddings);
    the engine builds it only as long as its max_model_len (`set_max_positions`).
    `kv_cache_dtype`: the KV pool's element type (None: `dtype`); float8_e4m3fn gives each layer a
    KvScales (1.0, or taken from the first prefill with `calculate_kv_scales`).
    `quantization="fp8"`: every layer's linear weights (qkv, o_proj, gate_up, down; not the embedding or
    the LM head) become Fp8Linear (e4m3, per-output-channel scales; activations quantized per token at
    each product): `ops.quantize_linear` builds them (NumpyOps: Fp8Linear; CudaOps: CudaFp8Linear, cuBLASLt's FP8
    GEMM; FP8_WEIGHTS_ON_CUDA switches that off). A pre-quantized FP8 checkpoint (`config.quantization`) keeps its
    own e4m3 values and scales (models/checkpoint_scales.py) in the same Fp8Linear, whatever `quantization`
    says; its k_scale / v_scale tensors seed the FP8 KV cache's KvScales."""

    def __init__(self, config: LlamaConfig, weights: dict[str, np.ndarray], ops, dtype=np.float32,
                 max_positions: int | None = None, tp=None, consume_weights: bool = False,
                 kv_cache_dtype=None, calculate_kv_scales: bool = False, quantization: str | None = None):
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}")
        if quantization is not None and (tp is not None or (ops.xp is not np and not FP8_WEIGHTS_ON_CUDA)):
            raise ValueError(f"quantization={quantization!r} is not supported with tensor parallelism"
                             + ("" if FP8_WEIGHTS_ON_CUDA else " or on CUDA (use device='cpu')")
                             + " yet; leave quantization unset")
        if config.quantization is not None and (tp is not None or (ops.xp is not np and not FP8_WEIGHTS_ON_CUDA)):
            raise ValueError(f"this checkpoint's FP8 weights (quantization_config quant_method "
                             f"{config.quantization.method!r}) are not supported with tensor parallelism"
                             + ("" if FP8_WEIGHTS_ON_CUDA else " or on CUDA (use device='cpu')") + " yet")
        # A pre-quantized checkpoint decides which linears are FP8 (quantization="fp8" then changes nothing).
        self.quantization = "fp8" if config.quantization is not None else quantization
        self._fp8_modules = set(quantized_modules(config))
        check_weights(config, {name: np.shape(w) for name, w in weights.items()})
        # consume_weights: pop each tensor from `weights` once uploaded, so a device-resident source
        # (a tensor-parallel shard of a 70B shape) is freed as it goes instead of held twice.
        read = weights.pop if consume_weights else weights.__getitem__
        self.config = config
        self.ops = ops
        self.tp = tp
        xp = ops.xp
        self.dtype = xp.dtype(dtype)

        def upload(array) -> Any:  # host numpy or already on the device (e.g. dummy weights)
            return xp.ascontiguousarray(xp.asarray(array, dtype=self.dtype))

        self.embed = upload(read("model.embed_tokens.weight"))  # [V, E]
        if config.tie_word_embeddings:
            self.lm_head = self.embed.T  # [E, V] (a transposed view; BLAS reads it without a copy)
        else:
            self.lm_head = upload(xp.asarray(read("lm_head.weight"), dtype=self.dtype).T)  # [E, V]
        self.final_norm = upload(read("model.norm.weight"))  # [E]
        self.layers = [self._layer(weights, read, i, upload) for i in range(config.num_hidden_layers)]
        self.kv_cache_dtype = self.dtype if kv_cache_dtype is None else np.dtype(kv_cache_dtype)
        if is_fp8(self.kv_cache_dtype):
            for i, layer in enumerate(self.layers):
                layer.kv_scales = self._kv_scales(weights, i, calculate_kv_scales)
        self._upload = upload
        self.set_max_positions(max_positions or config.max_position_embeddings)
        self.scale = config.head_dim ** -0.5

    @staticmethod
    def _kv_scales(weights, layer: int, calculate: bool) -> KvScales:
        """Layer `layer`'s KvScales: the checkpoint's k_scale / v_scale where it has them, else 1.0
        (calculate: replaced by the first prefill's, as vLLM's calculate_kv_scales does)."""
        k_scale, v_scale = layer_kv_scales(weights, layer)
        return KvScales(1.0 if k_scale is None else k_scale, 1.0 if v_scale is None else v_scale, calculate)

    def set_max_positions(self, max_positions: int) -> None:
        """(Re)build the RoPE table for positions [0, max_positions)."""
        self.cos_sin_cache = self._upload(cos_sin_cache(self.config, self.dtype, max_positions))  # [P, D]

    def _layer(self, weights, read, i: int, upload) -> LlamaLayer:
        """Layer i from `read(name) -> tensor` (`weights`: which names the checkpoint has)."""
        p = f"model.layers.{i}."
        xp = self.ops.xp

        def linear(fused: str):
            modules = [p + part for part in FUSED_LINEARS[fused]]
            if modules[0] in self._fp8_modules:  # pre-quantized: the checkpoint's e4m3 values and scales
                static = self.config.quantization.static_activations
                return self.ops.upload_fp8_linear(Fp8Linear.from_quantized(*fused_parts(weights, read, p, fused,
                                                                                        static)))
            parts = [xp.asarray(read(m + ".weight"), dtype=self.dtype) for m in modules]
            if self.quantization == "fp8" and self.config.quantization is None:
                return self.ops.quantize_linear(xp.concatenate(parts, axis=0))  # [out, in] -> e4m3 + [out] scales
            return upload(xp.concatenate(parts, axis=0).T)

        spec = self.config.spec
        qkv_names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        return LlamaLayer(
            input_norm=upload(read(p + "input_layernorm.weight")),
            qkv=linear("qkv"),
            o_proj=linear("o_proj"),
            post_norm=upload(read(p + "post_attention_layernorm.weight")),
            gate_up=linear("gate_up"),
            down=linear("down"),
            qkv_bias=upload(xp.concatenate([xp.asarray(read(p + n + ".bias"), dtype=self.dtype)
                                            for n in qkv_names])) if spec.qkv_bias else None,
            q_norm=upload(read(p + "self_attn.q_norm.weight")) if spec.qk_norm else None,
            k_norm=upload(read(p + "self_attn.k_norm.weight")) if spec.qk_norm else None,
        )

    def allocate_kv_cache(self, num_blocks: int, block_size: int):
        """A zeroed pool [L, 2, N, B, Hkv, D] of `kv_cache_dtype` on the ops device (an FP8 pool is uint8
        on CUDA: `ops.kv_storage_dtype`)."""
        c = self.config
        shape = (c.num_hidden_layers, 2, num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        return self.ops.xp.zeros(shape, dtype=self.ops.kv_storage_dtype(self.kv_cache_dtype))

    @contextlib.contextmanager
    def kv_scales_held(self):
        """Within: no FP8 KvScales calculates (a dummy forward, such as the memory profile, must not fix the
        scales vLLM's calculate_kv_scales takes from the first real prefill)."""
        pending = [layer.kv_scales for layer in self.layers if layer.kv_scales is not None
                   and layer.kv_scales.calculate]
        for scales in pending:
            scales.calculate = False
        try:
            yield
        finally:
            for scales in pending:
                scales.calculate = True

    def forward(self, input_ids, positions, kv_cache, meta: AttentionMetadata, logits_indices=None,
                matmul=operator.matmul, logits_matmul=None):
        """Run the batch's new tokens through the model, writing their K/V into `kv_cache` by
        `meta.slot_mapping`. input_ids, positions: [T]; logits_indices: [K] rows of T (None: all
        rows). `matmul(x, W)` does every projection (the decode CUDA graphs pass a capture-safe GEMM);
        `logits_matmul(x, lm_head)` the LM head, returning float32 (None: ops.logits, which on CUDA
        writes the fp32 accumulator instead of rounding logits to fp16). Returns float32 logits [K, V]."""
        hidden = self.final_hidden(input_ids, positions, kv_cache, meta, logits_indices, matmul)  # [K, E]
        return self.logits(hidden, logits_matmul)

    def logits(self, hidden, logits_matmul=None):
        """float32 logits [K, V] of final-normed hidden states [K, E] (`logits_matmul` as in `forward`)."""
        if logits_matmul is None:
            return self._gather_logits(self.ops.logits(hidden, self.lm_head))  # [K, V] float32
        return self._gather_logits(logits_matmul(hidden, self.lm_head))  # [K, V] float32

    def final_hidden(self, input_ids, positions, kv_cache, meta: AttentionMetadata, rows=None,
                     matmul=operator.matmul, attention=None):
        """The final-normed hidden states [K, E] of `rows` [K] of the batch (None: all T rows): what
        the LM head reads, and what pooling (embeddings) reads. Arguments as in `forward`.
        `attention` replaces ops.attention (same arguments and result): the mixed-step graphs cut their
        captures there (offline_paged/worker/mixed_graphs.py)."""
        ops, eps = self.ops, self.config.rms_norm_eps
        attention = attention or ops.attention
        hidden = self._embed(input_ids)  # [T, E]
        residual = None
        # Between the kernels, FP8 layers may pass their input already quantized (`feeds`: the one linear an output
        # goes into) and their output before its scale epilogue (`ops.deferred`: read in by rms_norm / silu_mul).
        last = len(self.layers) - 1
        for i, (layer, layer_cache) in enumerate(zip(self.layers, kv_cache)):
            hidden, residual = ops.rms_norm(hidden, layer.input_norm, eps, residual, feeds=layer.qkv)
            hidden = self._attention(layer, hidden, positions, layer_cache, meta, matmul, attention)
            hidden, residual = ops.rms_norm(hidden, layer.post_norm, eps, residual, feeds=layer.gate_up)
            activated = ops.silu_mul(matmul(hidden, ops.deferred(layer.gate_up)), feeds=layer.down)  # [T, I]
            down = layer.down if i == last else ops.deferred(layer.down)  # the last one's rows are picked next
            hidden = self._all_reduce(matmul(activated, down))  # [T, E]
        if rows is not None:
            # The final norm is per row, so only the rows that are wanted go through it.
            hidden, residual = hidden[rows], residual[rows]  # [K, E]
        hidden, _ = ops.rms_norm(hidden, self.final_norm, eps, residual)  # [K, E]
        return hidden

    def _embed(self, input_ids):
        """Embedding rows of `input_ids` [T] -> [T, E]; under tensor parallelism each rank looks up
        the ids inside its vocabulary slice (zeros elsewhere) and the all-reduce sums the ranks."""
        xp = self.ops.xp
        if self.tp is None:
            return xp.take(self.embed, input_ids, axis=0)  # [T, E]
        local_ids = input_ids - self.tp.vocab_start  # [T]
        inside = (local_ids >= 0) & (local_ids < self.tp.vocab_per_rank)  # [T]
        hidden = xp.take(self.embed, xp.where(inside, local_ids, 0), axis=0)  # [T, E]
        hidden *= inside[:, None].astype(self.dtype)
        return self._all_reduce(hidden)

    def _all_reduce(self, partial):
        """Sum a row-parallel output [T, E] over the ranks, in place (identity without tp)."""
        if self.tp is not None:
            self.tp.communicator.all_reduce(partial)
        return partial

    def _gather_logits(self, logits):
        """[K, V/N] float32 of this rank's vocabulary slice -> [K, V] of the full vocabulary."""
        if self.tp is None:
            return logits
        gathered = self.tp.communicator.all_gather(logits)  # [N, K, V/N]
        full = self.ops.xp.moveaxis(gathered, 0, 1).reshape(logits.shape[0], -1)  # [K, N V/N]
        return self.ops.xp.ascontiguousarray(full[:, :self.tp.vocab_size])  # [K, V]

    def _attention(self, layer: LlamaLayer, hidden, positions, layer_cache, meta: AttentionMetadata,
                   matmul, attention):
        c = self.config
        # RoPE and the KV-cache write in one op (one kernel on the GPU): attention reads K/V from the
        # cache only, so the rotated k goes straight there.
        # An FP8 cache passes the layer's scales (only then: a 16-bit call keeps its plain signature).
        fp8 = {} if layer.kv_scales is None else {"kv_scales": layer.kv_scales}
        rope_args = (positions, self.cos_sin_cache, layer_cache[0], layer_cache[1], meta.slot_mapping)
        if layer.qkv_bias is None and layer.q_norm is None:
            # The projection goes into rope_write_kv only, so an FP8 one may come before its scale epilogue.
            qkv = matmul(hidden, self.ops.deferred(layer.qkv))  # [T, (H + 2 Hkv) D]
            q = self.ops.qkv_rope_write_kv(qkv, c.num_attention_heads, *rope_args, **fp8)  # [T, H, D]
        else:
            qkv = matmul(hidden, layer.qkv)  # [T, (H + 2 Hkv) D]
            if layer.qkv_bias is not None:
                qkv = self.ops.add_bias(qkv, layer.qkv_bias)  # [T, (H + 2 Hkv) D]
            q, k, v = split_qkv(qkv, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
            if layer.q_norm is not None:
                q, k = self.ops.head_rms_norm(q, k, layer.q_norm, layer.k_norm, c.rms_norm_eps)  # one GPU kernel
            q = self.ops.rope_write_kv(q, k, v, *rope_args, **fp8)  # [T, H, D]
        # o_proj's input rows [T, H D]: an FP8 o_proj may get them quantized by the attention kernel itself.
        out = attention(q, layer_cache[0], layer_cache[1], meta, self.scale,
                        sliding_window=c.sliding_window, feeds=layer.o_proj, **fp8)
        o_proj = self.ops.deferred(layer.o_proj)  # its output goes into the post-attention rms_norm only
        return self._all_reduce(matmul(out, o_proj))  # [T, E]
