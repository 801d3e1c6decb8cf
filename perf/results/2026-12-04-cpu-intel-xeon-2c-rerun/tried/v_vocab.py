# Draft vocabulary size side by side: SIZES=4096,6144,8192,12288,16384 VARIANTS=<this file> python ../../2026-12-04-cpu-intel-xeon-2c/tried/ab.py
# K < 8192: the head's K most frequent tokens (by count in its datastore, the target's own answers); K > 8192: the
# head's 8192 plus the next most frequent. The head was trained for its 8192; the draft output layer is the target's
# lm_head rows of the chosen ids, so any K runs.
import os
import numpy as np
import torch
from runtime.drafters import eagle
from runtime.drafters.draft_vocab import DraftVocab

_load = eagle.load_eagle_head
_size = {'k': None}
_tokens = np.load('demo/smollm2/eagle/datastore.npz')['tokens']
ORDER = [int(t) for t in np.argsort(-np.bincount(_tokens[_tokens >= 0], minlength=49152), kind='stable')]


def load(path, model):
    head = _load(path, model)
    k, have = _size['k'], head.vocab.target_ids.tolist()
    if k is None or k == len(have):
        return head
    own = set(have)
    if k < len(own):
        ids = [t for t in ORDER if t in own][:k]
    else:
        ids = list(own) + [t for t in ORDER if t not in own][:k - len(own)]
    head.vocab = DraftVocab(torch.tensor(sorted(ids)), head.vocab.target_vocab)
    return head


eagle.load_eagle_head = load


def make(target, base, build_decoder):
    out = {'plain': (build_decoder(target, None)[0], None)}
    for k in (int(s) for s in os.environ.get('SIZES', '8192,12288,16384').split(',')):
        _size['k'] = k
        out[f'vocab-{k}'] = (build_decoder(target, base)[0], None)
    return out
