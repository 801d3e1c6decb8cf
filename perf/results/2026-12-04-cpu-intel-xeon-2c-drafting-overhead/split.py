# Run from the repository root. Where the time of drafting goes, measured inside decoding. The configured
# drafter on every fourth merge-tuning prompt (11 prompts, 128 tokens), each drafting function wrapped in a timer.
import functools
import sys
import time
from collections import defaultdict

sys.path.insert(0, 'perf/results/2026-12-04-cpu-intel-xeon-2c-head-features')
from common import setup  # noqa: E402  (puts the repository root on sys.path)

import runtime.decode as D  # noqa: E402
import runtime.drafters.datastore as DS  # noqa: E402
import runtime.drafters.eagle as E  # noqa: E402
import runtime.drafters.lookup as L  # noqa: E402
import runtime.drafters.merged as M  # noqa: E402
import runtime.tree as T  # noqa: E402

target, enc, dec = setup(4)
acc, cnt = defaultdict(float), defaultdict(int)


def timer(f, label):
    @functools.wraps(f)
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t
            cnt[label] += 1
    return timed


for owner, name, label in [
    (M.MergedSession, 'draft', 'merged.draft'), (E.EagleSession, '_run_pending', 'eagle._run_pending'),
    (E.EagleSession, '_draft_static', 'eagle._draft_static'), (E.DraftTreeCache, 'forward', 'head level forward'),
    (E.EagleSession, '_fill_children', 'eagle._fill_children'), (E.EagleDrafter, 'draft_logits', 'draft output layer'),
    (L.LookupSession, 'draft', 'lookup.draft'), (DS.Datastore, 'continuation', 'datastore.continuation'),
    (T.Tree, 'from_choices', 'Tree.from_choices'), (T.Tree, '__post_init__', 'Tree.__post_init__'),
]:
    raw = owner.__dict__[name]
    if isinstance(raw, classmethod):
        setattr(owner, name, classmethod(timer(raw.__func__, label)))
    else:
        setattr(owner, name, timer(raw, label))
for module, name in [(M, 'merge_pools'), (D, 'prune_draft')]:  # module functions: replaced where they are called
    setattr(module, name, timer(getattr(module, name), name))
dec.generate(enc[0], max_tokens=32, ignore_eos=True)
for _ in range(2):
    acc.clear()
    cnt.clear()
    steps = 0
    for ids in enc:
        steps += dec.generate(ids, max_tokens=128, ignore_eos=True).stats.steps
    print('steps', steps)
    for k in sorted(acc, key=lambda k: -acc[k]):
        print(f"{k:26s} {acc[k] / steps * 1e3:7.3f} ms/step  {cnt[k] / steps:5.2f} calls/step  "
              f"{acc[k] / cnt[k] * 1e6:8.1f} us/call")
