"""GPU checks of the Triton tree-attention kernel: correctness against the torch reference, then timing.

    python -m perf.tree_attention_gpu [--out perf/results/tree_attention_<gpu>.json] [--skip-bench]

1. Correctness: random trees and inputs over many shapes (L = 0, N = 1, N not a power of two, N > 32,
   L not a multiple of the key tile, GQA ratios, odd head sizes, forced and automatic KV splits, KV-cache
   views) for fp16 / bf16 / fp32; every output is NaN-poisoned before the launch; the error relative to
   max |reference| must stay under the per-dtype tolerance. The CUDA dispatch of
   torch.ops.spectree.tree_attention is checked to run the kernel.
2. Timing (Llama-3-8B attention: Hq 32, Hkv 8, D 128, batch 1, fp16 and bf16) at L in {512, 4096, 16384},
   N in {1, 16, 64}: the kernel, torch SDPA with a dense boolean mask (mask prebuilt, not timed) and the naive
   reference; achieved bandwidth = bytes the kernel must move (q, K/V prefix + tree, mask, out) / time,
   against the card's copy bandwidth measured here (a device-to-device copy, read + write bytes).
Exits 1 when a correctness check fails, 2 without CUDA. Results go to stdout and, as JSON, to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from plugins.tree_attention import pack_mask, tree_attention_reference
from plugins.tree_attention.launch import plan_launch
from plugins.tree_attention.mask import ancestor_mask, random_parents

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# (batch, q_heads, kv_heads, N, L, D, splits)
CHECK_SHAPES = [
    (1, 1, 1, 1, 0, 64, None),
    (1, 32, 8, 1, 4095, 128, None),
    (2, 32, 8, 16, 1000, 128, None),
    (1, 28, 4, 63, 777, 128, None),
    (3, 8, 8, 64, 0, 64, None),
    (2, 4, 2, 33, 129, 5, None),
    (1, 14, 2, 7, 300, 96, 3),
    (4, 12, 4, 31, 2048, 64, 8),
    (1, 32, 8, 64, 16384, 128, None),
    (2, 16, 16, 100, 50, 80, 1),
]
BENCH_PREFIX = (512, 4096, 16384)
BENCH_TREE = (1, 16, 64)


def make_inputs(batch, q_heads, kv_heads, n, prefix, d, dtype, seed, cache_len=None):
    g = torch.Generator().manual_seed(seed)
    tree = torch.stack([ancestor_mask(random_parents(n, g)) for _ in range(batch)])
    q = torch.randn(batch, q_heads, n, d, generator=g).to("cuda", dtype)
    total = prefix + n
    cache_len = cache_len or total
    k = torch.randn(batch, kv_heads, cache_len, d, generator=g).to("cuda", dtype)[:, :, :total]
    v = torch.randn(batch, kv_heads, cache_len, d, generator=g).to("cuda", dtype)[:, :, :total]
    return q, k, v, pack_mask(tree).cuda(), tree.cuda()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def check_correctness(kernel) -> list[dict]:
    rows = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for index, (batch, hq, hkv, n, prefix, d, splits) in enumerate(CHECK_SHAPES):
            for cache_extra in (0, 37):  # contiguous k/v, then views into a longer cache
                q, k, v, mask, _ = make_inputs(batch, hq, hkv, n, prefix, d, dtype, seed=index, cache_len=prefix + n + cache_extra)
                out = torch.full_like(q, float("nan"))
                kernel.tree_attention_triton(q, k, v, mask, 1 / math.sqrt(d), out=out, num_splits=splits)
                ref = tree_attention_reference(q, k, v, mask, 1 / math.sqrt(d))
                err = relative_error(out, ref)
                ok = bool(not out.isnan().any()) and err <= TOLERANCE[dtype]
                plan = plan_launch(
                    batch=batch, q_heads=hq, kv_heads=hkv, num_tree=n, prefix_len=prefix, head_dim=d,
                    elem_bytes=q.element_size(), num_splits=splits,
                    sm_count=torch.cuda.get_device_properties(0).multi_processor_count,
                )
                rows.append(dict(dtype=str(dtype).split(".")[1], shape=[batch, hq, hkv, n, prefix, d], splits=plan.num_splits,
                                 kv_view=bool(cache_extra), rel_error=err, ok=ok))
    q, k, v, mask, _ = make_inputs(2, 32, 8, 16, 1000, 128, torch.float16, seed=99)
    op_out = torch.ops.spectree.tree_attention(q, k, v, mask, 0.125)
    kernel_out = kernel.tree_attention_triton(q, k, v, mask, 0.125)
    rows.append(dict(dtype="float16", shape="torch.ops.spectree.tree_attention on CUDA == kernel",
                     rel_error=relative_error(op_out, kernel_out), ok=torch.equal(op_out, kernel_out)))
    return rows


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written)."""
    from triton.testing import do_bench

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def benchmark(kernel) -> list[dict]:
    from triton.testing import do_bench

    rows = []
    batch, hq, hkv, d = 1, 32, 8, 128
    for dtype in (torch.float16, torch.bfloat16):
        for prefix in BENCH_PREFIX:
            for n in BENCH_TREE:
                q, k, v, mask, tree = make_inputs(batch, hq, hkv, n, prefix, d, dtype, seed=prefix + n)
                k, v = k.contiguous(), v.contiguous()
                scale = 1 / math.sqrt(d)
                dense = torch.cat([torch.ones(batch, n, prefix, dtype=torch.bool, device="cuda"), tree], -1)[:, None]
                out = torch.empty_like(q)
                timings = {
                    "triton": do_bench(lambda: kernel.tree_attention_triton(q, k, v, mask, scale, out=out), return_mode="median"),
                    "sdpa_dense_mask": do_bench(
                        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale, enable_gqa=True),
                        return_mode="median",
                    ),
                    "reference": do_bench(lambda: tree_attention_reference(q, k, v, mask, scale), return_mode="median"),
                }
                moved = (2 * k.numel() + 2 * q.numel()) * q.element_size() + mask.numel() * 4
                plan = plan_launch(batch=batch, q_heads=hq, kv_heads=hkv, num_tree=n, prefix_len=prefix, head_dim=d,
                                   elem_bytes=q.element_size(), sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
                rows.append(dict(
                    dtype=str(dtype).split(".")[1], prefix=prefix, tree=n, splits=plan.num_splits,
                    ms={name: round(t, 5) for name, t in timings.items()},
                    triton_gbps=moved / (timings["triton"] * 1e-3) / 1e9,
                ))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON results path (default perf/results/tree_attention_<gpu>.json)")
    parser.add_argument("--skip-bench", action="store_true", help="correctness checks only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("tree_attention_gpu: no CUDA device; this script checks and times the Triton kernel on a GPU", file=sys.stderr)
        return 2
    from plugins.tree_attention import kernel

    props = torch.cuda.get_device_properties(0)
    import triton

    info = dict(gpu=props.name, sm_count=props.multi_processor_count, capability=list(torch.cuda.get_device_capability()),
                torch=torch.__version__, triton=triton.__version__, python=platform.python_version())
    print(json.dumps(info))
    checks = check_correctness(kernel)
    failed = [c for c in checks if not c["ok"]]
    for c in checks:
        print(f"{'ok  ' if c['ok'] else 'FAIL'} {c['dtype']:9} {c['shape']} splits={c.get('splits', '-')} "
              f"view={c.get('kv_view', '-')} rel_err={c['rel_error']:.2e}")
    print(f"correctness: {len(checks) - len(failed)} passed, {len(failed)} failed")
    results = dict(info=info, checks=checks)
    if not args.skip_bench:
        peak = copy_bandwidth()
        results["copy_gbps"] = peak
        print(f"measured copy bandwidth: {peak:.0f} GB/s")
        results["bench"] = benchmark(kernel)
        print(f"{'dtype':9} {'L':>6} {'N':>3} {'splits':>6} {'triton ms':>10} {'sdpa ms':>9} {'ref ms':>9} {'GB/s':>7} {'% copy':>7}")
        for r in results["bench"]:
            print(f"{r['dtype']:9} {r['prefix']:6} {r['tree']:3} {r['splits']:6} {r['ms']['triton']:10.4f} "
                  f"{r['ms']['sdpa_dense_mask']:9.4f} {r['ms']['reference']:9.4f} {r['triton_gbps']:7.0f} "
                  f"{100 * r['triton_gbps'] / peak:6.1f}%")
    out = args.out or Path("perf/results") / f"tree_attention_{re.sub(r'[^a-z0-9]+', '_', props.name.lower()).strip('_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
