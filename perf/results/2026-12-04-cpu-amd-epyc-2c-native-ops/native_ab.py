"""Same process, interleaved: plain and the configured drafter with and without the native RMSNorm / RoPE."""
import sys, time, os, statistics, json
sys.path.insert(0, '.')  # run from the repository root
import torch
torch.set_num_threads(2)
from pathlib import Path
from perf.bench import BenchConfig, load_target, build_decoder, resolve, VariantSpec, encode_prompt
from runtime.prompts import load_prompt_file
from plugins import native_build
from plugins.rowwise import native as rowwise
cfg = BenchConfig(config=Path('configs/smollm2.yaml'), threads=2)
target = load_target(cfg)
files = os.environ.get('PROMPTS').split(',')
prompts = [p for f in files for p in load_prompt_file(f)]
a, b, c = (int(x) if x else None for x in os.environ.get('SEL', '::').split(':'))
prompts = prompts[a:b:c]
enc = [encode_prompt(target.tokenizer, p) for p in prompts]
MAXT = int(os.environ.get('MAXT', 128))
real = rowwise._library
def off():
    raise RuntimeError("disabled for the A/B")
disabled = native_build.Lazy(off)
plain = build_decoder(target, None)[0]
spec = build_decoder(target, resolve(VariantSpec.parse('eagle'), target, {}))[0]
V = [('plain-torch', plain, disabled), ('plain-native', plain, real), ('eagle-torch', spec, disabled), ('eagle-native', spec, real)]
for name, dec, lib in V:
    rowwise._library = lib; dec.generate(enc[0], max_tokens=32, ignore_eos=True)
wall = {v[0]: [] for v in V}; toks = {}
for i, ids in enumerate(enc):
    order = V[i % 4:] + V[:i % 4]
    for name, dec, lib in order:
        rowwise._library = lib
        t = time.perf_counter(); r = dec.generate(ids, max_tokens=MAXT, ignore_eos=True); wall[name].append(time.perf_counter() - t)
        toks[(name, i)] = r.token_ids
    same = toks[('eagle-torch', i)] == toks[('plain-torch', i)] and toks[('eagle-native', i)] == toks[('plain-native', i)]
    print(i, prompts[i].key, ' '.join(f"{n} {wall[n][-1]:.2f}" for n, _, _ in V), 'identical' if same else 'DIFFERENT', flush=True)
tot = {n: sum(w) for n, w in wall.items()}
res = {n: {'seconds': tot[n], 'tokens_per_s': len(enc) * MAXT / tot[n]} for n in tot}
for n in tot: print(f"{n:14s} {res[n]['tokens_per_s']:.2f} tok/s")
print(f"native vs torch: plain {tot['plain-torch']/tot['plain-native']:.3f}x, eagle {tot['eagle-torch']/tot['eagle-native']:.3f}x")
print(f"eagle / plain: torch {tot['plain-torch']/tot['eagle-torch']:.3f}x, native {tot['plain-native']/tot['eagle-native']:.3f}x")
json.dump({'prompts': [p.key for p in prompts], 'max_tokens': MAXT, 'wall_s': wall, 'summary': res}, open(os.environ.get('OUT', 'native_ab.json'), 'w'), indent=1)
