# Run from the repository root: VARIANTS=perf/results/2026-12-04-cpu-intel-xeon-2c/tried/v_quant.py SEL=0:44:4 python <this file>
"""Interleaved A/B of decoders on tuning prompts: tok/s, per-step split, identity."""
import sys, time, os, json, dataclasses
sys.path.insert(0, '.')
import torch
torch.set_num_threads(2)
from pathlib import Path
from perf.bench import BenchConfig, load_target, build_decoder, resolve, VariantSpec, encode_prompt
from runtime.prompts import load_prompt_file
cfg = BenchConfig(config=Path('configs/smollm2.yaml'), threads=2)
target = load_target(cfg)
files = os.environ.get('PROMPTS', 'demo/smollm2/prompts/merge-tuning.jsonl').split(',')
prompts = [p for f in files for p in load_prompt_file(f)]
a, b, c = (int(x) if x else None for x in os.environ.get('SEL', '::').split(':'))
prompts = prompts[a:b:c]
enc = [encode_prompt(target.tokenizer, p) for p in prompts]
MAXT = int(os.environ.get('MAXT', 128))
base = resolve(VariantSpec.parse('eagle'), target, {})
def variants():
    """name -> (decoder, setup callable or None)"""
    import importlib.util
    spec = importlib.util.spec_from_file_location('v', os.environ['VARIANTS'])
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
    return m.make(target, base, build_decoder)
V = variants()
names = list(V)
for n in names:
    dec, setup = V[n]
    if setup: setup()
    dec.generate(enc[0], max_tokens=32, ignore_eos=True)
wall = {n: [] for n in names}; toks = {}; split = {n: [0, 0, 0, 0, 0] for n in names}
for i, ids in enumerate(enc):
    order = names[i % len(names):] + names[:i % len(names)]
    for n in order:
        dec, setup = V[n]
        if setup: setup()
        t = time.perf_counter(); r = dec.generate(ids, max_tokens=MAXT, ignore_eos=True); wall[n].append(time.perf_counter() - t)
        toks[(n, i)] = r.token_ids; s = r.stats
        sp = split[n]; sp[0] += s.steps; sp[1] += s.time_draft; sp[2] += s.time_verify; sp[3] += s.time_other; sp[4] += s.generated_tokens
    same = all(toks[(n, i)] == toks[(names[0], i)] for n in names)
    print(i, prompts[i].key, ' '.join(f"{n} {wall[n][-1]:.2f}" for n in names), 'identical' if same else 'DIFFERENT', flush=True)
tot = {n: sum(w) for n, w in wall.items()}
ref = names[0]
for n in names:
    st, d, v, o, g = split[n]
    print(f"{n:16s} {len(enc)*MAXT/tot[n]:6.2f} tok/s  {tot[ref]/tot[n]:.3f}x of {ref}  tau {g/max(st,1):.2f}  per step: draft {d/max(st,1)*1e3:.2f} ms verify {v/max(st,1)*1e3:.2f} other {o/max(st,1)*1e3:.2f}")
json.dump({'prompts': [p.key for p in prompts], 'max_tokens': MAXT, 'wall_s': wall, 'split': split}, open(os.environ.get('OUT', 'ab.json'), 'w'), indent=1)
