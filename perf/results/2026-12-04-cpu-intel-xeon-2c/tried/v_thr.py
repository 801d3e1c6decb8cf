import torch
from runtime.drafters import merged
_orig = merged.MergedSession.draft
_mode = {'one': False}
def draft(self, *a, **k):
    if not _mode['one']:
        return _orig(self, *a, **k)
    torch.set_num_threads(1)
    try:
        return _orig(self, *a, **k)
    finally:
        torch.set_num_threads(2)
merged.MergedSession.draft = draft
def mode(v):
    def f(): _mode['one'] = v
    return f
def make(target, base, build_decoder):
    d = build_decoder(target, base)[0]
    return {'two': (d, mode(False)), 'one': (d, mode(True))}
