"""EAGLE-3 in the builder: the engine's draft/ (the head in the published EAGLE-3 layout, `runtime.drafters.eagle3`),
the configs that serve it where EAGLE-3 deploys today, and training a head for a frozen target.

Deployment (`deploy_files`, written into ENGINE_DIR/serving/; paths as built: the target is the source Hugging Face
checkpoint, the head ENGINE_DIR/draft/). TensorRT-LLM's engine backend (trtllm-build, the 1.2 export of Medusa and
EAGLE-1 in builder/trtllm.py) has no EAGLE-3: its TensorRT-LLM checkpoint here is the target alone, and EAGLE-3
deploys on TensorRT-LLM's PyTorch backend instead. Field names from the public sources (tests/test_eagle3_build.py
records the commits):
    trtllm-extra-options.yaml      trtllm-serve TARGET --backend pytorch --extra_llm_api_options FILE, or the LLM
                                   API's speculative_config: {decoding_type: Eagle3, max_draft_len,
                                   speculative_model_dir, and the tree: eagle_choices (a static tree) or
                                   use_dynamic_tree, dynamic_tree_max_topK, max_total_draft_tokens (EAGLE-2's); a
                                   chain: neither}
                                   (tensorrt_llm/llmapi/llm_args.py Eagle3DecodingConfig)
    triton-llmapi/tensorrt_llm/1/model.yaml   Triton's TensorRT-LLM LLM-API backend (all_models/llmapi: model.py reads
                                   model.yaml's LLM arguments and its triton_config {max_batch_size, decoupled}); put it
                                   in that model directory beside NVIDIA's model.py and config.pbtxt
    vllm-serve.sh                  vllm serve TARGET --speculative-config '{"method": "eagle3", "model": HEAD,
                                   "num_speculative_tokens": K}' (a chain of the tree's depth)
    sglang-serve.sh                python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3
                                   --speculative-draft-model-path HEAD --speculative-num-steps D
                                   --speculative-eagle-topk K --speculative-num-draft-tokens N
Exactness: those engines verify greedy requests exactly; what their sampled verification does is theirs (this
runtime's rejection sampling is lossless, `runtime.verify`).

Training (`heads.eagle3`, EAGLE-3's recipe on the self-distillation data): at position t the head reads
g_t = fc(streams of the target's feature layers at t) and the embedding of x_{t+1}, and predicts x_{t+2} with its own
lm_head over the draft vocabulary (initialised from the target's rows). Training-time test: the head runs `unroll`
times per window; run s > 0 reads at time t run s-1's output at t-1 (the feature a depth-(s+1) tree node reads) and
attends exactly what that node attends while drafting (`Eagle3TrainHead.unrolled`); a token loss (cross-entropy
against the target's distribution) at every run, weighted unroll_decay^s. No feature regression (EAGLE-3 drops it).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from builder.config import BuildPlan
from builder.drafters import BuilderKind, EvalBatch, HeadInit, TrainingTarget
from builder.train_heads import EVAL_TOPK, cross_entropy, publish_head
from builder.training.config import Eagle3Section, HeadsSection
from runtime.config import ModelConfig
from runtime.draft_spec import DraftSpec
from runtime.drafters.draft_vocab import DraftVocab
from runtime.drafters.eagle import CONFIG_FILE, SAFETENSORS_FILE
from runtime.drafters.eagle3 import (
    ARCHITECTURE,
    AUX_LAYERS_KEY,
    EAGLE_CONFIG_KEY,
    NAME,
    Eagle3Drafter,
    default_feature_layers,
)
from runtime.engine import model_config_dict
from runtime.errors import ConfigError
from runtime.model import RMSNorm, check_feature_layers
from runtime.rope import RotaryEmbedding, apply_rope

SERVING_DIR = "serving"
TRTLLM_OPTIONS = f"{SERVING_DIR}/trtllm-extra-options.yaml"
TRITON_LLMAPI_YAML = f"{SERVING_DIR}/triton-llmapi/tensorrt_llm/1/model.yaml"
VLLM_SCRIPT = f"{SERVING_DIR}/vllm-serve.sh"
SGLANG_SCRIPT = f"{SERVING_DIR}/sglang-serve.sh"


# ---- the head's config.json ---------------------------------------------------------------------------------------


def head_config(head_layer: ModelConfig, target: ModelConfig, layers: tuple[int, ...], vocab: DraftVocab | None,
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The published config.json of an EAGLE-3 head with `head_layer`'s shapes for `target`. Feature layers other
    than the engines' default are written in both spellings, each in its engine's meaning (vLLM's top-level key:
    layer inputs; SGLang's eagle_config key: layer outputs, so only for layers >= 1)."""
    cfg = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": head_layer.hidden_size,
        "intermediate_size": head_layer.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": head_layer.num_attention_heads,
        "num_key_value_heads": head_layer.num_key_value_heads,
        "head_dim": head_layer.head_dim,
        "max_position_embeddings": target.max_position_embeddings,
        "rms_norm_eps": head_layer.rms_norm_eps,
        "rope_theta": head_layer.rope_theta,
        "rope_scaling": None if head_layer.rope_scaling is None else
        {k: v for k, v in dataclasses.asdict(head_layer.rope_scaling).items() if v is not None},
        "tie_word_embeddings": False,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": target.vocab_size if vocab is None else vocab.size,
        "target_hidden_size": target.hidden_size,
        "bias": False,
        **(extra or {}),
    }
    if layers != default_feature_layers(target.num_hidden_layers):
        cfg[AUX_LAYERS_KEY] = list(layers)
        if layers[0] >= 1:
            cfg[EAGLE_CONFIG_KEY] = {AUX_LAYERS_KEY: [j - 1 for j in layers]}
    return cfg


# ---- serving configs ----------------------------------------------------------------------------------------------


def _tree_options(draft: DraftSpec) -> tuple[int, dict[str, Any], tuple[int, int, int]]:
    """(depth, TensorRT-LLM's tree fields, SGLang's (num_steps, eagle_topk, num_draft_tokens)) of what `draft`
    drafts: a chain (no tree fields, top-k 1), a static tree (eagle_choices) or EAGLE-2's dynamic tree."""
    tree = draft.static_tree
    depth = draft.max_tree_depth
    if tree is not None:
        if tree.num_nodes - 1 == depth:  # a chain
            return depth, {}, (depth, 1, depth + 1)
        width = max(tree.max_rank_per_depth()) if tree.num_nodes > 1 else 1
        return depth, {"eagle_choices": [list(p) for p in tree.choices]}, (depth, width, tree.num_nodes)
    dyn = draft.dynamic
    nodes = min(dyn.total_tokens - 1, dyn.top_k * depth)
    return depth, {"use_dynamic_tree": True, "dynamic_tree_max_topK": dyn.top_k,
                   "max_total_draft_tokens": nodes}, (depth, dyn.top_k, nodes + 1)


def speculative_config(plan: BuildPlan, head_dir: str, layers: tuple[int, ...]) -> dict[str, Any]:
    """TensorRT-LLM's speculative_config (LLM API / trtllm-serve) for the engine's drafter."""
    depth, tree, _ = _tree_options(plan.draft.model_only)
    cfg: dict[str, Any] = {"decoding_type": "Eagle3", "max_draft_len": depth, "speculative_model_dir": head_dir,
                           **tree}
    if layers != default_feature_layers(plan.model.num_hidden_layers):
        # TensorRT-LLM captures the OUTPUT of the layers it names (its default {1, L // 2 - 1, L - 4})
        cfg["eagle3_layers_to_capture"] = [j - 1 for j in layers]
    return cfg


def serving_files(plan: BuildPlan, layers: tuple[int, ...]) -> dict[str, str]:
    """The serving configs (module docstring) as {path relative to the engine directory: text}."""
    import yaml

    out = plan.output.resolve() if plan.output is not None else Path("ENGINE_DIR")
    target, head = str(plan.config.model.checkpoint.resolve()), str(out / "draft")
    spec = speculative_config(plan, head, layers)
    depth, _, (steps, topk, tokens) = _tree_options(plan.draft.model_only)
    tp = plan.config.build.tp_size
    header = (f"# EAGLE-3 for {target}, written by the spectree builder; paths as built (edit them when the engine "
              f"directory moves)\n")
    options = {"speculative_config": spec}
    llmapi = {"model": target, "backend": "pytorch", "tensor_parallel_size": tp, "pipeline_parallel_size": 1,
              "speculative_config": spec,
              "triton_config": {"max_batch_size": 0, "decoupled": True}}
    vllm = ["vllm", "serve", target, "--tensor-parallel-size", str(tp), "--speculative-config",
            json.dumps({"method": "eagle3", "model": head, "num_speculative_tokens": depth})]
    sglang = ["python", "-m", "sglang.launch_server", "--model-path", target, "--tp-size", str(tp),
              "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", head,
              "--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk),
              "--speculative-num-draft-tokens", str(tokens)]
    script = "#!/bin/sh\n" + header + "exec {} \"$@\"\n"
    return {
        TRTLLM_OPTIONS: header + f"# trtllm-serve {target} --backend pytorch --extra_llm_api_options "
                        f"trtllm-extra-options.yaml\n" + yaml.safe_dump(options, sort_keys=False),
        TRITON_LLMAPI_YAML: header + "# Triton's TensorRT-LLM LLM-API backend (all_models/llmapi/tensorrt_llm)\n"
                            + yaml.safe_dump(llmapi, sort_keys=False),
        VLLM_SCRIPT: script.format(shlex.join(vllm)),
        SGLANG_SCRIPT: script.format(shlex.join(sglang)),
    }


# ---- training -----------------------------------------------------------------------------------------------------


def _proj(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class Eagle3TrainHead(nn.Module):
    """The head as it trains: the published module names (fc, midlayer.*, norm, lm_head), plain nn.Linear weights;
    the embedding is the target's (passed in, frozen)."""

    def __init__(self, layer: ModelConfig, layers: tuple[int, ...], target_hidden: int, lm_init: torch.Tensor) -> None:
        """lm_init # [K, H]: the target's lm_head rows of the draft vocabulary (the head's lm_head starts there)."""
        super().__init__()
        h, d, eps = layer.hidden_size, layer.head_dim, layer.rms_norm_eps
        self.config = layer
        self.feature_layers = layers
        self.fc = _proj(len(layers) * target_hidden, h)
        m = self.midlayer = nn.Module()
        m.input_layernorm, m.hidden_norm, m.post_attention_layernorm = RMSNorm(h, eps), RMSNorm(h, eps), RMSNorm(h, eps)
        a = m.self_attn = nn.Module()
        a.q_proj = _proj(2 * h, layer.num_attention_heads * d)
        a.k_proj = _proj(2 * h, layer.num_key_value_heads * d)
        a.v_proj = _proj(2 * h, layer.num_key_value_heads * d)
        a.o_proj = _proj(layer.num_attention_heads * d, h)
        p = m.mlp = nn.Module()
        p.gate_proj, p.up_proj = _proj(h, layer.intermediate_size), _proj(h, layer.intermediate_size)
        p.down_proj = _proj(layer.intermediate_size, h)
        self.norm = RMSNorm(h, eps)
        self.lm_head = _proj(h, lm_init.shape[0])
        self.rotary = RotaryEmbedding.from_config(layer)  # its buffer is not persistent: not in the state dict
        with torch.no_grad():
            for name, w in self.named_parameters():
                if name.endswith("proj.weight") or name == "fc.weight":
                    w.normal_(0.0, 0.02)
            self.lm_head.weight.copy_(lm_init)

    def unrolled(
        self,
        embeds: torch.Tensor,  # [B, N, H]: embeddings of x_{j+1}, j = 0 .. N-1
        features: torch.Tensor,  # [B, N, F * H_target]: the target's feature-layer streams at j
        runs: int,
    ) -> list[torch.Tensor]:  # runs x [B, N, H]: run s's outputs (meaningful for j >= s)
        """The training-time test: run 0 reads g_j = fc(features_j); run s > 0 reads at time j run s-1's output at
        j - 1 (a depth-(s+1) node's input: its parent's output) and attends run 0's entries at times <= j - s (the
        head cache) and run r's entry at time j - s + r for r = 1..s (its ancestors, then itself); every run sits at
        position j, like the node (EAGLE-1's `EagleTrainHead.unrolled` mask)."""
        m, a = self.midlayer, self.midlayer.self_attn
        b, n, _ = embeds.shape
        hq, hkv, d = self.config.num_attention_heads, self.config.num_key_value_heads, self.config.head_dim
        t = torch.arange(n, device=embeds.device)
        cos, sin = self.rotary(t[None].expand(b, n), embeds.dtype)  # [B, N, D]
        g0 = self.fc(features)  # [B, N, H]
        e = m.input_layernorm(embeds)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        for s in range(runs):
            g = g0 if s == 0 else torch.cat([g0[:, :1], outs[-1][:, :-1]], dim=1)  # time 0 has no parent: filler
            x = torch.cat([e, m.hidden_norm(g)], dim=-1)  # [B, N, 2H]: the embedding first
            q = apply_rope(a.q_proj(x).view(b, n, hq, d).transpose(1, 2), cos, sin)
            keys.append(apply_rope(a.k_proj(x).view(b, n, hkv, d).transpose(1, 2), cos, sin))
            values.append(a.v_proj(x).view(b, n, hkv, d).transpose(1, 2))
            allowed = [t[None, :] <= t[:, None] - s] + [t[None, :] == t[:, None] - s + r for r in range(1, s + 1)]
            o = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2),
                                               attn_mask=torch.cat(allowed, dim=1), enable_gqa=hq != hkv)
            h = g + a.o_proj(o.transpose(1, 2).reshape(b, n, hq * d))
            outs.append(h + m.mlp.down_proj(F.silu(m.mlp.gate_proj(m.post_attention_layernorm(h)))
                                           * m.mlp.up_proj(m.post_attention_layernorm(h))))
        return outs

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's outputs # [..., H] -> logits over the draft vocabulary # [..., K]."""
        return self.lm_head(self.norm(out))

    def published_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()}


def _split(hidden: torch.Tensor, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of [final-norm state, feature streams] # [B, T, H * (1 + F)] -> the two parts."""
    return hidden[..., :h], hidden[..., h:]


def eagle3_loss(head: Eagle3TrainHead, target: nn.Module, hidden: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor,
                section: Eagle3Section, labels: str) -> tuple[torch.Tensor, dict[str, float]]:
    """Pair j = (g_j, x_{j+1}) predicts x_{j+2}; run s counts positions j >= s (where its input is a prediction) at
    unroll_decay^s."""
    _, feats = _split(hidden, head.config.hidden_size)
    embeds = target.model.embed_tokens(ids[:, 1:])  # [B, T-1, H]
    outs = head.unrolled(embeds, feats[:, :-1], section.unroll)
    total = hidden.new_zeros(())
    info: dict[str, float] = {}
    for s, out in enumerate(outs):
        pred = head.logits(out[:, s:-1])  # [B, T-2-s, K]: x_{j+2} exists for j <= T-3
        ce = cross_entropy(pred.flatten(0, 1), logits[:, s + 1:-1].flatten(0, 1), ids[:, s + 2:].flatten(), labels)
        total = total + section.unroll_decay**s * ce
        info[f"ce_{s + 1}"] = ce.item()
    return total, info


@torch.no_grad()
def eagle3_metrics(head: Eagle3TrainHead, target: nn.Module, batches: Iterable[EvalBatch],
                   depths: int = 4) -> dict[str, list[float]]:
    """Per depth d: top-1 / top-5 agreement with the target's greedy token, drafted as a tree branch is (the target's
    features up to the root, the head's own outputs below it)."""
    hit1, hit5, count = [0] * depths, [0] * depths, [0] * depths
    for b in batches:
        ids, t = b.ids, b.ids.shape[1]
        runs = min(depths, t - 2)
        if runs <= 0:
            continue
        _, feats = _split(b.hidden, head.config.hidden_size)
        outs = head.unrolled(target.model.embed_tokens(ids[:, 1:]), feats[:, :-1], runs)
        for d, out in enumerate(outs):
            top = torch.topk(head.logits(out[:, d:-1]).float(), EVAL_TOPK, dim=-1).indices  # [1, T-2-d, 5]
            want = b.greedy[:, d + 1:t - 1]
            hit1[d] += int((top[..., 0] == want).sum())
            hit5[d] += int((top == want[..., None]).any(-1).sum())
            count[d] += want.shape[1]
    return {"top1": [h / c for h, c in zip(hit1, count) if c], "top5": [h / c for h, c in zip(hit5, count) if c]}


def head_layer_config(target_config: Any) -> ModelConfig:
    """The head layer's shapes: the target's (one layer), from its transformers config."""
    cfg = ModelConfig.from_hf({**target_config.to_dict(), "num_hidden_layers": 1, "architectures": None,
                               "model_type": "llama", "eos_token_id": None, "bos_token_id": None})
    return cfg.with_dtype("float32")


def resolve_layers(section: Eagle3Section, num_layers: int) -> tuple[int, ...]:
    """heads.eagle3.feature_layers, or the engines' default for a target of num_layers layers."""
    layers = section.feature_layers if section.feature_layers is not None else default_feature_layers(num_layers)
    return check_feature_layers(tuple(sorted(layers)), num_layers, "heads.eagle3.feature_layers", ConfigError)


def save_eagle3(head: Eagle3TrainHead, section: Eagle3Section, h: HeadsSection, target_config: Any, log_file: Path,
                vocab: DraftVocab | None = None) -> Path:
    """The published layout: config.json (LlamaForCausalLMEagle3) + model.safetensors (fc, midlayer.*, norm,
    lm_head, d2t / t2d with a reduced draft vocabulary)."""
    dtype = getattr(torch, h.save_dtype)
    target = ModelConfig.from_hf({**target_config.to_dict(), "architectures": None, "model_type": "llama",
                                  "eos_token_id": None, "bos_token_id": None})
    cfg = head_config(head.config, target, head.feature_layers, vocab,
                      {"torch_dtype": h.save_dtype, "base_model_name_or_path": h.target.name})
    state = {k: v.to(dtype) for k, v in head.published_state().items()}
    return publish_head(section.output, cfg, CONFIG_FILE, state, SAFETENSORS_FILE, vocab, log_file)


class Eagle3Build(BuilderKind):
    name = NAME

    # ---- the engine directory ------------------------------------------------------------------------------------

    def write_weights(self, out: Path, drafter: Eagle3Drafter) -> str:
        """The published layout: config.json rewritten in its published form, model.safetensors with the head's
        own names (an lm_head always: the target's rows when the source head had none)."""
        from safetensors.torch import save_file

        head, model = drafter.head, drafter.model
        state = {k: v.contiguous().clone() for k, v in head.state_dict().items()}
        state["lm_head.weight"] = head.output_weight(model).contiguous().clone()
        if head.vocab is not None:
            state.update(head.vocab.state())
        save_file(state, str(out / SAFETENSORS_FILE), metadata={"format": "pt"})
        extra = {"bias": head.fc.bias is not None, "attention_bias": head.config.attention_bias,
                 "norm_before_residual": head.midlayer.norm_before_residual}
        cfg = head_config(head.config, model.config, head.feature_layers, head.vocab, extra)
        (out / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        return SAFETENSORS_FILE

    def draft_config(self, drafter: Eagle3Drafter) -> dict[str, Any]:
        head = drafter.head
        return {"feature_layers": list(head.feature_layers), "own_embedding": head.embed_tokens is not None,
                "head": model_config_dict(head.config),
                "draft_vocab_size": None if head.vocab is None else head.vocab.size}

    def deploy_files(self, plan: BuildPlan, drafter: Eagle3Drafter) -> dict[str, str]:
        return serving_files(plan, drafter.head.feature_layers)

    def check_trtllm_backend(self, draft: DraftSpec) -> None:
        raise ConfigError(f"engine: an EAGLE-3 engine ({NAME!r}); TensorRT-LLM's engine backend has no EAGLE-3 (its "
                          f"TensorRT-LLM checkpoint here is the target alone). Serve it with TensorRT-LLM's LLM-API "
                          f"backend ({TRITON_LLMAPI_YAML} in the engine directory) or with --backend python")

    # ---- training --------------------------------------------------------------------------------------------------

    trains = True
    metrics_meaning = ("held-out agreement with the target's greedy token; entry d = depth d + 1 (drafted as a tree "
                       "branch: the target's features to the root, the head's own outputs below it)")
    metrics_rows = ("depth", 1)

    def feature_layers(self, section: Eagle3Section, target_config: Any) -> tuple[int, ...]:
        return resolve_layers(section, target_config.num_hidden_layers)

    def init_head(self, section: Eagle3Section, target_vocab: int) -> HeadInit | None:
        return None

    def train_module(self, section: Eagle3Section, target: TrainingTarget, init: HeadInit | None) -> Eagle3TrainHead:
        layer = head_layer_config(target.config)
        return Eagle3TrainHead(layer, self.feature_layers(section, target.config), target.config.hidden_size,
                               target.lm_head_weight.float())

    def train_loss(self, module: Eagle3TrainHead, section: Eagle3Section, target: TrainingTarget, ids: torch.Tensor,
                   hidden: torch.Tensor, logits: torch.Tensor, labels: str,
                   step: int) -> tuple[torch.Tensor, dict[str, float]]:
        return eagle3_loss(module, target.view, hidden, logits, ids, section, labels)

    def train_metrics(self, module: Eagle3TrainHead, target: TrainingTarget,
                      batches: Iterable[EvalBatch]) -> dict[str, list[float]]:
        return eagle3_metrics(module, target.view, batches)

    def save_head(self, module: Eagle3TrainHead, section: Eagle3Section, heads: HeadsSection, target_config: Any,
                  log_file: Path, vocab: DraftVocab | None) -> Path:
        return save_eagle3(module, section, heads, target_config, log_file, vocab)


KIND = Eagle3Build()
