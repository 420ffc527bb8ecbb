"""What tensor and module names mean to the accounting: the role a tensor plays in its layer
(from its suffix), the category its bytes count under, and which block a module sits in.

Names are data here, across compressed-tensors, AutoGPTQ/GPTQModel, AutoAWQ and transformers.
"""

from __future__ import annotations

import re
from enum import Enum


class Category(str, Enum):
    quantized_weights = "quantized_weights"
    scales = "scales"  # weight scales, activation (input) scales, KV-cache scales
    zero_points = "zero_points"
    g_idx = "g_idx"
    shape_metadata = "shape_metadata"  # compressed-tensors weight_shape, I64[2] per packed layer
    unquantized_linear = "unquantized_linear"
    biases = "biases"
    embeddings = "embeddings"
    lm_head = "lm_head"
    norms = "norms"
    other = "other"


# Which categories are read at decode with a linear layer (for the --baseline linear ratio).
LINEAR_CATEGORIES = (Category.quantized_weights, Category.scales, Category.zero_points, Category.g_idx,
                     Category.shape_metadata, Category.unquantized_linear, Category.biases)
# Categories of quantization tensors: they carry no parameters of their own.
QUANTIZATION_CATEGORIES = (Category.scales, Category.zero_points, Category.g_idx, Category.shape_metadata)

# Tensor-name suffixes (the last dotted part of a name) and the role they play; a name whose
# suffix is none of these is "other".
SUFFIX_ROLES: dict[str, str] = {
    "weight_packed": "packed_weight",  # compressed-tensors pack-quantized
    "weight_scale": "weight_scale",
    "weight_scale_inv": "weight_scale",  # transformers fine-grained FP8
    "weight_zero_point": "weight_zero_point",
    "weight_g_idx": "g_idx",
    "weight_shape": "weight_shape",
    "weight_global_scale": "activation_scale",
    "input_scale": "activation_scale",
    "input_zero_point": "activation_scale",
    "input_global_scale": "activation_scale",
    "output_scale": "activation_scale",
    "output_zero_point": "activation_scale",
    "k_scale": "kv_scale",
    "v_scale": "kv_scale",
    "qweight": "packed_weight",  # GPTQ and AWQ
    "qzeros": "weight_zero_point",
    "scales": "weight_scale",
    "g_idx": "g_idx",
    "weight": "weight",
    "bias": "bias",
}
ROLE_CATEGORY = {
    "packed_weight": Category.quantized_weights,
    "weight_scale": Category.scales,
    "activation_scale": Category.scales,
    "kv_scale": Category.scales,
    "weight_zero_point": Category.zero_points,
    "g_idx": Category.g_idx,
    "weight_shape": Category.shape_metadata,
    "bias": Category.biases,
}
# Roles of quantization tensors (no parameters); outside a quantized layer they are strays.
QUANTIZATION_ROLES = frozenset({"weight_scale", "activation_scale", "kv_scale", "weight_zero_point", "g_idx", "weight_shape"})

# Architecture knowledge as data: module names of embeddings, output heads, norms and blocks
# across Llama/Mistral/Qwen (model.embed_tokens, lm_head), GPT-2 (wte, ln_f), GPT-NeoX
# (embed_in, embed_out), Falcon/BLOOM (word_embeddings), Meta's Llama (tok_embeddings, output).
EMBEDDING_MODULE = re.compile(
    r"(^|\.)(embed_tokens|wte|wpe|word_embeddings|embed_in|tok_embeddings|embed_positions|position_embeddings|token_type_embeddings)$")
LM_HEAD_MODULE = re.compile(r"(^|\.)(lm_head|embed_out)$|^output$")
NORM_MODULE = re.compile(r"(?i)(norm|^ln(_|\d|f|$))")
BLOCK_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks|block|layer|decoder_layers)\.(\d+)(?:\.|$)")


def tensor_role(name: str) -> tuple[str, str]:
    """(module, role) of a tensor name: 'model.layers.0.mlp.up_proj.qweight' -> (..up_proj, packed_weight)."""
    module, _, suffix = name.rpartition(".")
    if suffix in SUFFIX_ROLES:
        return module, SUFFIX_ROLES[suffix]
    return module, "other"


def block_index(module: str) -> int | None:
    match = BLOCK_INDEX.search(module)
    return int(match.group(1)) if match else None


def is_embedding(module: str) -> bool:
    return EMBEDDING_MODULE.search(module) is not None


def is_lm_head(module: str) -> bool:
    return LM_HEAD_MODULE.search(module) is not None


def is_norm(module: str) -> bool:
    return NORM_MODULE.search(module.rpartition(".")[2]) is not None


def short_name(name: str) -> str:
    # "model.layers.3.self_attn.q_proj" -> "self_attn.q_proj": the role within a block
    match = re.search(r"\.\d+\.(.+)$", name)
    return match.group(1) if match else name
