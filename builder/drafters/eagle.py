"""EAGLE-1 in the builder: the engine's draft/ (the EAGLE repository's files), TensorRT-LLM's EagleForCausalLM export,
the tensorrtllm backend's limits, and training a head for a frozen target.

Training (SafeAILab): at position t the head reads fc(cat(embed(x_{t+1}), f_t)) (the target's embedding, frozen and
shared), runs one Llama decoder layer without input_layernorm (causal over the window, position t) and predicts
f_{t+1}; the target's frozen lm_head turns it into the distribution of x_{t+2}.
Loss = SmoothL1(f'_{t+1}, f_{t+1}) + ce_weight * CE(lm_head(f'_{t+1}), labels of x_{t+2}), as in EAGLE.

Training-time test (HASS / EAGLE-3; heads.eagle.unroll > 1): the head also runs on its own predicted features in
the same window, each run attending what a depth-d tree node attends while drafting (`EagleTrainHead.unrolled`).
Held-out metrics: top-1 / top-5 agreement with the target's greedy token per depth, drafted as a tree branch is
(exact target features up to the root, the head's own predictions below it). heads.eagle.init fine-tunes an
existing head (its weights and its reduced draft vocabulary).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from builder.config import BuildConfigError, BuildPlan, BuildSection
from builder.drafters import BuilderKind, EvalBatch, HeadInit, TrainingTarget
from builder.train_heads import EVAL_TOPK, cross_entropy, publish_head
from builder.training.config import EagleSection, HeadsSection
from builder.trtllm import choices_string, max_non_leaves_per_layer
from builder.trtllm_layout import eagle_to_trtllm
from runtime.checkpoint import IGNORED_SUFFIXES, read_head_state
from runtime.config import ModelConfig
from runtime.draft_spec import DYNAMIC, DraftSpec
from runtime.drafters.draft_vocab import DraftVocab
from runtime.drafters.eagle import (
    CONFIG_FILE,
    NAME,
    SAFETENSORS_FILE,
    TORCH_FILE,
    WEIGHT_FILES,
    EagleDrafter,
    EagleKind,
)
from runtime.engine import QKVLayout, model_config_dict
from runtime.errors import CheckpointError, ConfigError
from runtime.files import shown_path

MAX_DRAFT_LEN = 256  # TensorRT-LLM's EAGLE converter rejects a larger max_draft_len


def eagle_layer_config(target_config: Any):
    """The EAGLE head's transformers LlamaConfig: the target's shapes, one layer."""
    from transformers import LlamaConfig

    t = target_config
    cfg = LlamaConfig(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=1, num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
        head_dim=t.hidden_size // t.num_attention_heads, max_position_embeddings=t.max_position_embeddings,
        rms_norm_eps=t.rms_norm_eps, rope_theta=_rope_theta(t), attention_bias=False, tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def _rope_theta(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


class EagleTrainHead(nn.Module):
    """fc + one LlamaDecoderLayer without input_layernorm. The embedding is the target's (passed in, frozen)."""

    def __init__(self, layer_config: Any) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRotaryEmbedding,
        )

        h = layer_config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        layer = LlamaDecoderLayer(layer_config, 0)
        layer.input_layernorm = nn.Identity()  # EAGLE-1: the fused input goes straight to attention
        self.layers = nn.ModuleList([layer])
        self.rotary = LlamaRotaryEmbedding(layer_config)

    def forward(
        self,
        embeds: torch.Tensor,  # [B, T, H]: embeddings of x_{t+1}
        features: torch.Tensor,  # [B, T, H]: f_t
    ) -> torch.Tensor:  # [B, T, H]: predicted f_{t+1}
        x = self.fc(torch.cat([embeds, features], dim=-1))
        positions = torch.arange(x.shape[1], device=x.device)[None]  # [1, T]
        cos_sin = self.rotary(x, positions)
        for layer in self.layers:
            x = layer(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)  # causal (sdpa)
        return x

    def unrolled(
        self,
        embeds: torch.Tensor,  # [B, N, H]: embeddings of x_{j+1}, j = 0 .. N-1
        features: torch.Tensor,  # [B, N, H]: the target's f_j
        runs: int,
    ) -> list[torch.Tensor]:  # runs x [B, N, H]: run s at time j predicts f_{j+1} (meaningful for j >= s)
        """The training-time test: run 0 is forward(); run s > 0 reads, at time j, run s-1's prediction at time j-1
        paired with x_{j+1} (a depth-(s+1) tree node), and attends exactly what that node attends while drafting:
        run 0's entries at times <= j - s (the head cache: exact target features) and, for r = 1..s, run r's entry at
        time j - s + r (its ancestors on the branch, then itself). Run s at time j sits at position j, like the node."""
        if len(self.layers) != 1:
            raise ValueError(f"the training-time test runs a one-layer head, this one has {len(self.layers)}")
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        layer = self.layers[0]
        attn = layer.self_attn
        b, n, _ = embeds.shape
        device = embeds.device
        cos, sin = self.rotary(embeds, torch.arange(n, device=device)[None])
        t = torch.arange(n, device=device)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        feats = features
        for s in range(runs):
            if s:
                feats = torch.cat([features[:, :1], outs[-1][:, :-1]], dim=1)  # time 0 has no parent: filler
            x = self.fc(torch.cat([embeds, feats], dim=-1))
            a = layer.input_layernorm(x)  # nn.Identity (EAGLE-1), as in forward()
            q = attn.q_proj(a).view(b, n, -1, attn.head_dim).transpose(1, 2)  # [B, heads, N, d]
            k = attn.k_proj(a).view(b, n, -1, attn.head_dim).transpose(1, 2)  # [B, kv_heads, N, d]
            v = attn.v_proj(a).view(b, n, -1, attn.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys.append(k)
            values.append(v)
            # Query time j of run s reads run 0 at times <= j - s and run r >= 1 at time j - s + r.
            allowed = [t[None, :] <= t[:, None] - s] + [t[None, :] == t[:, None] - s + r for r in range(1, s + 1)]
            mask = torch.cat(allowed, dim=1)  # [N, (s+1) N]; the diagonal of run s itself is always allowed
            o = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask,
                                               scale=attn.scaling, enable_gqa=True)  # [B, heads, N, d]
            h = x + attn.o_proj(o.transpose(1, 2).reshape(b, n, -1))
            outs.append(h + layer.mlp(layer.post_attention_layernorm(h)))
        return outs

    def eagle_state_dict(self) -> dict[str, torch.Tensor]:
        """The EAGLE checkpoint's keys: fc.*, layers.0.* (no input_layernorm, no rotary buffers)."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith("rotary.")}


def eagle_runs(section: EagleSection, step: int) -> int:
    """How many times the head runs per window at this step (the training-time test starts at unroll_from)."""
    return section.unroll if step >= section.unroll_from else 1


def eagle_loss(head: EagleTrainHead, target: nn.Module, hidden: torch.Tensor, logits: torch.Tensor,
               ids: torch.Tensor, section: EagleSection, labels: str,
               runs: int = 1) -> tuple[torch.Tensor, dict[str, float]]:
    """Position t pairs (f_t, x_{t+1}) and predicts f_{t+1}, whose lm_head gives x_{t+2}. With runs > 1 the
    training-time test adds run s's losses (positions t >= s, where its input is a prediction) at unroll_decay^s."""
    feats = hidden[:, :-1]  # [B, T-1, H]
    if section.feature_noise > 0:
        feats = feats + (torch.rand_like(feats) * 2 - 1) * section.feature_noise
    embeds = target.model.embed_tokens(ids[:, 1:])  # [B, T-1, H]
    preds = [head(embeds, feats)] if runs == 1 else head.unrolled(embeds, feats, runs)  # runs x [B, T-1, H]
    total = hidden.new_zeros(())
    info: dict[str, float] = {}
    for s, pred in enumerate(preds):
        reg = F.smooth_l1_loss(pred[:, s:], hidden[:, s + 1:])
        out = target.lm_head(pred[:, s:-1])  # [B, T-2-s, V]: x_{t+2} exists for t <= T-3
        ce = cross_entropy(out.flatten(0, 1), logits[:, s + 1:-1].flatten(0, 1), ids[:, s + 2:].flatten(), labels)
        total = total + section.unroll_decay**s * (reg + section.ce_weight * ce)
        suffix = "" if s == 0 else f"_{s + 1}"
        info[f"regression{suffix}"], info[f"ce{suffix}"] = reg.item(), ce.item()
    return total, info


@torch.no_grad()
def eagle_metrics(head: EagleTrainHead, target: nn.Module, batches, depths: int = 4) -> dict[str, list[float]]:
    """Per depth d: top-1 / top-5 agreement of the head's x_{t+d+1} with the target's greedy token along the
    target's greedy path, drafted as a tree branch is: exact target features up to the branch's root, the head's
    own predictions below it (`EagleTrainHead.unrolled`). `target` supplies the embedding and the
    (draft-vocabulary) output layer."""
    hit1, hit5, count = [0] * depths, [0] * depths, [0] * depths
    for b in batches:
        ids, hidden, greedy = b.ids, b.hidden, b.greedy
        t = ids.shape[1]
        runs = min(depths, t - 2)
        if runs <= 0:
            continue
        preds = head.unrolled(target.model.embed_tokens(ids[:, 1:]), hidden[:, :-1], runs)  # runs x [1, T-1, H]
        for d, pred in enumerate(preds):
            # Run d at time j (j >= d) predicts f_{j+1}, whose lm_head gives x_{j+2}: the greedy token at j + 1.
            top = torch.topk(target.lm_head(pred[:, d:-1]).float(), EVAL_TOPK, dim=-1).indices  # [1, T-2-d, 5]
            want = greedy[:, d + 1:t - 1]
            hit1[d] += int((top[..., 0] == want).sum())
            hit5[d] += int((top == want[..., None]).any(-1).sum())
            count[d] += want.shape[1]
    return {"top1": [h / c for h, c in zip(hit1, count) if c], "top5": [h / c for h, c in zip(hit5, count) if c]}


def eagle_init(section: EagleSection, target_vocab: int) -> tuple[dict[str, torch.Tensor], DraftVocab | None] | None:
    """heads.eagle.init's weights (EagleTrainHead's keys, float32) and its reduced draft vocabulary; None when the
    section has no init. The head is checked as the runtime loads one (runtime.drafters.eagle)."""
    if section.init is None:
        return None
    if not section.init.is_dir():
        raise BuildConfigError(f"heads.eagle.init: {shown_path(section.init)} is not a directory; expected an EAGLE "
                               f"head directory (config.json + {TORCH_FILE})")
    try:
        file, state = read_head_state(section.init, WEIGHT_FILES, EagleKind.title)
        vocab = DraftVocab.from_state(state, target_vocab, file)
    except CheckpointError as exc:
        raise BuildConfigError(f"heads.eagle.init: {exc}") from exc
    return {k: v.float() for k, v in state.items()}, vocab


def _start_from(module: EagleTrainHead, state: dict[str, torch.Tensor], where: Path) -> None:
    """Load an init head's weights into `module`: every weight of the one-layer head, nothing else."""
    want = {k: tuple(v.shape) for k, v in module.eagle_state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items() if not k.endswith(IGNORED_SUFFIXES)}
    if want != got:
        missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
        shapes = sorted(k for k in want.keys() & got.keys() if want[k] != got[k])
        raise BuildConfigError(f"heads.eagle.init: {shown_path(where)} is not a one-layer EAGLE-1 head for this "
                               f"target (missing {missing[:4]}, unexpected {extra[:4]}, other shapes {shapes[:4]})")
    module.load_state_dict({k: state[k] for k in want}, strict=False)


def save_eagle(head: EagleTrainHead, section: EagleSection, h: HeadsSection, target_config: Any, log_file: Path,
               vocab: DraftVocab | None = None) -> Path:
    """EAGLE repository layout: Llama-style config.json (one layer, "bias": true for fc) + pytorch_model.bin."""
    dtype = getattr(torch, h.save_dtype)
    t = target_config
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "bias": True,
        "hidden_act": "silu",
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "max_position_embeddings": t.max_position_embeddings,
        "rms_norm_eps": t.rms_norm_eps,
        "rope_theta": _rope_theta(t),
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "vocab_size": t.vocab_size,
        "bos_token_id": t.bos_token_id,
        "eos_token_id": t.eos_token_id,
        "torch_dtype": h.save_dtype,
        "base_model_name_or_path": h.target.name,
    }
    if vocab is not None:
        cfg["draft_vocab_size"] = vocab.size
    state = {k: v.to(dtype) for k, v in head.eagle_state_dict().items()}
    return publish_head(section.output, cfg, CONFIG_FILE, state, TORCH_FILE, vocab, log_file)


class EagleBuild(BuilderKind):
    name = NAME

    # ---- the plan ----------------------------------------------------------------------------------------------------

    def check_target(self, model: ModelConfig) -> None:
        if model.architecture == "Qwen2ForCausalLM":
            raise ConfigError(f"got {NAME!r} for a Qwen2 target; TensorRT-LLM's EagleForCausalLM is a Llama model (its "
                              "attention bias covers q/k/v and the output projection together; Qwen2 biases q/k/v "
                              f"only). Serve Qwen2 + EAGLE with `runtime.load(hf_dir, draft={NAME!r}, ...)` instead")

    def check_drafter(self, model: ModelConfig, drafter: EagleDrafter, build: BuildSection) -> None:
        if build.max_draft_len > MAX_DRAFT_LEN:
            raise ConfigError(f"build.max_draft_len: got {build.max_draft_len}, expected at most {MAX_DRAFT_LEN} for "
                              "EAGLE (TensorRT-LLM's limit)")
        head = drafter.head.config
        try:
            QKVLayout.of(head).check_tp(build.tp_size, "EAGLE head attention")
        except ConfigError as exc:
            raise ConfigError(f"build.tp_size: {exc}") from exc
        if head.intermediate_size % build.tp_size:
            raise ConfigError(f"build.tp_size: got {build.tp_size}, expected a divisor of the EAGLE head's "
                              f"intermediate_size {head.intermediate_size}")

    # ---- the engine directory ------------------------------------------------------------------------------------

    def write_weights(self, out: Path, drafter: EagleDrafter) -> str:
        """The EAGLE checkpoint's names (fc.*, layers.{i}.*, embed_tokens.weight): EagleHead's own state dict."""
        from safetensors.torch import save_file

        state = {k: v.contiguous().clone() for k, v in drafter.head.state_dict().items()}
        if drafter.head.vocab is not None:
            state.update(drafter.head.vocab.state())
        save_file(state, str(out / SAFETENSORS_FILE), metadata={"format": "pt"})
        return SAFETENSORS_FILE

    def draft_config(self, drafter: EagleDrafter) -> dict[str, Any]:
        head = drafter.head
        return {"num_layers": len(head.layers), "fc_bias": head.fc.bias is not None,
                "own_embedding": head.embed_tokens is not None, "head": model_config_dict(head.config),
                "draft_vocab_size": None if head.vocab is None else head.vocab.size}

    # ---- TensorRT-LLM ----------------------------------------------------------------------------------------------

    backend_decoding_mode = "eagle"
    trtllm_tree = True

    def trtllm_config(self, plan: BuildPlan, drafter: EagleDrafter,
                      decoder_fields: Callable[[ModelConfig], dict[str, Any]]) -> dict[str, Any]:
        head = drafter.head.config
        tree = plan.draft.static_tree
        net = {"architecture": "LlamaForCausalLM", **decoder_fields(head)}
        net.update(tie_word_embeddings=False, mlp_bias=False, head_dim=head.head_dim)
        non_leaves = plan.draft.dynamic.top_k if tree is None else max_non_leaves_per_layer(tree)
        return {"architecture": "EagleForCausalLM", "num_eagle_layers": plan.draft.model_only.max_tree_depth,
                "max_draft_len": plan.config.build.max_draft_len, "max_non_leaves_per_layer": non_leaves,
                "eagle_net_config": net}

    def trtllm_tensors(self, plan: BuildPlan, drafter: EagleDrafter, target: dict[str, torch.Tensor],
                       tensors: dict[str, torch.Tensor]) -> QKVLayout:
        head = drafter.head
        tensors.update(eagle_to_trtllm(head.state_dict(), head.config, plan.draft.model_only.max_tree_depth,
                                       target["model.embed_tokens.weight"], tensors["lm_head.weight"]))
        return QKVLayout.of(head.config)

    def trtllm_build_args(self, plan: BuildPlan) -> list[str]:
        return ["--speculative_decoding_mode", "eagle", "--max_draft_len", str(plan.config.build.max_draft_len),
                "--use_paged_context_fmha", "enable"]

    def trtllm_run_args(self, plan: BuildPlan) -> list[str]:
        # run.py asserts `not args.use_py_session, "Eagle does not support py session"`.
        tree = plan.draft.static_tree
        if tree is not None:
            return [f"--eagle_choices={choices_string(tree)}"]
        return ["--eagle_use_dynamic_tree", f"--eagle_dynamic_tree_max_top_k={plan.draft.dynamic.top_k}"]

    def check_trtllm_backend(self, draft: DraftSpec) -> None:
        if draft.tree == DYNAMIC:
            raise ConfigError("engine: an EAGLE-2 dynamic-tree engine; the tensorrtllm backend's parameters take a "
                              "static eagle_choices tree only (its default would be mc_sim_7b_63, which does not fit "
                              "this engine's num_eagle_layers). Build with draft.tree.choices or a preset, or serve it "
                              "with --backend python")

    # ---- training --------------------------------------------------------------------------------------------------

    trains = True
    metrics_meaning = ("held-out agreement with the target's greedy token; entry d = depth d + 1 (drafted as a tree "
                       "branch: exact features to the root, the head's own below it)")
    metrics_rows = ("depth", 1)
    # where the weights started (a resumed state has moved on from them), and the training-time test, which may be
    # switched on for what follows
    resume_ignores = ("init", "unroll", "unroll_decay", "unroll_from")

    def init_head(self, section: EagleSection, target_vocab: int) -> HeadInit | None:
        return eagle_init(section, target_vocab)

    def train_module(self, section: EagleSection, target: TrainingTarget, init: HeadInit | None) -> EagleTrainHead:
        module = EagleTrainHead(eagle_layer_config(target.config))
        if init is not None:
            _start_from(module, init[0], section.init)
        return module

    def train_loss(self, module: EagleTrainHead, section: EagleSection, target: TrainingTarget, ids: torch.Tensor,
                   hidden: torch.Tensor, logits: torch.Tensor, labels: str,
                   step: int) -> tuple[torch.Tensor, dict[str, float]]:
        return eagle_loss(module, target.view, hidden, logits, ids, section, labels, eagle_runs(section, step))

    def train_metrics(self, module: EagleTrainHead, target: TrainingTarget,
                      batches: Iterable[EvalBatch]) -> dict[str, list[float]]:
        return eagle_metrics(module, target.view, batches)

    def save_head(self, module: EagleTrainHead, section: EagleSection, heads: HeadsSection, target_config: Any,
                  log_file: Path, vocab: DraftVocab | None) -> Path:
        return save_eagle(module, section, heads, target_config, log_file, vocab)


KIND = EagleBuild()
