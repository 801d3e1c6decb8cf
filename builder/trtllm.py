"""TensorRT-LLM 1.2 outputs: the unified checkpoint (config.json + rank{N}.safetensors) and the trtllm-build commands.

TensorRT-LLM is not a dependency: this writes what its docs and converters produce (reference-facts section 6,
examples/{medusa,eagle,prompt_lookup} of TensorRT-LLM) so that `trtllm-build` 1.2.x builds from it. The tensor
names and sharding rules live in runtime/engine.py, next to their inverse the runtime reads back.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from builder.config import BuildPlan
from runtime.config import ModelConfig
from runtime.engine import (
    TRTLLM_CONFIG,
    TRTLLM_DIR,
    QKVLayout,
    TPLayout,
    eagle_to_trtllm,
    medusa_to_trtllm,
    rank_file,
    shard_rank,
    target_to_trtllm,
)
from runtime.tree import Tree

TRTLLM_VERSION = "1.2"  # the last TensorRT-LLM line with the TensorRT-engine backend (trtllm-build)


def rotary_scaling(config: ModelConfig) -> dict[str, Any] | None:
    s = config.rope_scaling
    if s is None:
        return None
    out: dict[str, Any] = {"type": s.rope_type, "rope_type": s.rope_type, "factor": s.factor}
    if s.rope_type == "llama3":
        out.update(
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position_embeddings,
        )
    return out


def _decoder_fields(config: ModelConfig, dtype: str, tp_size: int) -> dict[str, Any]:
    """The PretrainedConfig fields every Llama-family TensorRT-LLM checkpoint has."""
    return {
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "norm_epsilon": config.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": config.rope_theta,
        "rotary_scaling": rotary_scaling(config),
        "head_size": config.head_dim,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attn_bias": config.attention_bias,
        "mlp_bias": config.mlp_bias,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "mapping": {"world_size": tp_size, "tp_size": tp_size, "pp_size": 1},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
    }


def max_non_leaves_per_layer(tree: Tree) -> int:
    """Most non-leaf nodes at one depth (root at depth 0 included): TensorRT-LLM EAGLE's buffer bound."""
    counts: dict[int, int] = {}
    depth = tree.depth.tolist()
    for i in range(tree.num_nodes):
        if not tree.is_leaf(i):
            counts[depth[i]] = counts.get(depth[i], 0) + 1
    return max(counts.values(), default=1)


def checkpoint_config(plan: BuildPlan, eagle_head: ModelConfig | None = None) -> dict[str, Any]:
    """trtllm_checkpoint/config.json."""
    m = plan.model
    tp = plan.config.build.tp_size
    cfg: dict[str, Any] = {"architecture": m.architecture, **_decoder_fields(m, plan.dtype, tp)}
    if m.architecture == "Qwen2ForCausalLM":
        cfg.update(qwen_type="qwen2", model_type="qwen2")  # MedusaConfig picks its Qwen base from model_type
    if plan.method == "medusa":
        cfg.update(
            architecture="MedusaForCausalLM",
            num_medusa_heads=plan.num_medusa_heads,
            num_medusa_layers=plan.num_medusa_layers,
            max_draft_len=plan.config.build.max_draft_len,
        )
    elif plan.method == "eagle":
        assert eagle_head is not None
        net = {"architecture": "LlamaForCausalLM", **_decoder_fields(eagle_head, plan.dtype, tp)}
        net.update(tie_word_embeddings=False, mlp_bias=False, head_dim=eagle_head.head_dim)
        cfg.update(
            architecture="EagleForCausalLM",
            num_eagle_layers=plan.max_tree_depth,
            max_draft_len=plan.config.build.max_draft_len,
            max_non_leaves_per_layer=(
                max_non_leaves_per_layer(plan.tree) if plan.tree is not None else plan.dynamic.top_k
            ),
            eagle_net_config=net,
        )
    return cfg


def checkpoint_tensors(
    plan: BuildPlan, target: Mapping[str, torch.Tensor], drafter: Any
) -> tuple[dict[str, torch.Tensor], TPLayout]:
    """Full (unsharded) TensorRT-LLM tensors of the target (+ draft heads) in the build dtype, and their layout.

    target: the target's validated HF tensors; drafter: the runtime drafter built for this plan (its weights
    were validated by runtime/drafters/ loaders).
    """
    tensors = target_to_trtllm(plan.model, target)
    eagle = None
    if plan.method == "medusa":
        h = drafter.heads
        lm = h.lm_weight  # [heads, K, H]
        if h.vocab is not None:
            # TensorRT-LLM's Medusa has no reduced draft vocabulary (only EAGLE-3 does): the heads go out over the
            # full vocabulary, rows outside the draft vocabulary zero. Drafting there is then over all V tokens
            # (a zero logit may outrank a draft token: lower acceptance, never a different output).
            full = lm.new_zeros(lm.shape[0], h.vocab.target_vocab, lm.shape[2])
            full[:, h.vocab.target_ids.to(lm.device)] = lm
            lm = full
        tensors.update(medusa_to_trtllm(h.res_weight, h.res_bias, lm))
    elif plan.method == "eagle":
        head = drafter.head
        eagle = QKVLayout.of(head.config)
        tensors.update(
            eagle_to_trtllm(
                head.state_dict(),
                head.config,
                plan.max_tree_depth,
                target["model.embed_tokens.weight"],
                tensors["lm_head.weight"],
            )
        )
    dtype = plan.model.torch_dtype
    return {n: t.to(dtype) for n, t in tensors.items()}, TPLayout(plan.model.vocab_size, QKVLayout.of(plan.model), eagle)


def write_checkpoint(
    out_dir: Path,
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    layout: TPLayout,
    tp_size: int,
    on_rank: Callable[[int], None] | None = None,
) -> list[Path]:
    """Shard and write trtllm_checkpoint/ under out_dir; returns the files written."""
    from safetensors.torch import save_file

    root = out_dir / TRTLLM_DIR
    root.mkdir(parents=True, exist_ok=True)
    cfg_path = root / TRTLLM_CONFIG
    cfg_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    written = [cfg_path]
    for rank in range(tp_size):
        path = root / rank_file(rank)
        save_file(shard_rank(tensors, layout, tp_size, rank), str(path), metadata={"format": "pt"})
        written.append(path)
        if on_rank is not None:
            on_rank(rank)
    return written


# ---- trtllm-build and run commands --------------------------------------------------------------------------


def choices_string(tree: Tree) -> str:
    """The --medusa_choices / --eagle_choices value: a Python-literal list of paths, canonical order."""
    return "[" + ", ".join("[" + ", ".join(str(r) for r in path) + "]" for path in tree.choices) + "]"


def build_args(plan: BuildPlan) -> list[str]:
    """`trtllm-build` arguments (after the command name); $CKPT and $OUT are the script's variables."""
    b = plan.config.build
    args = [
        "--checkpoint_dir", "$CKPT",
        "--output_dir", "$OUT",
        "--gemm_plugin", "auto",
        "--max_batch_size", str(b.max_batch_size),
        "--max_input_len", str(plan.max_seq_len - 1),
        "--max_seq_len", str(plan.max_seq_len),
        "--workers", str(b.tp_size),
    ]
    if plan.method == "medusa":
        args += ["--speculative_decoding_mode", "medusa", "--max_draft_len", str(b.max_draft_len)]
    elif plan.method == "eagle":
        args += ["--speculative_decoding_mode", "eagle", "--max_draft_len", str(b.max_draft_len),
                 "--use_paged_context_fmha", "enable"]
    elif plan.method == "lookup":
        args += ["--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", str(b.max_draft_len),
                 "--use_paged_context_fmha", "enable"]
    return args


def run_args(plan: BuildPlan) -> list[str]:
    """Extra arguments of TensorRT-LLM's examples/run.py for this drafter."""
    if plan.method == "medusa":
        assert plan.tree is not None
        # TensorRT-LLM runs Medusa greedily only (its typical acceptance is lossy).
        return [f"--medusa_choices={choices_string(plan.tree)}", "--temperature=0.0", "--use_py_session"]
    if plan.method == "eagle":
        if plan.tree is not None:
            return [f"--eagle_choices={choices_string(plan.tree)}"]
        return ["--eagle_use_dynamic_tree", f"--eagle_dynamic_tree_max_top_k={plan.dynamic.top_k}"]
    if plan.method == "lookup":
        lk = plan.lookup
        return [f"--prompt_lookup_config=[{lk.num_draft_tokens},{lk.max_ngram},[0]]", "--kv_cache_enable_block_reuse"]
    return []


def build_script(plan: BuildPlan, header: str) -> str:
    """trtllm-build.sh: builds the TensorRT-LLM engine from trtllm_checkpoint/ (convert is already done)."""
    tp = plan.config.build.tp_size
    build = " \\\n    ".join(["trtllm-build"] + [" ".join(_quote(a) for a in pair) for pair in _pairs(build_args(plan))])
    run = ["python3", "examples/run.py", "--engine_dir", '"$OUT"', "--tokenizer_dir", '"$HERE"', "--max_output_len=128"]
    run += [shlex.quote(a) for a in run_args(plan)]
    launcher = f"mpirun -n {tp} --allow-run-as-root " if tp > 1 else ""
    return f"""#!/usr/bin/env bash
# {header}
# TensorRT-LLM {TRTLLM_VERSION}.x: builds the TensorRT-LLM engine from the converted checkpoint in
# {TRTLLM_DIR}/ (config.json + one rank file per tensor-parallel rank). Usage: ./trtllm-build.sh [OUTPUT_DIR]
set -euo pipefail
HERE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
CKPT="$HERE/{TRTLLM_DIR}"
OUT="${{1:-$HERE/trtllm_engine}}"

{build}

# Run it from a TensorRT-LLM {TRTLLM_VERSION} checkout:
#   {launcher}{" ".join(run)}
"""


def _pairs(args: list[str]) -> list[list[str]]:
    out: list[list[str]] = []
    for a in args:
        if a.startswith("--"):
            out.append([a])
        else:
            out[-1].append(a)
    return out


def _quote(arg: str) -> str:
    return f'"{arg}"' if arg.startswith("$") else shlex.quote(arg)


__all__ = [
    "TRTLLM_VERSION", "checkpoint_config", "checkpoint_tensors", "write_checkpoint", "build_args", "run_args",
    "build_script", "choices_string", "max_non_leaves_per_layer", "rotary_scaling",
]
