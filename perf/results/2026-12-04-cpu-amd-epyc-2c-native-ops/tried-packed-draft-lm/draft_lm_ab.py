import sys, time, os, statistics, json
sys.path.insert(0, '.')  # run from the repository root
import torch
torch.set_num_threads(2)
from pathlib import Path
from perf.bench import BenchConfig, load_target, build_decoder, resolve, VariantSpec, encode_prompt
from runtime.prompts import load_prompt_file
import runtime.model as RM
import warnings; warnings.filterwarnings('ignore')
cfg = BenchConfig(config=Path('configs/smollm2.yaml'), threads=2)
target = load_target(cfg)
files = os.environ.get('PROMPTS', 'perf/prompts/chat.jsonl').split(',')
prompts = [p for f in files for p in load_prompt_file(f)]
sel = os.environ.get('SEL', '::2'); a, b, c = (int(x) if x else None for x in sel.split(':'))
prompts = prompts[a:b:c]
enc = [encode_prompt(target.tokenizer, p) for p in prompts]
MAXT = int(os.environ.get('MAXT', 128))
def dyn_lm(dec):
    d = dec.drafter.primary; w = d.lm_weight
    q = torch.ao.nn.quantized.dynamic.Linear(w.shape[1], w.shape[0], dtype=torch.qint8)
    q.set_weight_bias(torch.quantize_per_channel(w.float(), d.lm_int8.scales.float(), torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8), None)
    d.draft_logits = lambda f: q(f.float())
def packed_lm(dec):
    d = dec.drafter.primary; d.lm_int8 = None; d.lm_packed = RM.PackedWeight.of(d.lm_weight)
def int8_lm(dec):
    d = dec.drafter.primary; d.lm_packed = None; d.lm_int8 = RM.Int8Weight.of(d.lm_weight)
MODS = {'dyn': dyn_lm, 'packed': packed_lm, 'int8lm': int8_lm}
variants = {'plain': build_decoder(target, None)[0]}
for item in sys.argv[1:]:
    name, spec = item.split('=', 1)
    mod = None
    if '@' in spec: spec, mod = spec.split('@')
    dec = build_decoder(target, resolve(VariantSpec.parse(spec), target, {}))[0]
    if mod: MODS[mod](dec)
    variants[name] = dec
names = list(variants)
for n in names: variants[n].generate(enc[0], max_tokens=32, ignore_eos=True)
wall = {n: [] for n in names}; steps = {n: 0 for n in names}; same = {n: 0 for n in names}
for i, ids in enumerate(enc):
    order = names[i % len(names):] + names[:i % len(names)]
    ref = None; outs = {}
    for n in order:
        t = time.perf_counter(); r = variants[n].generate(ids, max_tokens=MAXT, ignore_eos=True); wall[n].append(time.perf_counter() - t)
        steps[n] += r.stats.steps; outs[n] = r.token_ids
    for n in names: same[n] += outs[n] == outs['plain']
    print(i, ' '.join(f"{n}:{wall['plain'][-1]/wall[n][-1]:.2f}" for n in names[1:]), flush=True)
tot = {n: sum(wall[n]) for n in names}
for n in names:
    per = [p / s for p, s in zip(wall['plain'], wall[n])]
    print(f"{n:12s} ratio(total) {tot['plain']/tot[n]:.3f}  median/prompt {statistics.median(per):.3f}  tau {len(enc)*MAXT/steps[n]:.2f}  identical {same[n]}/{len(enc)}")
json.dump({'prompts': [p.key for p in prompts], 'max_tokens': MAXT, 'variants': sys.argv[1:], 'wall_s': wall,
           'steps': steps, 'identical': same}, open(os.environ.get('OUT', 'ab.json'), 'w'), indent=1)
