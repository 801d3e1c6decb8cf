# Run from the repository root. Datastore.continuation of 401f1e1 (np.unique per depth) and of this commit (counting
# in Python) on the queries the configured drafter makes on 4 merge-tuning prompts (96 tokens each): per call, with
# caches warm, and cold (300 MB read between calls, as a target forward does); then whether both answer the same,
# on those queries and 3000 random ones.
import random
import subprocess
import sys
import time
import types

import numpy as np

sys.path.insert(0, 'perf/results/2026-12-04-cpu-intel-xeon-2c-head-features')
from common import setup  # noqa: E402

import runtime.drafters.datastore as DS  # noqa: E402

old = types.ModuleType('old_datastore')
exec(subprocess.check_output(['git', 'show', '401f1e1:runtime/drafters/datastore.py'], text=True), old.__dict__)
target, enc, dec = setup(11)
store = dec.drafter.lookup.datastore
calls = []
new_continuation = DS.Datastore.continuation


def record(self, context, depth, min_share):
    calls.append((list(context), depth, min_share))
    return new_continuation(self, context, depth, min_share)


DS.Datastore.continuation = record
for ids in enc:
    dec.generate(ids, max_tokens=96, ignore_eos=True)
DS.Datastore.continuation = new_continuation
big = np.ones(300_000_000 // 8)
for name, fn in (('401f1e1', old.Datastore.continuation), ('this commit', new_continuation)):
    for cold in (False, True):
        total = 0.0
        for c in calls:
            if cold:
                big.sum()
            t = time.perf_counter()
            fn(store, *c)
            total += time.perf_counter() - t
        print(f"{name:12s} {'cold' if cold else 'warm'}: {total / len(calls) * 1e6:6.1f} us per call ({len(calls)} calls)")
rng = random.Random(0)
queries = list(calls)
for _ in range(3000):
    e, n = rng.randrange(5, store.size), rng.randint(1, 6)
    queries.append(([int(t) for t in store.tokens[max(0, e - n):e]], rng.randint(1, 8), rng.choice([0.0, 0.3, 0.5, 0.9])))
same = sum(old.Datastore.continuation(store, *q) == new_continuation(store, *q) for q in queries)
print(f"same answer on {same} of {len(queries)} queries")
