# Run from the repository root. Would EAGLE-3-style multi-layer input features help this target's head?
#
# Two fine-tunes of the committed head (demo/smollm2/eagle), same data, same windows in the same order, same steps:
#   control: the head as it is, fc(cat(embed(x_{t+1}), f_t)), f_t the target's final-norm hidden state;
#   multi:   fc also reads the target's residual stream after layers LOW and MID at t (RMS-normalised, no weights),
#            through new fc columns that start at zero (so it starts as the committed head). Drafted nodes have no
#            target features: there the extra input is zero (the training-time test's runs s >= 1 see zeros).
# Then held-out agreement with the target's greedy token at depths 1-4 (drafted as a tree branch, as
# builder/train_heads.py measures it) on greedy answers to prompts no head was trained on.
#
# First: python demo/smollm2/rebuild_distill.py (the training answers, into out/smollm2-train/distill/) and
# python <this folder>/gen_heldout.py (the held-out answers, into out/s29-heldout/). Then, with D this folder:
#   python $D/ml_features.py features        # final / low / mid features of 900 training conversations and the held-out answers
#   STEPS=200 python $D/ml_features.py train control     (and multi; LR, LR_EXTRA, TAG for the second pair:
#   STEPS=300 LR=1e-4 LR_EXTRA=2e-3 TAG=-lr2 python $D/ml_features.py train control     and multi)
#   python $D/ml_features.py eval [RUN ...]   # the committed head and each run (default: control multi)
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, '.')
torch.set_num_threads(2)
from builder.train_heads import EagleTrainHead, EvalBatch, FrozenTargetView, eagle_layer_config, eagle_loss, \
    eagle_metrics, _start_from
from builder.training.config import EagleSection
from builder.training.distill import conversations, _load_hf
from runtime.drafters.draft_vocab import DraftVocab

WORK = Path('out/s29-ml')
TARGET = Path('models/smollm2-135m-instruct')
HEAD = Path('demo/smollm2/eagle')
LOW, MID = 2, 15  # 0-based decoder layers whose outputs are the extra features (EAGLE-3: low, middle)
N_TRAIN = int(__import__('os').environ.get('N_TRAIN', 900))  # training conversations (random, seed 0)
STEPS = int(__import__('os').environ.get('STEPS', 200))
SEQ, BATCH, WARMUP, MIN_RATIO = 256, 8, 20, 0.1
LR = float(__import__('os').environ.get('LR', 5e-4))  # every weight of the committed head
LR_EXTRA = float(__import__('os').environ.get('LR_EXTRA', LR))  # the new fc columns (multi)
TAG = __import__('os').environ.get('TAG', '')  # suffix of the saved run
SECTION = EagleSection(output=Path('unused'), ce_weight=0.1, feature_noise=0.02, unroll=3, unroll_from=0)


def rms(x):  # [..., H] float -> RMS-normalised, no weights
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@torch.no_grad()
def capture(model, seqs):
    """seqs: token lists -> (final, low, mid) each [sum len, H] bf16, each conversation run from its start."""
    got = {}

    def hook(idx):
        def f(_m, _i, out):
            got[idx] = out[0] if isinstance(out, tuple) else out
        return f
    hs = [model.model.layers[i].register_forward_hook(hook(i)) for i in (LOW, MID)]
    outs = ([], [], [])
    t0 = time.time()
    for n, s in enumerate(seqs):
        ids = torch.tensor([s])
        fin = model.model(input_ids=ids).last_hidden_state[0]
        outs[0].append(fin.to(torch.bfloat16))
        outs[1].append(rms(got[LOW][0].float()).to(torch.bfloat16))
        outs[2].append(rms(got[MID][0].float()).to(torch.bfloat16))
        if n % 100 == 0:
            print(f'  {n}/{len(seqs)} {time.time() - t0:.0f}s', flush=True)
    for h in hs:
        h.remove()
    return tuple(torch.cat(o) for o in outs)


def features():
    WORK.mkdir(parents=True, exist_ok=True)
    from builder.training.corpus import is_held_out
    from builder.training.distill import prompt_of
    convs = [c for c in conversations(Path('out/smollm2-train/distill')) if not is_held_out(prompt_of(c['id']), 0.05)]
    random.Random(0).shuffle(convs)
    train = convs[:N_TRAIN]
    held = conversations(Path('out/s29-heldout'))
    _, model = _load_hf(TARGET, 'bfloat16')
    for name, cs in (('held', held), ('train', train)):
        seqs = [c['prompt_ids'] + c['response_ids'] for c in cs]
        fin, low, mid = capture(model, seqs)
        torch.save({'tokens': torch.tensor([t for s in seqs for t in s]), 'lens': [len(s) for s in seqs],
                    'final': fin, 'low': low, 'mid': mid, 'ids': [c['id'] for c in cs]}, WORK / f'{name}.pt')
        print(name, len(seqs), 'conversations', fin.shape[0], 'tokens', flush=True)


class ExtraFc(nn.Module):
    """fc(cat(embed, f)) + extra(cat(low, mid)): a Linear(4H -> H) whose extra columns start at zero. The extra inputs
    of each fc call come from `queue` (None: zeros, a drafted node)."""

    def __init__(self, base: nn.Linear, extra_dim: int):
        super().__init__()
        self.base = base
        self.extra = nn.Linear(extra_dim, base.out_features, bias=False)
        nn.init.zeros_(self.extra.weight)
        self.queue = []

    def forward(self, x):
        e = self.queue.pop(0) if self.queue else None
        out = self.base(x)
        return out if e is None else out + self.extra(e)


def load_base():
    state = torch.load(HEAD / 'pytorch_model.bin', weights_only=True)
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(str(TARGET))
    head = EagleTrainHead(eagle_layer_config(cfg))
    _start_from(head, {k: v.float() for k, v in state.items() if k not in ('d2t', 't2d')}, HEAD)
    vocab = DraftVocab.from_state(state, cfg.vocab_size, HEAD / 'pytorch_model.bin')
    return head, vocab


def frozen_view(vocab):
    from runtime.checkpoint import load_checkpoint
    _, tensors = load_checkpoint(TARGET, dtype=torch.float32)
    embed = tensors['model.embed_tokens.weight']
    lm_full = tensors.get('lm_head.weight', embed)
    return FrozenTargetView(embed, lm_full[vocab.target_ids].contiguous()), lm_full


def make(name):
    head, vocab = load_base()
    if name == 'multi':
        head.fc = ExtraFc(head.fc, head.fc.in_features)
    return head, vocab


def lr_at(step, lr):
    if step < WARMUP:
        return lr * (step + 1) / WARMUP
    p = (step - WARMUP) / max(1, STEPS - WARMUP)
    return lr * (MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * p)))


def train(name):
    head, vocab = make(name)
    view, _ = frozen_view(vocab)
    d = torch.load(WORK / 'train.pt', weights_only=True)
    tokens, fin, extra = d['tokens'], d['final'], torch.cat([d['low'], d['mid']], -1)
    new = [p for n, p in head.named_parameters() if n == 'fc.extra.weight']
    decay = [p for n, p in head.named_parameters() if p.ndim >= 2 and n != 'fc.extra.weight']
    rest = [p for n, p in head.named_parameters() if p.ndim < 2]
    groups = [{'params': decay, 'weight_decay': 0.1, 'base': LR}, {'params': rest, 'weight_decay': 0.0, 'base': LR}]
    if new:
        groups.append({'params': new, 'weight_decay': 0.1, 'base': LR_EXTRA})
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95))
    rng = np.random.default_rng(1)  # the same windows for both runs
    starts = rng.integers(0, tokens.shape[0] - SEQ, size=(STEPS, BATCH))
    head.train()
    t0 = time.time()
    log = []
    for step in range(STEPS):
        pos = torch.from_numpy(starts[step])[:, None] + torch.arange(SEQ)[None]  # [B, T]
        ids, hidden = tokens[pos], fin[pos].float()
        if name == 'multi':
            head.fc.queue = [extra[pos][:, :-1].float()]  # run 0: real features; runs >= 1: zeros
        for g in opt.param_groups:
            g['lr'] = lr_at(step, g['base'])
        loss, info = eagle_loss(head, view, hidden, view.lm_head(hidden), ids, SECTION, 'target', SECTION.unroll)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if name == 'multi':
            head.fc.queue = []
        log.append({'step': step, 'loss': loss.item(), **info})
        if step % 20 == 0:
            print(f'{name} step {step} loss {loss.item():.4f} ce {info["ce"]:.3f} {time.time() - t0:.0f}s', flush=True)
    torch.save(head.state_dict(), WORK / f'{name}{TAG}.pt')
    json.dump({'steps': STEPS, 'lr': LR, 'lr_extra': LR_EXTRA, 'seconds': time.time() - t0, 'log': log},
              open(WORK / f'{name}{TAG}-log.json', 'w'))


@torch.no_grad()
def evaluate():
    d = torch.load(WORK / 'held.pt', weights_only=True)
    results = {}
    runs = sys.argv[2:] or ['control', 'multi']
    for run in ['base'] + runs:
        name = 'multi' if run.startswith('multi') else 'control'
        head, vocab = make(name)
        if run != 'base':
            head.load_state_dict(torch.load(WORK / f'{run}.pt', weights_only=True))
        head.eval()
        view, lm_full = frozen_view(vocab)
        to_draft = vocab.draft_index()
        tot = {'top1': [0.0] * 4, 'top5': [0.0] * 4}
        n_tok = [0] * 4
        start = 0
        for n in d['lens']:
            sl = slice(start, start + n)
            start += n
            ids = d['tokens'][sl][None]
            hidden = d['final'][sl][None].float()
            greedy = to_draft[F.linear(hidden, lm_full).argmax(-1)]
            if name == 'multi':
                head.fc.queue = [torch.cat([d['low'][sl], d['mid'][sl]], -1)[None, :-1].float()]
            m = eagle_metrics(head, view, [EvalBatch(ids, hidden, greedy, to_draft[ids])])
            if name == 'multi':
                head.fc.queue = []
            for k in tot:
                for depth in range(len(m[k])):
                    cnt = n - 2 - depth
                    tot[k][depth] += m[k][depth] * cnt
                    if k == 'top1':
                        n_tok[depth] += cnt
        results[run] = {k: [round(v / c, 4) for v, c in zip(tot[k], n_tok)] for k in tot}
        print(run, results[run], flush=True)
    json.dump(results, open(WORK / f"eval-{'-'.join(runs)}.json", 'w'), indent=1)


if __name__ == '__main__':
    {'features': features, 'train': lambda: train(sys.argv[2]), 'eval': evaluate}[sys.argv[1]]()
