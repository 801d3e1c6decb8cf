"""`python -m builder train-heads --config CFG`: Medusa-1 and EAGLE-1 draft heads for a frozen target.

The target (a Hugging Face checkpoint, run by `transformers`' reference Llama in float32) supplies, for every
corpus window, its final-norm hidden states h_t (the lm_head input: exactly what `runtime` hands a drafter) and
its logits. Labels (heads.labels):
  target  the target's own next-token distribution (self-distillation: a draft is accepted when it agrees with
          the target, not with the corpus)
  data    the corpus tokens (Medusa-1's original recipe)

Medusa-1 (FasterDecoding): head i = Linear(H -> V)(ResBlock^n(h_t)) predicts x_{t+i+2}, i.e. the distribution
the target gives at position t+i+1. Each head starts as the target itself: ResBlock linears at zero (identity)
and the vocabulary projection copied from the target's lm_head. Loss: sum_i 0.8^i CE_i (Medusa's weighting).

EAGLE-1 (SafeAILab): at position t the head reads fc(cat(embed(x_{t+1}), f_t)) (the target's embedding, frozen
and shared), runs one Llama decoder layer without input_layernorm (causal over the window, position t) and
predicts f_{t+1}; the target's frozen lm_head turns it into the distribution of x_{t+2}.
Loss = SmoothL1(f'_{t+1}, f_{t+1}) + ce_weight * CE(lm_head(f'_{t+1}), labels of x_{t+2}), as in EAGLE.

Training-time test (HASS / EAGLE-3; heads.eagle.unroll > 1): the head also runs on its own predicted features in
the same window, each run attending what a depth-d tree node attends while drafting (`EagleTrainHead.unrolled`).

Held-out metrics on fixed windows: Medusa top-1 / top-5 agreement with the target's greedy token per head
(= per tree depth); EAGLE the same per depth, drafted as a tree branch is (exact target features up to the root,
the head's own predictions below it).
Outputs: FasterDecoding head directory (config.json + medusa_lm_head.safetensors) and the EAGLE repository's
layout (config.json + pytorch_model.bin), both loadable by `runtime.drafters` and by those projects' loaders;
plus training_log.jsonl and training_summary.json.

corpus.source "chat" (self-distillation, `_train_chat_heads`): the target's own greedy answers to chat prompts and
its hidden states over them are generated and cached once (builder.training.distill); training windows are ranges
of positions into that cache, so the target is never run while the heads learn. heads.draft_vocab_size restricts
both heads to the K tokens the answers use most (EAGLE-3 / FR-Spec): their logits cover the target's lm_head rows
of those tokens (Medusa's projections start from them), the labels are the target's distribution restricted to
them, and the saved heads carry EAGLE-3's d2t / t2d so the runtime maps drafts back to target ids. Each head
directory also gets datastore.npz: the training answers themselves (held-out prompts excluded), which the runtime
searches for draft continuations (runtime/drafters/datastore.py; `write_datastores`, `python -m builder datastore`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from builder.config import BuildConfigError
from builder.training.config import (
    EagleSection,
    HeadsSection,
    MedusaSection,
    TrainConfig,
)
from builder.training.corpus import (
    check_windows,
    fixed_windows,
    load_tokens,
    split_corpus,
)
from builder.train_target import SUMMARY_FILE as TRAINING_SUMMARY
from builder.training.loop import LEGACY_STATE_SUFFIX, STATE_SUFFIX, optimise
from runtime.checkpoint import IGNORED_SUFFIXES
from runtime.draft_spec import WEIGHTED_KINDS
from runtime.drafters.draft_vocab import DraftVocab, top_frequent
from runtime.errors import CheckpointError
from runtime.files import shown_path

MEDUSA_WEIGHT_DECAY = 0.8  # Medusa-1 weights head i's loss by 0.8^i
EVAL_TOPK = 5


# ---- modules (public state-dict names) -------------------------------------------------------------------


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


# ---- target features ---------------------------------------------------------------------------------------


@torch.no_grad()
def target_outputs(target: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids # [B, T] -> final-norm hidden # [B, T, H], logits # [B, T, V] float32 (the frozen target)."""
    hidden = target.model(input_ids=ids).last_hidden_state
    return hidden, target.lm_head(hidden).float()


def _soft_ce(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits # [N, V] against softmax(target_logits) # [N, V] (mean over N)."""
    return -(F.softmax(target_logits, -1) * F.log_softmax(logits, -1)).sum(-1).mean()


def _ce(logits: torch.Tensor, target_logits: torch.Tensor, data: torch.Tensor, labels: str) -> torch.Tensor:
    """logits, target_logits # [N, V]; data # [N] int64 corpus tokens."""
    if labels == "target":
        return _soft_ce(logits, target_logits)
    return F.cross_entropy(logits, data)


# ---- per-kind training steps and metrics ---------------------------------------------------------------


def medusa_loss(heads: nn.ModuleList, hidden: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor,
                labels: str) -> torch.Tensor:
    """hidden # [B, T, H], logits # [B, T, V] (target), ids # [B, T]. Head i at t vs position t+i+1."""
    total = hidden.new_zeros(())
    t = ids.shape[1]
    for i, head in enumerate(heads):
        span = t - i - 2  # positions t whose label x_{t+i+2} is inside the window
        out = head(hidden[:, :span]).flatten(0, 1)  # [B*span, V]
        loss = _ce(out, logits[:, i + 1:i + 1 + span].flatten(0, 1), ids[:, i + 2:].flatten(), labels)
        total = total + MEDUSA_WEIGHT_DECAY**i * loss
    return total


@dataclass(frozen=True)
class EvalBatch:
    """One held-out window as the metrics see it. Ids the heads output live in the draft vocabulary (the target's
    when it is not reduced); a target token outside a reduced draft vocabulary is -1 (never matched)."""

    ids: torch.Tensor  # [1, T] int64 target ids (the head's inputs)
    hidden: torch.Tensor  # [1, T, H] the target's final-norm hidden states
    greedy: torch.Tensor  # [1, T] int64 the target's greedy next token at each position, as a draft id
    data: torch.Tensor  # [1, T] int64 ids as draft ids


def eval_batches(target: nn.Module, windows) -> Any:
    """EvalBatches of id windows run through a transformers target (whole vocabulary)."""
    for ids in windows:
        hidden, logits = target_outputs(target, ids)
        yield EvalBatch(ids, hidden, logits.argmax(-1), ids)


@torch.no_grad()
def medusa_metrics(heads: nn.ModuleList, batches) -> dict[str, list[float]]:
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
        ce = _ce(out.flatten(0, 1), logits[:, s + 1:-1].flatten(0, 1), ids[:, s + 2:].flatten(), labels)
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


# ---- the loop ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadsResult:
    kind: str  # "medusa" | "eagle"
    output: Path
    steps: int
    elapsed_s: float
    metrics: dict[str, list[float]]  # held-out agreement per head / depth
    loss: float  # last training loss


def _fingerprint(kind: str, h: HeadsSection, section: Any, data_fp: str, target_fp: str) -> str:
    """What a resumable head state must agree with: head shape and optimisation settings, corpus, and the exact
    target weights (heads trained for one target must not resume against a retrained one)."""
    d = dataclasses.asdict(section)
    d.pop("output")
    d.pop("init", None)  # where the weights started: a resumed state has moved on from them
    for k in ("max_steps", "max_minutes", "threads"):  # extending a run's budget is allowed
        d["train"].pop(k)
    for k in ("unroll", "unroll_decay", "unroll_from"):  # so is switching the training-time test on for what follows
        d.pop(k, None)
    payload = json.dumps([kind, h.labels, d, data_fp, target_fp], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _prepare_kind(kind: str, h: HeadsSection, section: Any, train: np.ndarray, held_out: np.ndarray, what: str,
                  data_fp: str, target_fp: str) -> tuple[Any, str]:
    """Threads, window checks and seed for one head kind; returns its optimiser settings and state fingerprint."""
    opt = section.train
    if opt.threads is not None:
        torch.set_num_threads(opt.threads)
    check_windows(train, opt.seq_len, f"the training {what}")
    check_windows(held_out, opt.seq_len, f"the held-out {what}")
    torch.manual_seed(opt.seed)
    return opt, _fingerprint(kind, h, section, data_fp, target_fp)


def eagle_init(section: EagleSection, target_vocab: int) -> tuple[dict[str, torch.Tensor], DraftVocab | None] | None:
    """heads.eagle.init's weights (EagleTrainHead's keys, float32) and its reduced draft vocabulary; None when the
    section has no init. The head is checked as the runtime loads one (runtime.drafters.eagle)."""
    from runtime.checkpoint import read_head_state
    from runtime.drafters.eagle import SAFETENSORS_FILE, TORCH_FILE

    if section.init is None:
        return None
    if not section.init.is_dir():
        raise BuildConfigError(f"heads.eagle.init: {shown_path(section.init)} is not a directory; expected an EAGLE "
                               f"head directory (config.json + {TORCH_FILE})")
    try:
        file, state = read_head_state(section.init, (TORCH_FILE, SAFETENSORS_FILE), "EAGLE")
        vocab = DraftVocab.from_state(state, target_vocab, file)
    except CheckpointError as exc:
        raise BuildConfigError(f"heads.eagle.init: {exc}") from exc
    return {k: v.float() for k, v in state.items()}, vocab


def _init_field(section: Any) -> dict[str, str]:
    """{"init": the head a run started from}, for its log and summary; {} when it started from scratch."""
    init = getattr(section, "init", None)
    return {} if init is None else {"init": shown_path(init)}


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


def target_digest(path: Path) -> str:
    """sha256 over the target checkpoint's config, tokenizer and weight files (names and bytes)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.iterdir() if p.is_file() and (
        p.suffix in (".safetensors", ".bin") or p.name in ("config.json", "tokenizer.json", "model.safetensors.index.json")))
    for f in files:
        digest.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def load_frozen_target(path: Path):
    from transformers import LlamaForCausalLM

    if not (path / "config.json").is_file():
        raise BuildConfigError(f"heads.target: {path} is not a Hugging Face checkpoint directory (no config.json)")
    target = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    target.eval().requires_grad_(False)
    return target


def train_heads(config: TrainConfig, only: str | None = None, fresh: bool = False,
                quiet: bool = False) -> list[HeadsResult]:
    """Train the configured heads (or `only` one kind) for heads.target; returns one result per kind."""
    h = config.heads
    if h is None:
        raise BuildConfigError(f"{config.source}: heads: missing; train-heads needs a heads section")
    kinds = _head_kinds(config, only)
    work = h.work_dir
    if fresh:
        for k in kinds:
            for suffix in (STATE_SUFFIX, LEGACY_STATE_SUFFIX):
                (work / f"{k}-state{suffix}").unlink(missing_ok=True)
            (work / f"{k}_log.jsonl").unlink(missing_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    if config.corpus.source == "chat":
        return _train_chat_heads(config, kinds, quiet)
    if h.draft_vocab_size is not None:
        raise BuildConfigError(f"{config.source}: heads.draft_vocab_size: got {h.draft_vocab_size}, expected none "
                               f"unless corpus.source is 'chat' (the vocabulary is counted on the target's answers)")
    target = load_frozen_target(h.target)
    target_fp = target_digest(h.target)
    split = split_corpus(config.corpus)
    data = load_tokens(split, h.target, work)
    if data.vocab_size != target.config.vocab_size:
        raise BuildConfigError(f"heads.target: tokenizer.json has {data.vocab_size} tokens but the model's vocab_size "
                               f"is {target.config.vocab_size}")
    results = []
    for kind in kinds:
        section = getattr(h, kind)
        opt, fp = _prepare_kind(kind, h, section, data.train, data.held_out, "split", split.fingerprint(), target_fp)
        if kind == "medusa":
            module = medusa_heads_module(target.lm_head.weight.detach(), section.num_heads, section.num_layers)

            def step_loss(ids, step, module=module):
                hidden, logits = target_outputs(target, ids)
                return medusa_loss(module, hidden, logits, ids, h.labels), {}

            def metrics(windows, module=module):
                return medusa_metrics(module, eval_batches(target, windows))
        else:
            module = EagleTrainHead(eagle_layer_config(target.config))
            init = eagle_init(section, target.config.vocab_size)
            if init is not None:
                if init[1] is not None:
                    raise BuildConfigError(f"heads.eagle.init: {shown_path(section.init)} scores a reduced draft "
                                           f"vocabulary; expected a full-vocabulary head unless corpus.source is 'chat'")
                _start_from(module, init[0], section.init)

            def step_loss(ids, step, module=module, section=section):
                hidden, logits = target_outputs(target, ids)
                return eagle_loss(module, target, hidden, logits, ids, section, h.labels, eagle_runs(section, step))

            def metrics(windows, module=module):
                return eagle_metrics(module, target, eval_batches(target, windows))

        def evaluate(step: int, metrics=metrics, opt=opt) -> dict[str, list[float]]:
            return metrics(fixed_windows(data.held_out, opt.eval_batches, opt.seq_len))

        steps, elapsed, loss, final = optimise(module, step_loss, evaluate, opt, data.train, opt.seq_len,
                                               work / f"{kind}-state{STATE_SUFFIX}", fp, work / f"{kind}_log.jsonl", kind, quiet)
        if kind == "medusa":
            save_medusa(module, section, h, target.config, work)
        else:
            save_eagle(module, section, h, target.config, work)
        result = HeadsResult(kind, section.output, steps, elapsed, final, loss)
        summary = {**dataclasses.asdict(result), "output": shown_path(section.output), "target": shown_path(h.target),
                   "labels": h.labels, "metrics_meaning": _MEANING[kind]}
        (section.output / TRAINING_SUMMARY).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        results.append(result)
    return results


# ---- self-distillation on the target's own chat answers (cached features, optional reduced vocabulary) ------


class FrozenTargetView(nn.Module):
    """What the head losses read from the frozen target when its features are cached: `model.embed_tokens` and
    an `lm_head` over the draft vocabulary (the target's lm_head rows of those tokens)."""

    def __init__(self, embed_weight: torch.Tensor, lm_weight: torch.Tensor) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        self.lm_head = nn.Linear(lm_weight.shape[1], lm_weight.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(lm_weight, requires_grad=False)


@dataclass(frozen=True)
class ChatData:
    tokens: torch.Tensor  # [T] int64
    hidden: torch.Tensor  # [T, H] bfloat16
    train: np.ndarray  # positions of the training conversations, concatenated
    held_out: np.ndarray  # positions of the held-out conversations
    vocab: DraftVocab | None
    to_draft: torch.Tensor  # [V] int64: target id -> draft id, -1 outside the draft vocabulary
    coverage: float  # share of held-out answer tokens inside the draft vocabulary
    train_answers: list[list[int]]  # the training conversations' answers (what the heads' datastore holds)


def _head_kinds(config: TrainConfig, only: str | None) -> list[str]:
    """The configured head kinds (or `only` that one); BuildConfigError when none is."""
    kinds = [k for k in WEIGHTED_KINDS if getattr(config.heads, k) is not None and only in (None, k)]
    if not kinds:
        raise BuildConfigError(f"{config.source}: heads.{only}: not configured")
    return kinds


def _save_datastores(config: TrainConfig, kinds: list[str], answers: list[list[int]]) -> list[tuple[Path, int, int]]:
    """datastore.npz of `answers` into each head's output directory; (file, answers, tokens) per head."""
    from runtime.drafters.datastore import DATASTORE_FILE, pack_answers, save_tokens

    tokens = pack_answers(answers)
    written = []
    for kind in kinds:
        out = getattr(config.heads, kind).output
        out.mkdir(parents=True, exist_ok=True)
        save_tokens(out / DATASTORE_FILE, tokens)
        written.append((out / DATASTORE_FILE, len(answers), int(tokens.shape[0]) - len(answers)))
    return written


def write_datastores(config: TrainConfig, only: str | None = None) -> list[tuple[Path, int, int]]:
    """Write each configured head's datastore (runtime/drafters/datastore.py) into its output directory: the
    target's answers to the training prompts (held-out prompts excluded, as from the heads' training), from the
    answers train-heads generated in heads.work_dir. Returns (file, answers, tokens) per head."""
    from builder.training.corpus import is_held_out
    from builder.training.distill import conversations, prompt_of

    c, h = config.corpus, config.heads
    if h is None or c.source != "chat":
        raise BuildConfigError(f"{config.source}: a datastore holds the target's chat answers: it needs "
                               f"corpus.source 'chat' and a heads section")
    kinds = _head_kinds(config, only)
    answers = [conv["response_ids"] for conv in conversations(h.work_dir / "distill")
               if not is_held_out(prompt_of(conv["id"]), c.held_out)]
    if not answers:
        raise BuildConfigError(f"{config.source}: no training answers in {h.work_dir / 'distill'}")
    return _save_datastores(config, kinds, answers)


def chat_data(config: TrainConfig, target_vocab: int, eos_ids: tuple[int, ...], quiet: bool,
              vocab: DraftVocab | None = None) -> ChatData:
    """Answers (generated once, resumable), cached features, the split by prompt id, the draft vocabulary (`vocab`
    when given: an init head's, checked against heads.draft_vocab_size by the caller; else counted on the answers)."""
    from builder.training.corpus import is_held_out
    from builder.training.distill import GenerateSettings, conversations, features, generate, prompt_of
    from runtime.prompts import load_prompt_file

    c, h = config.corpus, config.heads
    data_dir = h.work_dir / "distill"
    prompts = load_prompt_file(c.prompts)
    generate(h.target, [(p.id, p.text) for p in prompts], data_dir,
             GenerateSettings(max_new_tokens=c.max_new_tokens, batch_size=c.generate_batch, answers=c.answers,
                              temperature=c.answer_temperature), quiet=quiet)
    convs = conversations(data_dir)
    cached = features(h.target, data_dir, convs, quiet=quiet)
    train_pos, held_pos, counts = [], [], torch.zeros(target_vocab, dtype=torch.int64)
    held_answer, train_answers = [], []
    for conv, start in zip(convs, cached.starts.tolist()):
        n = len(conv["prompt_ids"]) + len(conv["response_ids"])
        positions = np.arange(start, start + n, dtype=np.int64)
        if is_held_out(prompt_of(conv["id"]), c.held_out):  # every answer of a prompt on one side
            held_pos.append(positions)
            held_answer.extend(conv["response_ids"])
        else:
            train_pos.append(positions)
            train_answers.append(conv["response_ids"])
            counts += torch.bincount(torch.tensor(conv["response_ids"], dtype=torch.int64), minlength=target_vocab)
    if not train_pos or not held_pos:
        raise BuildConfigError(f"{config.source}: corpus.held_out {c.held_out} leaves no "
                               f"{'training' if not train_pos else 'held-out'} conversations among {len(convs)}")
    to_draft = torch.arange(target_vocab)
    if vocab is not None:
        to_draft = vocab.draft_index()
    elif h.draft_vocab_size is not None:
        if h.draft_vocab_size > target_vocab:
            raise BuildConfigError(f"{config.source}: heads.draft_vocab_size: got {h.draft_vocab_size}, expected at "
                                   f"most the target's vocabulary size {target_vocab}")
        vocab = DraftVocab(top_frequent(counts, h.draft_vocab_size, always=eos_ids), target_vocab)
        to_draft = vocab.draft_index()
    held = torch.tensor(held_answer, dtype=torch.int64)
    coverage = float((to_draft[held] >= 0).float().mean()) if held.numel() else 1.0
    return ChatData(torch.from_numpy(cached.tokens.astype(np.int64)), cached.hidden, np.concatenate(train_pos),
                    np.concatenate(held_pos), vocab, to_draft, coverage, train_answers)


def _train_chat_heads(config: TrainConfig, kinds: list[str], quiet: bool) -> list[HeadsResult]:
    from runtime.checkpoint import load_checkpoint

    h = config.heads
    work = h.work_dir
    from transformers import AutoConfig

    ours, tensors = load_checkpoint(h.target, dtype=torch.float32)
    target_config = AutoConfig.from_pretrained(str(h.target))  # what the transformers-built heads are shaped from
    embed = tensors["model.embed_tokens.weight"]
    lm_full = tensors.get("lm_head.weight", embed)  # [V, H]
    init = eagle_init(h.eagle, ours.vocab_size) if "eagle" in kinds else None
    if init is not None and (init[1] is None) != (h.draft_vocab_size is None):
        raise BuildConfigError(f"heads.eagle.init: {shown_path(h.eagle.init)} "
                               f"{'scores the full vocabulary' if init[1] is None else 'has a reduced draft vocabulary'}"
                               f", but heads.draft_vocab_size is {h.draft_vocab_size}")
    if init is not None and init[1] is not None and init[1].size != h.draft_vocab_size:
        raise BuildConfigError(f"{config.source}: heads.draft_vocab_size: got {h.draft_vocab_size}, but the init "
                               f"head scores a draft vocabulary of {init[1].size} tokens")
    data = chat_data(config, ours.vocab_size, tuple(ours.eos_token_ids), quiet, None if init is None else init[1])
    lm_draft = lm_full if data.vocab is None else lm_full[data.vocab.target_ids].contiguous()  # [K, H]
    view = FrozenTargetView(embed, lm_draft)
    target_fp = target_digest(h.target)
    # Not the corpus size: a run may go on after prompts or answers were appended to its corpus, as it may after its
    # budget was extended (each resume record in the log gives the training positions it saw from then on).
    data_fp = hashlib.sha256(json.dumps([str(config.corpus.prompts), h.draft_vocab_size,
                                         config.corpus.held_out]).encode()).hexdigest()[:16]

    def gather(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions # [B, T] -> ids # [B, T] int64, hidden # [B, T, H] float32."""
        return data.tokens[pos], data.hidden[pos].float()

    def held_batches(opt) -> Any:
        for pos in fixed_windows(data.held_out, opt.eval_batches, opt.seq_len):
            ids, hidden = gather(pos)
            greedy = data.to_draft[F.linear(hidden, lm_full).argmax(-1)]  # the target's greedy token, as a draft id
            yield EvalBatch(ids, hidden, greedy, data.to_draft[ids])

    results = []
    for kind in kinds:
        section = getattr(h, kind)
        opt, fp = _prepare_kind(kind, h, section, data.train, data.held_out, "conversations", data_fp, target_fp)
        if kind == "medusa":
            module = medusa_heads_module(lm_draft, section.num_heads, section.num_layers)

            def step_loss(pos, step, module=module):
                ids, hidden = gather(pos)
                return medusa_loss(module, hidden, view.lm_head(hidden), ids, "target"), {}

            def metrics(module=module, opt=opt):
                return medusa_metrics(module, held_batches(opt))
        else:
            module = EagleTrainHead(eagle_layer_config(target_config))
            if init is not None:
                _start_from(module, init[0], section.init)

            def step_loss(pos, step, module=module, section=section):
                ids, hidden = gather(pos)
                return eagle_loss(module, view, hidden, view.lm_head(hidden), ids, section, "target",
                                  eagle_runs(section, step))

            def metrics(module=module, opt=opt):
                return eagle_metrics(module, view, held_batches(opt))

        steps, elapsed, loss, final = optimise(module, step_loss, lambda step, metrics=metrics: metrics(), opt,
                                               data.train, opt.seq_len, work / f"{kind}-state{STATE_SUFFIX}", fp,
                                               work / f"{kind}_log.jsonl", kind, quiet,
                                               start_fields={"draft_vocab_size": h.draft_vocab_size,
                                                             "draft_vocab_coverage": round(data.coverage, 4),
                                                             "train_positions": int(data.train.shape[0]),
                                                             **_init_field(section)})
        if kind == "medusa":
            save_medusa(module, section, h, target_config, work, data.vocab)
        else:
            save_eagle(module, section, h, target_config, work, data.vocab)
        result = HeadsResult(kind, section.output, steps, elapsed, final, loss)
        summary = {**dataclasses.asdict(result), "output": shown_path(section.output), "target": shown_path(h.target),
                   "labels": "target (its own greedy chat answers)", "metrics_meaning": _MEANING[kind],
                   "draft_vocab_size": h.draft_vocab_size, "draft_vocab_coverage": data.coverage,
                   "train_tokens": int(data.train.shape[0]), "held_out_tokens": int(data.held_out.shape[0]),
                   **_init_field(section)}
        (section.output / TRAINING_SUMMARY).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        results.append(result)
    _save_datastores(config, kinds, data.train_answers)
    return results


_MEANING = {
    "medusa": "held-out agreement with the target's greedy token; entry i = head i (tree depth i + 1)",
    "eagle": "held-out agreement with the target's greedy token; entry d = depth d + 1 (drafted as a tree branch: exact "
             "features to the root, the head's own below it)",
}


def swap_in(tmp: Path, out: Path) -> None:
    """Replace directory `out` by `tmp` (written in full first: a failed write never leaves half a head)."""
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)


def fresh_tmp(out: Path) -> Path:
    """An empty directory beside `out` to write its next version into (`swap_in`)."""
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def save_medusa(heads: nn.ModuleList, section: MedusaSection, h: HeadsSection, target_config: Any, work: Path,
                vocab: DraftVocab | None = None) -> Path:
    """FasterDecoding layout: config.json (medusa_num_heads, medusa_num_layers, ...) + medusa_lm_head.safetensors."""
    from safetensors.torch import save_file

    dtype = getattr(torch, h.save_dtype)
    tmp = fresh_tmp(section.output)
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
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    state = {k: v.detach().to(dtype).contiguous() for k, v in heads.state_dict().items()}
    if vocab is not None:
        state.update(vocab.state())
    save_file(state, str(tmp / "medusa_lm_head.safetensors"), metadata={"format": "pt"})
    shutil.copy2(work / "medusa_log.jsonl", tmp / "training_log.jsonl")
    swap_in(tmp, section.output)
    return section.output


def save_eagle(head: EagleTrainHead, section: EagleSection, h: HeadsSection, target_config: Any, work: Path,
               vocab: DraftVocab | None = None) -> Path:
    """EAGLE repository layout: Llama-style config.json (one layer, "bias": true for fc) + pytorch_model.bin."""
    dtype = getattr(torch, h.save_dtype)
    tmp = fresh_tmp(section.output)
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
    state = {k: v.to(dtype) for k, v in head.eagle_state_dict().items()}
    if vocab is not None:
        cfg["draft_vocab_size"] = vocab.size
        state.update(vocab.state())
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    torch.save(state, tmp / "pytorch_model.bin")
    shutil.copy2(work / "eagle_log.jsonl", tmp / "training_log.jsonl")
    swap_in(tmp, section.output)
    return section.output


def report_table(result: HeadsResult):
    """A rich table of a result's held-out agreement per head / depth."""
    from rich.table import Table

    label = "head" if result.kind == "medusa" else "depth"
    table = Table(title=f"{result.kind}: {result.steps} steps in {result.elapsed_s / 60:.1f} min -> {result.output}",
                  title_justify="left")
    table.add_column(label, justify="right")
    for name in result.metrics:
        table.add_column(name.replace("_", " "), justify="right")
    n = len(next(iter(result.metrics.values())))
    for i in range(n):
        table.add_row(str(i if result.kind == "medusa" else i + 1),
                      *(f"{result.metrics[k][i]:.3f}" for k in result.metrics if i < len(result.metrics[k])))
    return table


__all__ = [
    "EagleTrainHead",
    "HeadsResult",
    "ResBlock",
    "eagle_layer_config",
    "eagle_loss",
    "eagle_metrics",
    "eagle_runs",
    "load_frozen_target",
    "medusa_heads_module",
    "medusa_loss",
    "medusa_metrics",
    "report_table",
    "save_eagle",
    "save_medusa",
    "target_outputs",
    "train_heads",
]
