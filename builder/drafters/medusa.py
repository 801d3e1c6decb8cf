"""Medusa-1 in the builder: the engine's draft/ (FasterDecoding's files), TensorRT-LLM's MedusaForCausalLM export,
and training heads for a frozen target.

Training (FasterDecoding): head i = Linear(H -> V)(ResBlock^n(h_t)) predicts x_{t+i+2}, i.e. the distribution the
target gives at position t+i+1. Each head starts as the target itself: ResBlock linears at zero (identity) and the
vocabulary projection copied from the target's lm_head. Loss: sum_i 0.8^i CE_i (Medusa's weighting). Held-out
metrics: top-1 / top-5 agreement with the target's greedy token per head (= per tree depth).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from builder.config import BuildPlan
from builder.drafters import BuilderKind, EvalBatch, HeadInit, TrainingTarget
from builder.train_heads import EVAL_TOPK, cross_entropy, publish_head
from builder.training.config import HeadsSection, MedusaSection
from builder.trtllm import choices_string
from builder.trtllm_layout import medusa_to_trtllm
from runtime.config import ModelConfig
from runtime.drafters.draft_vocab import DraftVocab
from runtime.drafters.medusa import CONFIG_FILE, NAME, SAFETENSORS_FILE, MedusaDrafter

MEDUSA_WEIGHT_DECAY = 0.8  # Medusa-1 weights head i's loss by 0.8^i


class ResBlock(nn.Module):
    """FasterDecoding's ResBlock: x + SiLU(Linear(x)); `linear` is the name in their state dicts."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)  # the block starts as the identity
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


def medusa_heads_module(lm_head_weight: torch.Tensor, num_heads: int, num_layers: int) -> nn.ModuleList:
    """FasterDecoding's `medusa_head`: ModuleList of Sequential(ResBlock * n, Linear(H, V, bias=False)); every
    projection initialised from the target's lm_head (# [V, H]). State-dict keys {h}.{l}.linear.*, {h}.{n}.weight."""
    v, h = lm_head_weight.shape
    heads = nn.ModuleList()
    for _ in range(num_heads):
        proj = nn.Linear(h, v, bias=False)
        with torch.no_grad():
            proj.weight.copy_(lm_head_weight)
        heads.append(nn.Sequential(*[ResBlock(h) for _ in range(num_layers)], proj))
    return heads


def medusa_loss(heads: nn.ModuleList, hidden: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor,
                labels: str) -> torch.Tensor:
    """hidden # [B, T, H], logits # [B, T, V] (target), ids # [B, T]. Head i at t vs position t+i+1."""
    total = hidden.new_zeros(())
    t = ids.shape[1]
    for i, head in enumerate(heads):
        span = t - i - 2  # positions t whose label x_{t+i+2} is inside the window
        out = head(hidden[:, :span]).flatten(0, 1)  # [B*span, V]
        loss = cross_entropy(out, logits[:, i + 1:i + 1 + span].flatten(0, 1), ids[:, i + 2:].flatten(), labels)
        total = total + MEDUSA_WEIGHT_DECAY**i * loss
    return total


@torch.no_grad()
def medusa_metrics(heads: nn.ModuleList, batches: Iterable[EvalBatch]) -> dict[str, list[float]]:
    """Per head: top-1 / top-5 agreement with the target's greedy token, and top-1 accuracy on the corpus."""
    k = len(heads)
    hit1, hit5, data1, count = [0] * k, [0] * k, [0] * k, [0] * k
    for b in batches:
        ids, hidden, greedy = b.data, b.hidden, b.greedy
        t = ids.shape[1]
        for i, head in enumerate(heads):
            span = t - i - 2
            top = torch.topk(head(hidden[:, :span]), EVAL_TOPK, dim=-1).indices  # [1, span, 5]
            want = greedy[:, i + 1:i + 1 + span]
            hit1[i] += int((top[..., 0] == want).sum())
            hit5[i] += int((top == want[..., None]).any(-1).sum())
            data1[i] += int((top[..., 0] == ids[:, i + 2:]).sum())
            count[i] += span
    return {"top1": [h / c for h, c in zip(hit1, count)], "top5": [h / c for h, c in zip(hit5, count)],
            "top1_data": [h / c for h, c in zip(data1, count)]}


def save_medusa(heads: nn.ModuleList, section: MedusaSection, h: HeadsSection, target_config: Any, log_file: Path,
                vocab: DraftVocab | None = None) -> Path:
    """FasterDecoding layout: config.json (medusa_num_heads, medusa_num_layers, ...) + medusa_lm_head.safetensors."""
    dtype = getattr(torch, h.save_dtype)
    cfg = {
        "medusa_num_heads": section.num_heads,
        "medusa_num_layers": section.num_layers,
        "base_model_name_or_path": h.target.name,
        "hidden_size": target_config.hidden_size,
        "vocab_size": target_config.vocab_size,
        "torch_dtype": h.save_dtype,
    }
    if vocab is not None:
        cfg["draft_vocab_size"] = vocab.size
    state = {k: v.detach().to(dtype).contiguous() for k, v in heads.state_dict().items()}
    return publish_head(section.output, cfg, CONFIG_FILE, state, SAFETENSORS_FILE, vocab, log_file)


class MedusaBuild(BuilderKind):
    name = NAME

    # ---- the engine directory ------------------------------------------------------------------------------------

    def write_weights(self, out: Path, drafter: MedusaDrafter) -> str:
        """FasterDecoding's names: {h}.{l}.linear.*, {h}.{layers}.weight (+ a reduced vocabulary's d2t / t2d)."""
        from safetensors.torch import save_file

        h = drafter.heads
        state: dict[str, torch.Tensor] = {}
        num_layers = h.config.num_layers
        for head in range(h.config.num_heads):
            for layer in range(num_layers):
                state[f"{head}.{layer}.linear.weight"] = h.res_weight[head, layer].contiguous().clone()
                state[f"{head}.{layer}.linear.bias"] = h.res_bias[head, layer].contiguous().clone()
            state[f"{head}.{num_layers}.weight"] = h.lm_weight[head].contiguous().clone()
        if h.vocab is not None:
            state.update(h.vocab.state())
        save_file(state, str(out / SAFETENSORS_FILE), metadata={"format": "pt"})
        return SAFETENSORS_FILE

    def draft_config(self, drafter: MedusaDrafter) -> dict[str, Any]:
        c = drafter.heads.config
        return {"num_heads": c.num_heads, "num_layers": c.num_layers, "hidden_size": c.hidden_size,
                "vocab_size": c.vocab_size,
                "draft_vocab_size": None if drafter.heads.vocab is None else drafter.heads.vocab.size}

    # ---- TensorRT-LLM ----------------------------------------------------------------------------------------------

    backend_decoding_mode = "medusa"
    trtllm_tree = True

    def trtllm_config(self, plan: BuildPlan, drafter: MedusaDrafter,
                      decoder_fields: Callable[[ModelConfig], dict[str, Any]]) -> dict[str, Any]:
        c = drafter.heads.config
        return {"architecture": "MedusaForCausalLM", "num_medusa_heads": c.num_heads,
                "num_medusa_layers": c.num_layers, "max_draft_len": plan.config.build.max_draft_len}

    def trtllm_tensors(self, plan: BuildPlan, drafter: MedusaDrafter, target: dict[str, torch.Tensor],
                       tensors: dict[str, torch.Tensor]) -> None:
        h = drafter.heads
        lm = h.lm_weight  # [heads, K, H]
        if h.vocab is not None:
            # TensorRT-LLM's Medusa has no reduced draft vocabulary (only EAGLE-3 does): the heads go out over the
            # full vocabulary, rows outside the draft vocabulary zero. Drafting there is then over all V tokens
            # (a zero logit may outrank a draft token: lower acceptance, never a different output).
            full = lm.new_zeros(lm.shape[0], h.vocab.target_vocab, lm.shape[2])  # [heads, V, H]
            full[:, h.vocab.target_ids.to(lm.device)] = lm
            lm = full
        tensors.update(medusa_to_trtllm(h.res_weight, h.res_bias, lm))
        return None

    def trtllm_build_args(self, plan: BuildPlan) -> list[str]:
        return ["--speculative_decoding_mode", "medusa", "--max_draft_len", str(plan.config.build.max_draft_len)]

    def trtllm_run_args(self, plan: BuildPlan) -> list[str]:
        # run.py asserts `args.temperature == 1.0, "Medusa should use temperature == 1.0"`; greedy is top-k 1 (its
        # default). TensorRT-LLM runs Medusa greedily only (its typical acceptance is lossy).
        return [f"--medusa_choices={choices_string(plan.draft.static_tree)}", "--temperature=1.0", "--top_k=1",
                "--use_py_session"]

    # ---- training --------------------------------------------------------------------------------------------------

    trains = True
    metrics_meaning = "held-out agreement with the target's greedy token; entry i = head i (tree depth i + 1)"
    metrics_rows = ("head", 0)

    def train_module(self, section: MedusaSection, target: TrainingTarget, init: HeadInit | None) -> nn.ModuleList:
        return medusa_heads_module(target.lm_head_weight.detach(), section.num_heads, section.num_layers)

    def train_loss(self, module: nn.ModuleList, section: MedusaSection, target: TrainingTarget, ids: torch.Tensor,
                   hidden: torch.Tensor, logits: torch.Tensor, labels: str,
                   step: int) -> tuple[torch.Tensor, dict[str, float]]:
        return medusa_loss(module, hidden, logits, ids, labels), {}

    def train_metrics(self, module: nn.ModuleList, target: TrainingTarget,
                      batches: Iterable[EvalBatch]) -> dict[str, list[float]]:
        return medusa_metrics(module, batches)

    def save_head(self, module: nn.ModuleList, section: MedusaSection, heads: HeadsSection, target_config: Any,
                  log_file: Path, vocab: DraftVocab | None) -> Path:
        return save_medusa(module, section, heads, target_config, log_file, vocab)


KIND = MedusaBuild()
