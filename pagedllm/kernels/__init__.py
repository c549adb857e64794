"""The compiled CPU kernels and the one Python facade every caller imports.

Each accessor (`layer_ops()`, `paged_attention_ops()`, ...) returns the built extension or
None, in which case the caller's torch formulation runs; the linears (`linear_op`,
`quantized_linear`, `bf16_linear`) pick kernel or torch themselves.
"""

from pagedllm.kernels.bf16 import KERNEL_MAX_ROWS, bf16_linear, native_bf16, use_bf16_kernels
from pagedllm.kernels.build import (
    EXTENSIONS,
    bf16_linear_ops,
    decode_layers_ops,
    extension,
    gguf_linear_ops,
    kernel_cache_root,
    layer_ops,
    paged_attention_ops,
    quant_linear_ops,
    use_layer_ops,
)
from pagedllm.kernels.elementwise import add_rms_norm, argmax_rows, rms_norm, rotary_embedding, silu_and_mul
from pagedllm.kernels.gemm import chunked_gemm
from pagedllm.kernels.gguf_blocks import (
    GGUF_BLOCK_GEOMETRY,
    KEPT_GGUF_TYPES,
    SMALL_M_MAX_ROWS,
    GGUFBlocks,
    gguf_embedding_lookup,
    gguf_linear,
)
from pagedllm.kernels.isa import ISAS, Isa, cpu_isa, detect_cpu_isa, set_cpu_isa
from pagedllm.kernels.linear import clear_weight_caches, linear_op
from pagedllm.kernels.quantization import (
    GROUP_SIZE,
    INT8_ACTIVATION_MIN_ROWS,
    INT16_MAX_ROWS,
    PANEL_MAX_ROWS,
    QUANTIZATION_METHODS,
    TILE_MAX_ROWS,
    QuantizedWeight,
    embedding_lookup,
    int8_activation_linear,
    module_weight_bytes,
    pack_int4,
    quantize,
    quantize_int4,
    quantize_activations_int8,
    quantize_int8,
    quantized_linear,
)

__all__ = [
    "EXTENSIONS",
    "GGUF_BLOCK_GEOMETRY",
    "GGUFBlocks",
    "KEPT_GGUF_TYPES",
    "SMALL_M_MAX_ROWS",
    "ISAS",
    "Isa",
    "GROUP_SIZE",
    "INT8_ACTIVATION_MIN_ROWS",
    "INT16_MAX_ROWS",
    "KERNEL_MAX_ROWS",
    "PANEL_MAX_ROWS",
    "QUANTIZATION_METHODS",
    "TILE_MAX_ROWS",
    "QuantizedWeight",
    "add_rms_norm",
    "argmax_rows",
    "bf16_linear",
    "bf16_linear_ops",
    "chunked_gemm",
    "clear_weight_caches",
    "cpu_isa",
    "decode_layers_ops",
    "detect_cpu_isa",
    "embedding_lookup",
    "extension",
    "gguf_embedding_lookup",
    "gguf_linear",
    "gguf_linear_ops",
    "int8_activation_linear",
    "kernel_cache_root",
    "layer_ops",
    "linear_op",
    "module_weight_bytes",
    "native_bf16",
    "pack_int4",
    "paged_attention_ops",
    "quant_linear_ops",
    "quantize",
    "quantize_activations_int8",
    "quantize_int4",
    "quantize_int8",
    "quantized_linear",
    "rms_norm",
    "rotary_embedding",
    "set_cpu_isa",
    "silu_and_mul",
    "use_bf16_kernels",
    "use_layer_ops",
]
