"""TensorRT-LLM 1.2 outputs: the unified checkpoint (config.json + rank{N}.safetensors) and the trtllm-build commands.

TensorRT-LLM is not a dependency: this writes what its docs and converters produce (reference-facts section 6,
examples/{medusa,eagle,ngram} of TensorRT-LLM) so that `trtllm-build` 1.2.x builds from it. The tensors and their
shards come from builder/trtllm_layout.py (the layout is runtime/engine.py's, which reads it back). Every config
key, flag and value written here is traced to its TensorRT-LLM source in ARCHITECTURE.md ("TensorRT-LLM export:
sources"). What a drafter adds to them is its builder kind's (`builder.drafters`: `trtllm_*`).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from builder.config import BuildPlan
from builder.drafters import builder_kind
from builder.trtllm_layout import shard_rank, target_to_trtllm
from runtime.config import DTYPES, ModelConfig
from runtime.engine import TARGET_FILE, TRTLLM_CONFIG, TRTLLM_DIR, QKVLayout, TPLayout, rank_file
from runtime.errors import ConfigError
from runtime.tree import Tree

TRTLLM_ENGINE_DIR = "trtllm_engine"  # trtllm-build.sh's default output, inside the engine directory
TRTLLM_VERSION = "1.2"  # the last TensorRT-LLM line with the TensorRT-engine backend (trtllm-build)

# The dtypes TensorRT-LLM supports for the models and decoding modes we export: the support matrices of
# examples/medusa/README.md ("FP16, BF16"), examples/eagle/README.md ("FP16/BF16"), examples/ngram/README.md
# ("FP16 / BF16 / FP8") and examples/models/core/qwen/README.md (the "FP16/BF16" column). One rule for every export:
# the runtime's dtype when it is one of these, else float16 (more mantissa than bfloat16 for weights of ordinary
# magnitude; a weight beyond float16's range stops the build and names the tensor).
TRTLLM_DTYPES = ("float16", "bfloat16")
TRTLLM_FALLBACK_DTYPE = "float16"
# QWenConfig.from_hugging_face (tensorrt_llm/models/qwen/config.py) writes seq_length = the HF config's seq_length,
# else 8192, and a Qwen checkpoint without it fails trtllm-build ("'QWenConfig' object has no attribute
# 'seq_length'", NVIDIA/TensorRT-LLM issue #3105). Qwen2 HF configs have no seq_length: the converter's default.
QWEN_SEQ_LENGTH = 8192


def trtllm_dtype(runtime_dtype: str) -> str:
    """The dtype of the TensorRT-LLM checkpoint for a build whose runtime dtype is `runtime_dtype`."""
    return runtime_dtype if runtime_dtype in TRTLLM_DTYPES else TRTLLM_FALLBACK_DTYPE


def dtype_note(runtime_dtype: str) -> str:
    """One line for the manifest and the build log: which dtype TensorRT-LLM gets, and why."""
    export = trtllm_dtype(runtime_dtype)
    if export == runtime_dtype:
        return f"TensorRT-LLM checkpoint in {export} (the runtime dtype; supported by TensorRT-LLM)"
    return (f"TensorRT-LLM checkpoint in {export}: TensorRT-LLM supports {' / '.join(TRTLLM_DTYPES)} for these models "
            f"and decoding modes, not {runtime_dtype}; the runtime keeps its {runtime_dtype} weights in "
            f"{TARGET_FILE}")


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


def checkpoint_config(plan: BuildPlan, drafter: Any) -> dict[str, Any]:
    """trtllm_checkpoint/config.json; `drafter`: the runtime drafter built for this plan."""
    m = plan.model
    tp = plan.config.build.tp_size
    dtype = trtllm_dtype(plan.dtype)
    cfg: dict[str, Any] = {"architecture": m.architecture, **_decoder_fields(m, dtype, tp)}
    if m.architecture == "Qwen2ForCausalLM":
        # MedusaConfig picks QWenConfig as its base when "qwen" is in model_type (tensorrt_llm/models/medusa/
        # config.py); QWenDecoderLayer branches on qwen_type; seq_length: see QWEN_SEQ_LENGTH.
        cfg.update(qwen_type="qwen2", model_type="qwen2", seq_length=QWEN_SEQ_LENGTH)
    cfg.update(builder_kind(plan.draft.kind).trtllm_config(plan, drafter, lambda c: _decoder_fields(c, dtype, tp)))
    return cfg


def checkpoint_tensors(
    plan: BuildPlan, target: Mapping[str, torch.Tensor], drafter: Any
) -> tuple[dict[str, torch.Tensor], TPLayout]:
    """Full (unsharded) TensorRT-LLM tensors of the target (+ draft heads) in `trtllm_dtype(plan.dtype)`, and their
    layout. ConfigError, naming the tensor, when a weight does not fit that dtype's range.

    target: the target's validated HF tensors; drafter: the runtime drafter built for this plan (its weights
    were validated by runtime/drafters/ loaders).
    """
    tensors = target_to_trtllm(plan.model, target)
    draft_layout = builder_kind(plan.draft.kind).trtllm_tensors(plan, drafter, dict(target), tensors)
    name = trtllm_dtype(plan.dtype)
    dtype = DTYPES[name]
    limit = torch.finfo(dtype).max
    out = {}
    for n, t in tensors.items():
        if t.dtype != dtype and t.is_floating_point() and t.numel() and float(t.abs().max()) > limit:
            raise ConfigError(f"TensorRT-LLM export: {n} has a weight of magnitude {float(t.abs().max()):.4g}, beyond "
                              f"{name}'s range ({limit:.4g}); build with dtype bfloat16")
        out[n] = t.to(dtype)
    return out, TPLayout(plan.model.vocab_size, QKVLayout.of(plan.model), draft_layout)


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
        # the README builds' spelling (e.g. examples/eagle/README.md); a dtype is accepted by every 1.x plugin parser
        "--gemm_plugin", trtllm_dtype(plan.dtype),
        "--max_batch_size", str(b.max_batch_size),
        "--max_input_len", str(plan.max_seq_len - 1),
        "--max_seq_len", str(plan.max_seq_len),
        "--workers", str(b.tp_size),
    ]
    return args + builder_kind(plan.draft.kind).trtllm_build_args(plan)


def run_args(plan: BuildPlan) -> list[str]:
    """Extra arguments of TensorRT-LLM 1.2's examples/run.py for this drafter (flags of examples/utils.py
    add_common_args). A weighted drafter with prompt lookup merged in runs there as the model drafter alone:
    TensorRT-LLM has no such merge (the merge is spectree's runtime's), nor pruning by path probability."""
    return builder_kind(plan.draft.kind).trtllm_run_args(plan)


def run_launcher(plan: BuildPlan) -> str:
    """What runs examples/run.py: mpirun with one process per rank, unless the drafter's run spreads its ranks
    itself (`BuilderKind.trtllm_mpirun`)."""
    tp = plan.config.build.tp_size
    return f"mpirun -n {tp} --allow-run-as-root " if tp > 1 and builder_kind(plan.draft.kind).trtllm_mpirun else ""


def build_script(plan: BuildPlan, header: str) -> str:
    """trtllm-build.sh: builds the TensorRT-LLM engine from trtllm_checkpoint/ (convert is already done)."""
    pairs = [" ".join(_quote(a) for a in pair) for pair in _pairs(build_args(plan))]
    build = " \\\n    ".join(["trtllm-build", *pairs])
    run = ["python3", "examples/run.py", "--engine_dir", '"$OUT"', "--tokenizer_dir", '"$HERE"', "--max_output_len=128"]
    run += [shlex.quote(a) for a in run_args(plan)]
    return f"""#!/usr/bin/env bash
# {header}
# TensorRT-LLM {TRTLLM_VERSION}.x: builds the TensorRT-LLM engine from the converted checkpoint in
# {TRTLLM_DIR}/ (config.json + one rank file per tensor-parallel rank). Usage: ./trtllm-build.sh [OUTPUT_DIR]
# {dtype_note(plan.dtype)}.
set -euo pipefail
HERE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
CKPT="$HERE/{TRTLLM_DIR}"
OUT="${{1:-$HERE/{TRTLLM_ENGINE_DIR}}}"

{build}

# Run it from a TensorRT-LLM {TRTLLM_VERSION} checkout:
#   {run_launcher(plan)}{" ".join(run)}
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
    "QWEN_SEQ_LENGTH", "TRTLLM_DTYPES", "TRTLLM_ENGINE_DIR", "TRTLLM_VERSION", "build_args", "build_script",
    "checkpoint_config", "checkpoint_tensors", "choices_string", "dtype_note", "max_non_leaves_per_layer",
    "rotary_scaling", "run_args", "run_launcher", "trtllm_dtype", "write_checkpoint",
]
