"""HF tensors -> TensorRT-LLM's unified checkpoint tensors, and their tensor-parallel shards (the export direction).

The layout itself (names, shard rules, QKVLayout / TPLayout, vocabulary padding) and its inverse, which the runtime
uses to read an engine's weights back (`unshard`, `layers_from_trtllm`, `target_from_trtllm`), are in
runtime/engine.py; `shard` here and `unshard` there are exact inverses (tests/test_builder_trtllm.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from runtime.config import ModelConfig
from runtime.engine import (
    REPLICATE,
    SPLIT0,
    SPLIT1,
    VOCAB,
    EngineError,
    QKVLayout,
    TPLayout,
    layer_names,
    pad_vocab_size,
    shard_rule,
)
from runtime.errors import CheckpointError, ConfigError


def shard(tensors: Mapping[str, torch.Tensor], layout: TPLayout, tp_size: int) -> list[dict[str, torch.Tensor]]:
    """Full (unsharded) TensorRT-LLM tensors -> one state dict per rank; the inverse is `unshard`."""
    return [shard_rank(tensors, layout, tp_size, rank) for rank in range(tp_size)]


def shard_rank(
    tensors: Mapping[str, torch.Tensor], layout: TPLayout, tp_size: int, rank: int
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s state dict (one rank at a time keeps the writer's memory at full model + one rank).

    Every shard is a fresh contiguous tensor (safetensors refuses views sharing storage).
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        rule = shard_rule(name)
        if rule == REPLICATE:
            part = t
        elif rule == SPLIT0 or rule == SPLIT1:
            part = _split(t, 0 if rule == SPLIT0 else 1, tp_size, name)[rank]
        elif rule == VOCAB:
            padded = pad_vocab_size(layout.vocab_size, tp_size)
            if t.shape[0] != layout.vocab_size:
                raise EngineError(f"{name} has {t.shape[0]} rows, expected the vocabulary size {layout.vocab_size}")
            rows = padded // tp_size
            part = t[rank * rows : min((rank + 1) * rows, t.shape[0])]
            if part.shape[0] < rows:  # the last rank(s) carry the zero padding rows
                part = torch.cat([part, t.new_zeros(rows - part.shape[0], *t.shape[1:])])
        else:
            part = _split_qkv(t, layout.qkv(name), tp_size, name)[rank]
        out[name] = part.contiguous().clone()
    return out


def _split(t: torch.Tensor, dim: int, tp_size: int, name: str) -> list[torch.Tensor]:
    if t.ndim <= dim or t.shape[dim] % tp_size:
        raise ConfigError(f"{name} {tuple(t.shape)}: dim {dim} does not split evenly over tp_size {tp_size}")
    return list(torch.chunk(t, tp_size, dim=dim))


def _split_qkv(t: torch.Tensor, qkv: QKVLayout, tp_size: int, name: str) -> list[torch.Tensor]:
    """[q; k; v] rows -> per rank [q_r; k_r; v_r]; kv heads are duplicated when fewer than ranks."""
    qkv.check_tp(tp_size, name)
    if t.shape[0] != qkv.q_size + 2 * qkv.kv_size:
        raise EngineError(f"{name} has {t.shape[0]} rows, expected q + k + v = {qkv.q_size + 2 * qkv.kv_size}")
    q, k, v = torch.split(t, [qkv.q_size, qkv.kv_size, qkv.kv_size], dim=0)
    copies = qkv.kv_copies(tp_size)
    if copies > 1:  # [h0, h1] -> [h0, h0, h1, h1]: rank r gets kv head r // copies
        d = qkv.head_dim
        k = k.reshape(qkv.num_kv_heads, d, *k.shape[1:]).repeat_interleave(copies, 0).reshape(-1, *k.shape[1:])
        v = v.reshape(qkv.num_kv_heads, d, *v.shape[1:]).repeat_interleave(copies, 0).reshape(-1, *v.shape[1:])
    return [torch.cat(parts) for parts in zip(q.chunk(tp_size), k.chunk(tp_size), v.chunk(tp_size))]


def layers_to_trtllm(
    tensors: Mapping[str, torch.Tensor], hf_prefix: str, trt_prefix: str, num_layers: int
) -> dict[str, torch.Tensor]:
    """Decoder layers from HF names ({hf_prefix}{i}.self_attn.q_proj.weight ...) to TensorRT-LLM names."""
    out = {trt: tensors[hf] for hf, trt in layer_names(hf_prefix, trt_prefix, num_layers) if hf in tensors}
    for i in range(num_layers):
        src, dst = f"{hf_prefix}{i}.", f"{trt_prefix}{i}."
        for kind in ("weight", "bias"):
            names = [f"{src}self_attn.{p}_proj.{kind}" for p in "qkv"]
            present = [n in tensors for n in names]
            if all(present):
                out[f"{dst}attention.qkv.{kind}"] = torch.cat([tensors[n] for n in names], dim=0)
            elif any(present):
                raise CheckpointError(f"layer {i}: q/k/v {kind}s must all be present or all absent")
    return out


def target_to_trtllm(config: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The target's HF tensors (validated, see runtime.checkpoint) -> full TensorRT-LLM tensors."""
    out = {
        "transformer.vocab_embedding.weight": tensors["model.embed_tokens.weight"],
        "transformer.ln_f.weight": tensors["model.norm.weight"],
        # Tied embeddings: TensorRT-LLM still stores lm_head.weight (a copy of the embedding).
        "lm_head.weight": tensors["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"],
    }
    out.update(layers_to_trtllm(tensors, "model.layers.", "transformer.layers.", config.num_hidden_layers))
    return out


def medusa_to_trtllm(
    res_weight: torch.Tensor,  # [heads, layers, H, H]
    res_bias: torch.Tensor,  # [heads, layers, H]
    lm_weight: torch.Tensor,  # [heads, V, H]
) -> dict[str, torch.Tensor]:
    """Medusa heads (runtime.drafters.medusa.MedusaHeads parameters) -> TensorRT-LLM medusa_heads.* tensors."""
    out: dict[str, torch.Tensor] = {}
    for h in range(lm_weight.shape[0]):
        for layer in range(res_weight.shape[1]):
            p = f"medusa_heads.{h}.medusa_layers.{layer}.linear."
            out[p + "weight"] = res_weight[h, layer]
            out[p + "bias"] = res_bias[h, layer]
        out[f"medusa_heads.{h}.lm_head.weight"] = lm_weight[h]
    return out


def eagle_to_trtllm(
    head_state: Mapping[str, torch.Tensor],
    head_config: ModelConfig,
    num_eagle_layers: int,
    target_embedding: torch.Tensor,  # [V, H]
    target_lm_head: torch.Tensor,  # [V, H]
) -> dict[str, torch.Tensor]:
    """An EAGLE-1 head (EAGLE checkpoint names: fc.*, layers.{i}.*, embed_tokens.weight) -> TensorRT-LLM's
    eagle_nets.{d}.* for each of the num_eagle_layers EagleNets (TensorRT-LLM keeps one copy per draft depth).

    TensorRT-LLM's fc always has a bias; a head trained without one gets zeros (the same function).
    """
    fc_w = head_state["fc.weight"]
    fc_b = head_state.get("fc.bias", fc_w.new_zeros(fc_w.shape[0]))
    embedding = head_state.get("embed_tokens.weight", target_embedding)
    layers = layers_to_trtllm(head_state, "layers.", "layers.", head_config.num_hidden_layers)
    out: dict[str, torch.Tensor] = {}
    for d in range(num_eagle_layers):
        p = f"eagle_nets.{d}."
        out[p + "drafter.fc.weight"] = fc_w
        out[p + "drafter.fc.bias"] = fc_b
        out[p + "drafter.vocab_embedding.weight"] = embedding
        out[p + "lm_head.weight"] = target_lm_head
        out.update({p + "drafter." + n: t for n, t in layers.items()})
    return out


__all__ = ["shard", "shard_rank", "layers_to_trtllm", "target_to_trtllm", "medusa_to_trtllm", "eagle_to_trtllm"]
