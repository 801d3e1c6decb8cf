"""`python -m builder train-heads --config CFG`: draft heads for a frozen target, one per configured kind (a
heads.<kind> section); what a head is, its loss, metrics and files are its builder kind's (`builder.drafters`:
Medusa-1 and EAGLE-1 heads, each in its module), the loop around them is here.

The target (a Hugging Face checkpoint, run by `transformers`' reference Llama in float32) supplies, for every
corpus window, its final-norm hidden states h_t (the lm_head input: exactly what `runtime` hands a drafter) and
its logits. Labels (heads.labels):
  target  the target's own next-token distribution (self-distillation: a draft is accepted when it agrees with
          the target, not with the corpus)
  data    the corpus tokens (Medusa-1's original recipe)

Held-out metrics on fixed windows, each kind's (`BuilderKind.train_metrics`). Outputs: each head directory in its
public format, loadable by `runtime.drafters` and by its project's loader, plus training_log.jsonl and
training_summary.json.

corpus.source "chat" (self-distillation, `_train_chat_heads`): the target's own greedy answers to chat prompts and
its hidden states over them are generated and cached once (builder.training.distill); training windows are ranges
of positions into that cache, so the target is never run while the heads learn. heads.draft_vocab_size restricts
every head to the K tokens the answers use most (EAGLE-3 / FR-Spec): their logits cover the target's lm_head rows
of those tokens, the labels are the target's distribution restricted to them, and the saved heads carry EAGLE-3's
d2t / t2d so the runtime maps drafts back to target ids. Each head directory also gets datastore.npz: the training
answers themselves (held-out prompts excluded), which the runtime searches for draft continuations
(runtime/drafters/datastore.py; `write_datastores`, `python -m builder datastore`).
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
from builder.drafters import EvalBatch, HeadInit, TrainingTarget, builder_kind, trained_kinds
from builder.training.config import HeadsSection, TrainConfig
from builder.training.corpus import (
    check_windows,
    fixed_windows,
    load_tokens,
    split_corpus,
)
from builder.train_target import SUMMARY_FILE as TRAINING_SUMMARY
from builder.training.loop import LEGACY_STATE_SUFFIX, STATE_SUFFIX, optimise
from runtime.drafters.draft_vocab import DraftVocab, top_frequent
from runtime.files import shown_path

EVAL_TOPK = 5  # held-out metrics count top-1 and top-EVAL_TOPK agreement


@torch.no_grad()
def target_outputs(target: nn.Module, ids: torch.Tensor,
                   layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """ids # [B, T] -> final-norm hidden # [B, T, H] (with feature `layers`: followed by the streams entering them,
    # [B, T, H * (1 + F)], as the runtime hands them to a drafter), logits # [B, T, V] float32 (the frozen target)."""
    out = target.model(input_ids=ids, output_hidden_states=bool(layers))
    hidden = out.last_hidden_state
    logits = target.lm_head(hidden).float()
    if layers:  # transformers' hidden_states[j] is the stream entering layer j
        hidden = torch.cat([hidden, *(out.hidden_states[j] for j in layers)], dim=-1)
    return hidden, logits


def _soft_ce(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits # [N, V] against softmax(target_logits) # [N, V] (mean over N)."""
    return -(F.softmax(target_logits, -1) * F.log_softmax(logits, -1)).sum(-1).mean()


def cross_entropy(logits: torch.Tensor, target_logits: torch.Tensor, data: torch.Tensor, labels: str) -> torch.Tensor:
    """logits, target_logits # [N, V]; data # [N] int64 corpus tokens. heads.labels "target": against the target's
    distribution; "data": against the corpus tokens."""
    if labels == "target":
        return _soft_ce(logits, target_logits)
    return F.cross_entropy(logits, data)


def eval_batches(target: nn.Module, windows, layers: tuple[int, ...] = ()) -> Any:
    """EvalBatches of id windows run through a transformers target (whole vocabulary)."""
    for ids in windows:
        hidden, logits = target_outputs(target, ids, layers)
        yield EvalBatch(ids, hidden, logits.argmax(-1), ids)


@dataclass(frozen=True)
class HeadsResult:
    kind: str  # the drafter kind
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
    for k in ("max_steps", "max_minutes", "threads"):  # extending a run's budget is allowed
        d["train"].pop(k)
    for k in builder_kind(kind).resume_ignores:
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


def _init_field(section: Any) -> dict[str, str]:
    """{"init": the head a run started from}, for its log and summary; {} when it started from scratch."""
    init = getattr(section, "init", None)
    return {} if init is None else {"init": shown_path(init)}


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
    tt = TrainingTarget(target, target.config, target.lm_head.weight.detach())
    results = []
    for kind in kinds:
        section, hooks = getattr(h, kind), builder_kind(kind)
        opt, fp = _prepare_kind(kind, h, section, data.train, data.held_out, "split", split.fingerprint(), target_fp)
        init = hooks.init_head(section, target.config.vocab_size)
        if init is not None and init[1] is not None:
            raise BuildConfigError(f"heads.{kind}.init: {shown_path(section.init)} scores a reduced draft vocabulary; "
                                   "expected a full-vocabulary head unless corpus.source is 'chat'")
        module = hooks.train_module(section, tt, init)
        layers = hooks.feature_layers(section, target.config)

        def step_loss(ids, step, module=module, section=section, hooks=hooks, layers=layers):
            hidden, logits = target_outputs(target, ids, layers)
            return hooks.train_loss(module, section, tt, ids, hidden, logits, h.labels, step)

        def evaluate(step: int, module=module, opt=opt, hooks=hooks, layers=layers) -> dict[str, list[float]]:
            windows = fixed_windows(data.held_out, opt.eval_batches, opt.seq_len)
            return hooks.train_metrics(module, tt, eval_batches(target, windows, layers))

        log = work / f"{kind}_log.jsonl"
        steps, elapsed, loss, final = optimise(module, step_loss, evaluate, opt, data.train, opt.seq_len,
                                               work / f"{kind}-state{STATE_SUFFIX}", fp, log, kind, quiet)
        hooks.save_head(module, section, h, target.config, log, None)
        result = HeadsResult(kind, section.output, steps, elapsed, final, loss)
        summary = {**dataclasses.asdict(result), "output": shown_path(section.output), "target": shown_path(h.target),
                   "labels": h.labels, "metrics_meaning": hooks.metrics_meaning}
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
    layers: tuple[int, ...]  # the feature layers cached (ascending; () none)
    features: torch.Tensor | None  # [T, len(layers) * H] bfloat16: their streams
    train: np.ndarray  # positions of the training conversations, concatenated
    held_out: np.ndarray  # positions of the held-out conversations
    vocab: DraftVocab | None
    to_draft: torch.Tensor  # [V] int64: target id -> draft id, -1 outside the draft vocabulary
    coverage: float  # share of held-out answer tokens inside the draft vocabulary
    train_answers: list[list[int]]  # the training conversations' answers (what the heads' datastore holds)


def _head_kinds(config: TrainConfig, only: str | None) -> list[str]:
    """The configured head kinds (or `only` that one); BuildConfigError when none is."""
    kinds = [k for k in trained_kinds() if getattr(config.heads, k, None) is not None and only in (None, k)]
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
              vocab: DraftVocab | None = None, layers: tuple[int, ...] = ()) -> ChatData:
    """Answers (generated once, resumable), cached features (and the streams entering feature `layers`), the split
    by prompt id, the draft vocabulary (`vocab` when given: an init head's, checked against heads.draft_vocab_size by
    the caller; else counted on the answers)."""
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
    cached = features(h.target, data_dir, convs, quiet=quiet, layers=layers)
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
    return ChatData(torch.from_numpy(cached.tokens.astype(np.int64)), cached.hidden, layers, cached.features,
                    np.concatenate(train_pos),
                    np.concatenate(held_pos), vocab, to_draft, coverage, train_answers)


def _init_vocab(config: TrainConfig, inits: dict[str, HeadInit | None]) -> DraftVocab | None:
    """The reduced draft vocabulary the heads' init weights score (None: none do), checked against
    heads.draft_vocab_size: the heads trained together share one vocabulary."""
    h, vocab = config.heads, None
    for kind, init in inits.items():
        if init is None:
            continue
        where = shown_path(getattr(h, kind).init)
        if (init[1] is None) != (h.draft_vocab_size is None):
            scores = "scores the full vocabulary" if init[1] is None else "has a reduced draft vocabulary"
            raise BuildConfigError(f"heads.{kind}.init: {where} {scores}, but heads.draft_vocab_size is "
                                   f"{h.draft_vocab_size}")
        if init[1] is not None and init[1].size != h.draft_vocab_size:
            raise BuildConfigError(f"{config.source}: heads.draft_vocab_size: got {h.draft_vocab_size}, but the init "
                                   f"head scores a draft vocabulary of {init[1].size} tokens")
        if vocab is not None and init[1] is not None and not torch.equal(vocab.target_ids, init[1].target_ids):
            raise BuildConfigError(f"heads.{kind}.init: {where} scores another draft vocabulary than the other "
                                   "heads' init")
        vocab = init[1] if init[1] is not None else vocab
    return vocab


def _train_chat_heads(config: TrainConfig, kinds: list[str], quiet: bool) -> list[HeadsResult]:
    from runtime.checkpoint import load_checkpoint

    h = config.heads
    work = h.work_dir
    from transformers import AutoConfig

    ours, tensors = load_checkpoint(h.target, dtype=torch.float32)
    target_config = AutoConfig.from_pretrained(str(h.target))  # what the transformers-built heads are shaped from
    embed = tensors["model.embed_tokens.weight"]
    lm_full = tensors.get("lm_head.weight", embed)  # [V, H]
    inits = {kind: builder_kind(kind).init_head(getattr(h, kind), ours.vocab_size) for kind in kinds}
    kind_layers = {kind: builder_kind(kind).feature_layers(getattr(h, kind), target_config) for kind in kinds}
    all_layers = tuple(sorted({j for layers in kind_layers.values() for j in layers}))
    data = chat_data(config, ours.vocab_size, tuple(ours.eos_token_ids), quiet, _init_vocab(config, inits),
                     all_layers)
    lm_draft = lm_full if data.vocab is None else lm_full[data.vocab.target_ids].contiguous()  # [K, H]
    view = FrozenTargetView(embed, lm_draft)
    target_fp = target_digest(h.target)
    # Not the corpus size: a run may go on after prompts or answers were appended to its corpus, as it may after its
    # budget was extended (each resume record in the log gives the training positions it saw from then on).
    data_fp = hashlib.sha256(json.dumps([str(config.corpus.prompts), h.draft_vocab_size,
                                         config.corpus.held_out]).encode()).hexdigest()[:16]

    h_size = embed.shape[1]

    def gather(pos: torch.Tensor, layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """positions # [B, T] -> ids # [B, T] int64, hidden # [B, T, H] float32 (followed by the streams entering
        feature `layers`: [B, T, H * (1 + F)])."""
        hidden = data.hidden[pos].float()
        if layers:
            cols = [data.layers.index(j) * h_size + c for j in layers for c in range(h_size)]
            hidden = torch.cat([hidden, data.features[pos][..., cols].float()], dim=-1)
        return data.tokens[pos], hidden

    def held_batches(opt, layers: tuple[int, ...]) -> Any:
        for pos in fixed_windows(data.held_out, opt.eval_batches, opt.seq_len):
            ids, hidden = gather(pos, layers)
            # the target's greedy token, as a draft id
            greedy = data.to_draft[F.linear(hidden[..., :h_size], lm_full).argmax(-1)]
            yield EvalBatch(ids, hidden, greedy, data.to_draft[ids])

    tt = TrainingTarget(view, target_config, lm_draft)
    results = []
    for kind in kinds:
        section, hooks = getattr(h, kind), builder_kind(kind)
        opt, fp = _prepare_kind(kind, h, section, data.train, data.held_out, "conversations", data_fp, target_fp)
        module = hooks.train_module(section, tt, inits[kind])
        layers = kind_layers[kind]

        def step_loss(pos, step, module=module, section=section, hooks=hooks, layers=layers):
            ids, hidden = gather(pos, layers)
            logits = view.lm_head(hidden[..., :h_size])
            return hooks.train_loss(module, section, tt, ids, hidden, logits, "target", step)

        def evaluate(step: int, module=module, opt=opt, hooks=hooks, layers=layers) -> dict[str, list[float]]:
            return hooks.train_metrics(module, tt, held_batches(opt, layers))

        log = work / f"{kind}_log.jsonl"
        steps, elapsed, loss, final = optimise(module, step_loss, evaluate, opt, data.train, opt.seq_len,
                                               work / f"{kind}-state{STATE_SUFFIX}", fp, log, kind, quiet,
                                               start_fields={"draft_vocab_size": h.draft_vocab_size,
                                                             "draft_vocab_coverage": round(data.coverage, 4),
                                                             "train_positions": int(data.train.shape[0]),
                                                             **_init_field(section)})
        hooks.save_head(module, section, h, target_config, log, data.vocab)
        result = HeadsResult(kind, section.output, steps, elapsed, final, loss)
        summary = {**dataclasses.asdict(result), "output": shown_path(section.output), "target": shown_path(h.target),
                   "labels": "target (its own greedy chat answers)", "metrics_meaning": hooks.metrics_meaning,
                   "draft_vocab_size": h.draft_vocab_size, "draft_vocab_coverage": data.coverage,
                   "train_tokens": int(data.train.shape[0]), "held_out_tokens": int(data.held_out.shape[0]),
                   **_init_field(section)}
        (section.output / TRAINING_SUMMARY).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        results.append(result)
    _save_datastores(config, kinds, data.train_answers)
    return results


def swap_in(tmp: Path, out: Path) -> None:
    """Replace directory `out` by `tmp` (written in full first: a failed write never leaves half a head)."""
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)


def publish_head(out: Path, config: dict, config_file: str, state: dict[str, torch.Tensor], weights_file: str,
                 vocab: Any, log_file: Path) -> Path:
    """Write a trained head to directory `out` in full, then swap it in: its config.json, its weights (plus a reduced
    vocabulary's d2t / t2d; safetensors, or torch.save for a .pt / .bin name) and the training log."""
    tmp = fresh_tmp(out)
    state = dict(state)
    if vocab is not None:
        state.update(vocab.state())
    (tmp / config_file).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if weights_file.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(state, str(tmp / weights_file), metadata={"format": "pt"})
    else:
        torch.save(state, tmp / weights_file)
    shutil.copy2(log_file, tmp / "training_log.jsonl")
    swap_in(tmp, out)
    return out


def fresh_tmp(out: Path) -> Path:
    """An empty directory beside `out` to write its next version into (`swap_in`)."""
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def report_table(result: HeadsResult):
    """A rich table of a result's held-out agreement per head / depth."""
    from rich.table import Table

    label, first = builder_kind(result.kind).metrics_rows
    table = Table(title=f"{result.kind}: {result.steps} steps in {result.elapsed_s / 60:.1f} min -> {result.output}",
                  title_justify="left")
    table.add_column(label, justify="right")
    for name in result.metrics:
        table.add_column(name.replace("_", " "), justify="right")
    n = len(next(iter(result.metrics.values())))
    for i in range(n):
        table.add_row(str(i + first),
                      *(f"{result.metrics[k][i]:.3f}" for k in result.metrics if i < len(result.metrics[k])))
    return table


__all__ = [
    "EVAL_TOPK",
    "HeadsResult",
    "cross_entropy",
    "eval_batches",
    "fresh_tmp",
    "load_frozen_target",
    "report_table",
    "swap_in",
    "target_outputs",
    "train_heads",
    "write_datastores",
]
