"""`python -m perf gpu-check`: every GPU measurement of the project in one prepared run (under 8 minutes on one
GPU), written to perf/results/<date>-<gpu>/gpu_check.json and gpu_check.md.

    kernel      the Triton tree-attention kernel against the fp64-accumulating reference on random trees and
                shapes (perf/tree_attention_gpu.py's CHECK_SHAPES: GQA ratios, N not a power of two, N > 32,
                prefixes up to 16K, KV-cache views), fp16 / bf16 / fp32, every output NaN-poisoned first
    bandwidth   kernel time against the KV-read floor: the bytes the kernel must read and write (q, the K/V prefix
                and tree, the mask, the output) over the card's measured copy bandwidth, for Llama-3-8B attention
                (Hq 32, Hkv 8, D 128) at L in {512, 4096, 16384}, N in {1, 16, 64}
    verify      verify(N) / verify(1) for N = 1..64, chain and random-tree masks, on a Llama-3-8B-shaped model with
                random weights in bfloat16 (perf/verify_cost.py's inputs, schedule and summary)
    e2e         the SmolLM2-135M-Instruct target on CUDA: speculative decoding with the drafter and tree of
                configs/smollm2.yaml against plain decoding on held-out chat prompts, greedy, timed after an untimed
                pass over every prompt (kernel compiles); every speculative output must equal plain decoding's
                token for token
    eagle3      the same target, prompts, dtype and timing with an EAGLE-3 drafter (`runtime.drafters.eagle3`), a static
                tree (the config's) and EAGLE-2's dynamic tree, greedy, each against plain decoding token for token
                (tau and acceptance by depth per tree), then one seeded sampled run that must finish. The head is
                --eagle3-head when that directory exists, else one with seeded random weights in the published
                layout, made by train-heads' own code (`builder.drafters.eagle3`) in a temporary directory; the report
                names it ("random (seed N)" or the path, with its sha256 and training summary), so a random head's
                tau, near 1, is not read as a trained one's

Exit status 1 when a kernel check fails, greedy identity breaks or the sampled EAGLE-3 run fails, 2 on bad settings
or without CUDA. `--dry-run` runs every section on the CPU with tiny shapes (the kernel sections then exercise
torch.ops.spectree.tree_attention's CPU path, not the Triton kernel) so CI checks the shapes and the files; its
numbers mean nothing.

On a lent GPU (the device tool), from the repository root:
    python -m perf gpu-check --out perf/results/{date}-{machine}
(the SmolLM2 checkpoint is imported first when missing: `python -m builder import-gguf --output DIR`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from perf.machine import expand_out, machine_info, now_iso, settings_dict
from runtime import schema
from runtime.config import DTYPES
from runtime.draft_spec import DraftSpec, DraftSpecError, drafter_kind
from runtime.drafters.eagle3 import NAME as EAGLE3  # the eagle3 section: the kind's own name
from runtime.errors import ConfigError
from runtime.files import read_json_object
from runtime.schema import setting

REPORT_FORMAT = "spectree-gpu-check"
REPORT_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parent.parent
BUDGET_SECONDS = 480.0  # all sections together (the "under 8 minutes")
SECTION_NAMES = ("kernel", "bandwidth", "verify", "e2e", EAGLE3)  # the run's order (`SECTIONS`); eagle3: the kind's
EAGLE3_SAMPLING = {"temperature": 0.7}  # the eagle3 section's sampled run (its seed: GpuCheckConfig.seed)


@dataclass(frozen=True)
class Shapes:
    """Every size the run uses; `full()` on a GPU, `tiny()` for --dry-run."""

    # (batch, q_heads, kv_heads, N, L, D, splits)
    kernel_cases: tuple[tuple[int, int, int, int, int, int, int | None], ...]
    kernel_dtypes: tuple[str, ...]
    bench_heads: tuple[int, int, int]  # Hq, Hkv, D
    bench_prefix: tuple[int, ...]
    bench_tree: tuple[int, ...]
    bench_dtypes: tuple[str, ...]
    verify_model: dict[str, int]  # ModelConfig sizes of the random target
    verify_sizes: tuple[int, ...]
    verify_context: int
    verify_dtype: str
    verify_repeats: int
    e2e_prompts: int
    e2e_tokens: int

    @classmethod
    def full(cls) -> Shapes:
        from perf.tree_attention_gpu import BENCH_PREFIX, BENCH_TREE, CHECK_SHAPES

        return cls(kernel_cases=tuple(tuple(s) for s in CHECK_SHAPES), kernel_dtypes=("float16", "bfloat16", "float32"),
                   bench_heads=(32, 8, 128), bench_prefix=BENCH_PREFIX, bench_tree=BENCH_TREE,
                   bench_dtypes=("float16", "bfloat16"),
                   verify_model=dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
                   verify_sizes=tuple(range(1, 65)), verify_context=2048, verify_dtype="bfloat16", verify_repeats=5,
                   e2e_prompts=6, e2e_tokens=128)

    @classmethod
    def tiny(cls) -> Shapes:
        return cls(kernel_cases=((1, 4, 2, 5, 9, 16, None), (2, 4, 4, 33, 40, 8, None), (1, 2, 1, 1, 0, 16, None)),
                   kernel_dtypes=("float32", "bfloat16"), bench_heads=(4, 2, 16), bench_prefix=(32,), bench_tree=(1, 8),
                   bench_dtypes=("float32",),
                   verify_model=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16),
                   verify_sizes=(1, 2, 3, 4), verify_context=16, verify_dtype="bfloat16", verify_repeats=2,
                   e2e_prompts=2, e2e_tokens=12)


@dataclass(frozen=True)
class GpuCheckConfig:
    """Everything `python -m perf gpu-check` takes (its flags' defaults come from here)."""

    out: str = setting("perf/results/{date}-{machine}", nonempty=True, what="an output directory")
    dry_run: bool = False  # CPU, tiny shapes: checks the shapes and the files, measures nothing meaningful
    smollm2: Path = REPO_ROOT / "models" / "smollm2-135m-instruct"  # imported from the GGUF when missing
    smollm2_config: Path = REPO_ROOT / "configs" / "smollm2.yaml"  # the drafter, its weights and tree
    e2e_draft: str | None = None  # a drafter kind overriding the config's (e.g. lookup: no head weights needed)
    # None: the config's build dtype (bf16 and fp16 run batch-invariant on CUDA: runtime/model.py `pads_rows`)
    e2e_dtype: str | None = setting(None, choices=tuple(DTYPES))
    # the eagle3 section's head (published EAGLE-3 layout); absent or None: seeded random weights (seed below).
    # The default is where demo/smollm2/train-eagle3.yaml writes the SmolLM2 head (not trained yet)
    eagle3_head: Path | None = REPO_ROOT / "demo" / "smollm2" / EAGLE3
    prompts: Path = REPO_ROOT / "perf" / "prompts" / "chat.jsonl"
    seed: int = 0
    sections: tuple[str, ...] = SECTION_NAMES  # a subset reruns only those
    shapes: Shapes = field(default_factory=Shapes.full)

    def __post_init__(self) -> None:
        schema.check(self, ConfigError)
        if self.e2e_draft is not None:
            try:
                drafter_kind(self.e2e_draft)
            except DraftSpecError as exc:
                raise ConfigError(f"e2e_draft: {exc.detail}") from exc
        if not self.sections or any(x not in SECTION_NAMES for x in self.sections):
            raise ConfigError(f"sections: got {list(self.sections)}, expected a non-empty subset of "
                                f"{', '.join(SECTION_NAMES)}")
        if self.eagle3_head is not None and self.eagle3_head.exists() and not self.eagle3_head.is_dir():
            raise ConfigError(f"eagle3_head: got {self.eagle3_head}, expected an EAGLE-3 head directory (or a path "
                              f"that does not exist: a random head then)")

    @property
    def device(self) -> torch.device:
        return torch.device("cpu" if self.dry_run else "cuda")


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    """Median milliseconds of a call: triton's do_bench on CUDA, repeated perf_counter on the CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=10, rep=50, return_mode="median"))

    def cpu(fn: Callable[[], Any]) -> float:
        fn()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)

    return cpu


def attention_inputs(case: tuple, dtype: torch.dtype, device: torch.device, seed: int, cache_extra: int = 0):
    """Random q, k, v (views into a longer cache when cache_extra > 0), packed random-tree mask.

    returns q [B, Hq, N, D], k / v [B, Hkv, L + N, D], mask [B, N, ceil(N / 32)] int32
    """
    from plugins.tree_attention import pack_mask
    from plugins.tree_attention.mask import ancestor_mask, random_parents

    batch, hq, hkv, n, prefix, d, _ = case
    g = torch.Generator().manual_seed(seed)
    tree = torch.stack([ancestor_mask(random_parents(n, g)) for _ in range(batch)])
    total = prefix + n
    q = torch.randn(batch, hq, n, d, generator=g).to(device, dtype)
    k = torch.randn(batch, hkv, total + cache_extra, d, generator=g).to(device, dtype)[:, :, :total]
    v = torch.randn(batch, hkv, total + cache_extra, d, generator=g).to(device, dtype)[:, :, :total]
    return q, k, v, pack_mask(tree).to(device)


def _kernel(device: torch.device) -> Callable[..., torch.Tensor]:
    """The attention under test: the Triton kernel on CUDA; on the CPU (dry run) the op's CPU path."""
    if device.type == "cuda":
        from plugins.tree_attention import kernel

        def run(q, k, v, mask, scale, splits=None):
            out = torch.full_like(q, float("nan"))  # poisoned: an unwritten element fails the check
            kernel.tree_attention_triton(q, k, v, mask, scale, out=out, num_splits=splits)
            return out

        return run
    import plugins.tree_attention  # noqa: F401  (registers torch.ops.spectree)

    return lambda q, k, v, mask, scale, splits=None: torch.ops.spectree.tree_attention(q, k, v, mask, scale)


def check_kernel(config: GpuCheckConfig) -> dict[str, Any]:
    from perf.tree_attention_gpu import TOLERANCE, relative_error
    from plugins.tree_attention import tree_attention_reference

    device, s = config.device, config.shapes
    run = _kernel(device)
    rows = []
    for dtype_name in s.kernel_dtypes:
        dtype = DTYPES[dtype_name]
        for index, case in enumerate(s.kernel_cases):
            for extra in (0, 37):
                q, k, v, mask = attention_inputs(case, dtype, device, seed=config.seed + index, cache_extra=extra)
                scale = 1 / math.sqrt(case[5])
                out = run(q, k, v, mask, scale, case[6])
                ref = tree_attention_reference(q, k, v, mask, scale)
                err = relative_error(out, ref)
                ok = bool(out.shape == q.shape and not out.isnan().any() and err <= TOLERANCE[dtype])
                rows.append({"dtype": dtype_name, "shape": list(case[:6]), "splits": case[6], "kv_view": bool(extra),
                             "rel_error": err, "tolerance": TOLERANCE[dtype], "ok": ok})
    return {"rows": rows, "passed": sum(r["ok"] for r in rows), "failed": sum(not r["ok"] for r in rows)}


def copy_bandwidth(device: torch.device, timer: Callable[[Callable[[], Any]], float]) -> float:
    """GB/s of a device-to-device copy, read + write bytes."""
    n = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3) / 1e9


def kernel_bandwidth(config: GpuCheckConfig) -> dict[str, Any]:
    device, s = config.device, config.shapes
    timer = _timer(device)
    run = _kernel(device)
    peak = copy_bandwidth(device, timer)
    hq, hkv, d = s.bench_heads
    rows = []
    for dtype_name in s.bench_dtypes:
        dtype = DTYPES[dtype_name]
        for prefix in s.bench_prefix:
            for n in s.bench_tree:
                q, k, v, mask = attention_inputs((1, hq, hkv, n, prefix, d, None), dtype, device, seed=prefix + n)
                k, v = k.contiguous(), v.contiguous()
                ms = timer(lambda: run(q, k, v, mask, 1 / math.sqrt(d)))
                moved = (k.numel() + v.numel() + 2 * q.numel()) * q.element_size() + mask.numel() * 4
                floor_ms = moved / (peak * 1e9) * 1e3
                rows.append({"dtype": dtype_name, "prefix": prefix, "tree": n, "kernel_ms": ms, "bytes": moved,
                             "floor_ms": floor_ms, "floor_over_kernel": floor_ms / ms if ms > 0 else None})
    return {"copy_gbps": peak, "rows": rows}


def random_target(sizes: dict[str, int], dtype: str, device: torch.device, seed: int):
    """A Llama-shaped TargetModel with random weights (N(0, 0.02), norms 1) on `device`."""
    from runtime.checkpoint import expected_shapes
    from runtime.config import ModelConfig
    from runtime.model import TargetModel

    config = ModelConfig(architecture="LlamaForCausalLM", max_position_embeddings=8192, rms_norm_eps=1e-5,
                         rope_theta=500000.0, rope_scaling=None, attention_bias=False, o_proj_bias=False,
                         mlp_bias=False, tie_word_embeddings=False, dtype=dtype, bos_token_id=None, eos_token_ids=(0,),
                         max_context=8192, **sizes)
    g = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=DTYPES[dtype], device=device)
        else:
            tensors[name] = (torch.randn(shape, generator=g, device=device) * 0.02).to(DTYPES[dtype])
    return TargetModel.from_state(config, tensors, source="random Llama-shaped weights")


def verify_ratios(config: GpuCheckConfig) -> dict[str, Any]:
    from perf.verify_cost import MASKS, Case, schedule, summarize, time_cases, verify_input

    device, s = config.device, config.shapes
    model = random_target(s.verify_model, s.verify_dtype, device, config.seed)
    c = model.config
    need = s.verify_context + max(s.verify_sizes)
    gen = torch.Generator().manual_seed(config.seed)
    cache = model.new_cache(need)
    model.prefill(torch.randint(0, c.vocab_size, (1, s.verify_context), generator=gen).to(device), cache)
    inputs = {}
    for m in MASKS:
        for n in s.verify_sizes:
            inp = verify_input(m, n, s.verify_context, c.vocab_size, gen)
            inputs[(m, n)] = (inp.tokens.to(device), inp.positions.to(device), inp.mask.to(device))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def call(case: Case) -> None:
        tokens, positions, mask = inputs[(case.mask, case.size)]
        model.forward(tokens, positions, cache, mask)
        sync()

    cases = [Case(s.verify_dtype, m, n) for m in MASKS for n in s.verify_sizes]
    time_cases(call, schedule(cases, 1, config.seed + 1))
    rows = summarize(time_cases(call, schedule(cases, s.verify_repeats, config.seed)))
    if cache.length != s.verify_context:
        raise RuntimeError("the cache advanced during the timed forwards; every forward must see the same context")
    params = sum(p.numel() for p in model.parameters())
    ran = _ran_in(model)
    del model, cache
    return {"model": {**s.verify_model, "dtype": s.verify_dtype, "parameters": params, "context": s.verify_context,
                      "ran": ran},
            "rows": [{k: r[k] for k in ("mask", "size", "median_ms", "min_ms", "ratio")} for r in rows]}


def _smollm2(config: GpuCheckConfig) -> Path:
    path = config.smollm2
    if not (path / "config.json").is_file():
        if config.dry_run:
            raise ConfigError(f"smollm2: {path} has no config.json (a dry run does not import checkpoints)")
        subprocess.run([sys.executable, "-m", "builder", "import-gguf", "--output", str(path)], check=True,
                       cwd=REPO_ROOT)
    return path


def _ran_in(model) -> dict[str, Any]:
    """What a loaded TargetModel runs in: a 16-bit model failing the load-time row check runs in float32."""
    from runtime.model import batch_invariant

    return {"dtype": str(model.dtype).removeprefix("torch."), "kv_dtype": str(model.kv_dtype).removeprefix("torch."),
            "batch_invariant": batch_invariant(model.dtype, model.device)}


def _e2e_target(config: GpuCheckConfig) -> tuple[Path, Any, int, str]:
    """The model sections' target: (checkpoint, its builder config (configs/smollm2.yaml: the demo engine's drafter,
    tree and dtype), max_draft_len, the dtype to load it in)."""
    from builder.config import load_config

    path = _smollm2(config)
    build = load_config(config.smollm2_config)
    return path, build, build.build.max_draft_len, config.e2e_dtype or build.build.dtype


def _timed(decoders: dict[str, Any], prompts: list[Any], tokens: int,
           device: torch.device) -> tuple[float, list[dict[str, tuple[float, Any]]]]:
    """Every prompt decoded by every decoder once untimed, then once timed, the decoders interleaved per prompt:
    (warm-up seconds, per prompt {decoder name: (seconds, GenerationResult)})."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # Warm-up: Triton compiles a kernel variant for each new launch shape class (tile plan, split count, ints equal to
    # 1 or divisible by 16), and the first H200 runs' early prompts paid those compiles inside their timings
    # (2026-12-04: per-prompt speedups 0.5x first, 2.5-3x later).
    t0 = time.perf_counter()
    for p in prompts:
        for decoder in decoders.values():
            decoder.generate(p.as_input(), max_tokens=tokens)
    sync()
    warm_seconds = time.perf_counter() - t0
    runs = []
    for p in prompts:
        timed = {}
        for name, decoder in decoders.items():
            sync()
            t0 = time.perf_counter()
            result = decoder.generate(p.as_input(), max_tokens=tokens)
            sync()
            timed[name] = (time.perf_counter() - t0, result)
        runs.append(timed)
    return warm_seconds, runs


def end_to_end(config: GpuCheckConfig) -> dict[str, Any]:
    """Speculative vs plain decoding of the SmolLM2 target on the device, greedy, same prompts, interleaved."""
    from perf import stats
    from perf.bench import Target, build_decoder
    from perf.prompt_sets import load_prompts
    from runtime.model import TargetModel
    from runtime.tokenizer import Tokenizer

    s = config.shapes
    path, build, limit, dtype = _e2e_target(config)
    draft = (DraftSpec.create(config.e2e_draft, max_draft_len=limit) if config.e2e_draft is not None
             else build.draft.spec(max_draft_len=limit))
    if config.device.type != "cpu":  # quantized draft weights are CPU kernels': on the GPU the head runs as stored
        draft = dataclasses.replace(draft, quantization=None)
    model = TargetModel.from_pretrained(path, dtype=dtype, device=config.device)  # shared by both decoders
    target = Target("checkpoint", path, model, Tokenizer.from_dir(path), draft)
    plain, _ = build_decoder(target, None)
    spec, _ = build_decoder(target, draft)
    tree = draft.static_tree
    prompts = load_prompts([config.prompts], limit=s.e2e_prompts)
    warm_seconds, runs = _timed({"plain": plain, "speculative": spec}, prompts, s.e2e_tokens, config.device)
    rows = []
    for p, timed in zip(prompts, runs):
        (tp, rp), (ts, rs) = timed["plain"], timed["speculative"]
        rows.append({"prompt": p.key, "tokens": len(rs.token_ids), "identical": rp.token_ids == rs.token_ids,
                     "first_difference": stats.first_difference(rp.token_ids, rs.token_ids),
                     "plain_tok_s": len(rp.token_ids) / tp, "spec_tok_s": len(rs.token_ids) / ts,
                     "speedup": tp / ts if ts > 0 else None, "tau": rs.stats.tau})
    total_plain = sum(r["tokens"] / r["plain_tok_s"] for r in rows)
    total_spec = sum(r["tokens"] / r["spec_tok_s"] for r in rows)
    return {"target": str(path), "drafter": draft.kind, "draft": draft.describe(), **_ran_in(model),
            "requested_dtype": dtype,
            "tree": json.dumps([list(c) for c in tree.choices]) if tree is not None else draft.tree,
            "rows": rows, "identical": all(r["identical"] for r in rows), "warmup_seconds": warm_seconds,
            "speedup": total_plain / total_spec if total_spec else None}


def _eagle3_head(config: GpuCheckConfig, target_path: Path, model: Any, tmp: Path) -> tuple[Path, dict[str, Any]]:
    """The eagle3 section's head directory and what the report says of it: config.eagle3_head when it exists, else
    a head with seeded random weights written into `tmp` by train-heads' own code (the module train-heads starts a
    head with, saved as a trained one is)."""
    from runtime.drafters.eagle import WEIGHT_FILES
    from runtime.engine import sha256_file

    asked = config.eagle3_head
    if asked is not None and asked.is_dir():
        head, info = asked, {"head": str(asked)}
        summary = asked / "training_summary.json"
        info["head_training"] = read_json_object(summary, ConfigError) if summary.is_file() else None
    else:
        head = _random_eagle3_head(config.seed, target_path, model, tmp)
        info = {"head": f"random (seed {config.seed})", "head_training": None,
                "head_asked": None if asked is None else f"{asked} (absent)"}
    weights = next((head / name for name in WEIGHT_FILES if (head / name).is_file()), None)
    info["head_weights"] = None if weights is None else weights.name
    info["head_sha256"] = None if weights is None else sha256_file(weights)
    return head, info


def _random_eagle3_head(seed: int, target_path: Path, model: Any, tmp: Path) -> Path:
    """An EAGLE-3 head for the target with seeded random weights (lm_head: the target's rows), in the published
    layout: `builder.drafters.eagle3`'s train_module and save_head, as train-heads starts and saves one."""
    from transformers import AutoConfig

    from builder.drafters import TrainingTarget, builder_kind
    from builder.train_heads import FrozenTargetView
    from builder.training.config import Eagle3Section, HeadsSection
    from runtime.drafters.eagle3 import default_feature_layers

    hf = AutoConfig.from_pretrained(target_path)
    layers = default_feature_layers(hf.num_hidden_layers)
    if len(layers) != 3 or layers[0] < 0:
        raise ConfigError(f"eagle3_head: absent, and a random head reads the default feature layers (2, L // 2, "
                          f"L - 3), which are not 3 distinct layers of this {hf.num_hidden_layers}-layer target "
                          f"({target_path}); expected a target of at least 7 layers or an EAGLE-3 head directory")
    kind = builder_kind(EAGLE3)
    section = Eagle3Section(output=tmp / "head")
    heads = HeadsSection(target=target_path, work_dir=tmp, eagle3=section)
    lm = model.lm_head_weight.detach().float().cpu()
    view = FrozenTargetView(model.model.embed_tokens.weight.detach().float().cpu(), lm)
    with torch.random.fork_rng(devices=[]):  # the head's initialisation draws from the global generator
        torch.manual_seed(seed)
        module = kind.train_module(section, TrainingTarget(view, hf, lm), None)
    tmp.mkdir(parents=True, exist_ok=True)
    log = tmp / "init_log.jsonl"  # save_head keeps a head's training log beside it
    log.write_text(json.dumps({"random_init": True, "seed": seed, "steps": 0}) + "\n", encoding="utf-8")
    return kind.save_head(module, section, heads, hf, log, None)


def eagle3_end_to_end(config: GpuCheckConfig) -> dict[str, Any]:
    """EAGLE-3 speculative decoding (a static and the dynamic tree) vs plain decoding of the e2e section's target on
    the device, greedy, its prompts and timing; then one seeded sampled run."""
    from perf import stats
    from perf.bench import Target, build_decoder
    from perf.prompt_sets import load_prompts
    from runtime.errors import SpectreeError
    from runtime.model import TargetModel
    from runtime.tokenizer import Tokenizer

    s = config.shapes
    path, build, limit, dtype = _e2e_target(config)
    model = TargetModel.from_pretrained(path, dtype=dtype, device=config.device)
    static = build.draft.spec(max_draft_len=limit).static_tree or "mc_sim_7b_63"
    with tempfile.TemporaryDirectory(prefix="gpu-check-eagle3-") as tmp:
        head, head_info = _eagle3_head(config, path, model, Path(tmp))
        specs = {name: DraftSpec.create(EAGLE3, path=head, tree=tree, max_draft_len=limit)
                 for name, tree in (("static", static), ("dynamic", "dynamic"))}
        target = Target("checkpoint", path, model, Tokenizer.from_dir(path), specs["static"])
        decoders = {"plain": build_decoder(target, None)[0],
                    **{name: build_decoder(target, spec, name)[0] for name, spec in specs.items()}}
        layers = decoders["static"].drafter.feature_layers
    prompts = load_prompts([config.prompts], limit=s.e2e_prompts)
    warm_seconds, runs = _timed(decoders, prompts, s.e2e_tokens, config.device)
    rows = []
    for name, spec in specs.items():
        per_prompt, accepted = [], []
        for p, timed in zip(prompts, runs):
            (tp, rp), (ts, rs) = timed["plain"], timed[name]
            accepted += rs.stats.accepted_per_step
            per_prompt.append({"prompt": p.key, "tokens": len(rs.token_ids), "identical": rp.token_ids == rs.token_ids,
                               "first_difference": stats.first_difference(rp.token_ids, rs.token_ids),
                               "speedup": tp / ts if ts > 0 else None, "tau": rs.stats.tau})
        tokens = sum(len(t["plain"][1].token_ids) for t in runs)
        plain_s, spec_s = sum(t["plain"][0] for t in runs), sum(t[name][0] for t in runs)
        tree = spec.static_tree
        rows.append({"tree": name, "draft": spec.describe(),
                     "choices": json.dumps([list(c) for c in tree.choices]) if tree is not None else None,
                     "tokens": tokens, "identical": all(r["identical"] for r in per_prompt),
                     "plain_tok_s": tokens / plain_s if plain_s > 0 else None,
                     "spec_tok_s": sum(r["tokens"] for r in per_prompt) / spec_s if spec_s > 0 else None,
                     "speedup": plain_s / spec_s if spec_s > 0 else None,
                     "tau": (sum(accepted) + len(accepted)) / len(accepted) if accepted else None,
                     "acceptance_by_depth": stats.reach_by_depth(accepted, spec.max_tree_depth),
                     "prompts": per_prompt})
    sampled = {"tree": "dynamic", **EAGLE3_SAMPLING, "seed": config.seed, "prompt": prompts[0].key}
    try:  # lossless in distribution is tests/'s to show; here it must run on the device
        result = decoders["dynamic"].generate(prompts[0].as_input(), max_tokens=s.e2e_tokens, seed=config.seed,
                                              **EAGLE3_SAMPLING)
        sampled.update(tokens=len(result.token_ids), tau=result.stats.tau,
                       verification=result.stats.verification, error=None)
    except (SpectreeError, RuntimeError) as exc:  # recorded (the run's other results are kept); fails the check
        sampled["error"] = f"{type(exc).__name__}: {exc}"
    return {"target": str(path), "drafter": EAGLE3, **head_info, "feature_layers": list(layers), **_ran_in(model),
            "requested_dtype": dtype, "rows": rows, "identical": all(r["identical"] for r in rows),
            "warmup_seconds": warm_seconds, "sampled": sampled}


SECTIONS: dict[str, Callable[[GpuCheckConfig], dict[str, Any]]] = {
    "kernel": check_kernel, "bandwidth": kernel_bandwidth, "verify": verify_ratios, "e2e": end_to_end,
    EAGLE3: eagle3_end_to_end,
}


def run_gpu_check(config: GpuCheckConfig, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    if not config.dry_run and not torch.cuda.is_available():
        raise ConfigError("gpu-check needs a CUDA device (torch sees none here); --dry-run checks the script on "
                            "the CPU")
    started = time.perf_counter()
    report: dict[str, Any] = {"format": REPORT_FORMAT, "format_version": REPORT_VERSION, "created": now_iso(),
                              "dry_run": config.dry_run, "machine": machine_info(),
                              "settings": {**settings_dict(config), "shapes": dataclasses.asdict(config.shapes)},
                              "budget_seconds": BUDGET_SECONDS, "sections": {}}
    for name, section in SECTIONS.items():
        if name not in config.sections:
            continue
        t0 = time.perf_counter()
        log(f"{name} ...")
        result = section(config)
        result["seconds"] = time.perf_counter() - t0
        report["sections"][name] = result
        log(f"{name}: {result['seconds']:.1f} s")
        if config.device.type == "cuda":
            torch.cuda.empty_cache()
    report["seconds"] = time.perf_counter() - started
    return _conclude(report)


def _conclude(report: dict[str, Any]) -> dict[str, Any]:
    report["within_budget"] = report["seconds"] <= BUDGET_SECONDS
    sections = report["sections"]
    eagle3 = sections.get(EAGLE3, {})
    report["ok"] = (sections.get("kernel", {}).get("failed", 0) == 0 and sections.get("e2e", {}).get("identical", True)
                    and eagle3.get("identical", True) and eagle3.get("sampled", {}).get("error") is None)
    return report


def merge_reports(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from runs of disjoint sections on one machine (the device tool's calls are short and its carry
    small, so a lent GPU's check can take several calls); each part's settings and time stay under "parts"."""
    if not parts:
        raise ConfigError("merge: expected at least one gpu_check.json")
    for i, r in enumerate(parts):
        if r.get("format") != REPORT_FORMAT or r.get("format_version") != REPORT_VERSION:
            raise ConfigError(f"merge: part {i} has format {r.get('format')!r} version {r.get('format_version')!r}, "
                              f"expected {REPORT_FORMAT!r} version {REPORT_VERSION}")
    seen: dict[str, int] = {}
    for i, r in enumerate(parts):
        for name in r["sections"]:
            if name in seen:
                raise ConfigError(f"merge: section {name!r} is in parts {seen[name]} and {i}; expected each once")
            seen[name] = i
    for key in ("gpu", "cpu_model", "torch"):
        values = {r["machine"].get(key) for r in parts}
        if len(values) > 1:
            raise ConfigError(f"merge: machine.{key} differs between parts ({sorted(map(str, values))}); expected "
                              "runs on one machine")
    if len({r["dry_run"] for r in parts}) > 1:
        raise ConfigError("merge: dry_run differs between parts; expected all dry runs or none")
    sections = {name: parts[seen[name]]["sections"][name] for name in SECTIONS if name in seen}
    first = parts[0]
    report = {"format": REPORT_FORMAT, "format_version": REPORT_VERSION, "created": first["created"],
              "dry_run": first["dry_run"], "machine": first["machine"],
              "settings": first["settings"], "budget_seconds": BUDGET_SECONDS, "sections": sections,
              "parts": [{"created": r["created"], "sections": list(r["sections"]), "seconds": r["seconds"],
                         "settings": r["settings"]} for r in parts],
              "seconds": sum(r["seconds"] for r in parts)}
    return _conclude(report)


def markdown(report: dict[str, Any]) -> str:
    s = report["sections"]
    m = report["machine"]
    lines = [f"# gpu-check {'(DRY RUN: CPU, tiny shapes; not measurements)' if report['dry_run'] else ''}".rstrip(), "",
             f"{report['created']}, {m.get('gpu') or m.get('cpu_model')}, torch {m['torch']}; "
             f"{report['seconds']:.0f} s (budget {report['budget_seconds']:.0f} s)"]
    if "parts" in report:
        lines += ["", f"Merged from {len(report['parts'])} runs: " + "; ".join(
            f"{', '.join(r['sections'])} ({r['created']}, {r['seconds']:.0f} s)" for r in report["parts"])]
    if "kernel" in s:
        lines += ["", f"## Tree-attention kernel vs reference: {s['kernel']['passed']} passed, "
                  f"{s['kernel']['failed']} failed", "",
                  "| dtype | B, Hq, Hkv, N, L, D | splits | KV view | rel. error | ok |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['dtype']} | {r['shape']} | {r['splits']} | {r['kv_view']} | {r['rel_error']:.2e} | "
                  f"{'yes' if r['ok'] else 'NO'} |" for r in s["kernel"]["rows"]]
    if "bandwidth" in s:
        b = s["bandwidth"]
        lines += ["", f"## Kernel time vs KV-read floor (copy bandwidth {b['copy_gbps']:.0f} GB/s)", "",
                  "| dtype | L | N | kernel ms | floor ms | floor / kernel |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['dtype']} | {r['prefix']} | {r['tree']} | {r['kernel_ms']:.4f} | {r['floor_ms']:.4f} | "
                  f"{r['floor_over_kernel']:.2f} |" for r in b["rows"]]
    if "verify" in s:
        lines += _verify_md(s["verify"])
    if "e2e" in s:
        lines += _e2e_md(s["e2e"])
    if EAGLE3 in s:
        lines += _eagle3_md(s[EAGLE3])
    return "\n".join(lines) + "\n"


def _verify_md(v: dict[str, Any]) -> list[str]:
    lines = ["", f"## verify(N) / verify(1), {v['model']['parameters'] / 1e9:.2f}B-parameter random Llama-3-8B-shaped "
              f"model, {v['model']['dtype']}, context {v['model']['context']}", "",
              "| N | chain ms | chain ratio | tree ms | tree ratio |", "|---|---|---|---|---|"]
    if "ran" in v["model"]:
        ran = v["model"]["ran"]
        lines[2:2] = [f"Ran in {ran['dtype']}, {_ran_md(ran)}", ""]
    by = {(r["mask"], r["size"]): r for r in v["rows"]}
    for n in sorted({r["size"] for r in v["rows"]}):
        c, t = by[("chain", n)], by[("tree", n)]
        lines.append(f"| {n} | {c['median_ms']:.3f} | {c['ratio']:.3f} | {t['median_ms']:.3f} | {t['ratio']:.3f} |")
    return lines


def _e2e_md(e: dict[str, Any]) -> list[str]:
    lines = ["", f"## End to end: {e['drafter']} vs plain decoding ({e['dtype']}), speedup {e['speedup']:.2f}x, "
              f"greedy identical: {'yes' if e['identical'] else 'NO'}", ""]
    if "kv_dtype" in e:
        lines += [f"Weights {e['dtype']} (asked: {e['requested_dtype']}), {_ran_md(e)}", ""]
    if "warmup_seconds" in e:
        lines += [f"Timed after an untimed pass over every prompt by both decoders ({e['warmup_seconds']:.0f} s).", ""]
    lines += ["| prompt | tokens | plain tok/s | speculative tok/s | speedup | tau | identical |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['prompt']} | {r['tokens']} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | "
              f"{r['speedup']:.2f} | {r['tau']:.2f} | {_identical(r)} |" for r in e["rows"]]
    return lines


def _eagle3_md(e: dict[str, Any]) -> list[str]:
    head = e["head"] + (f", asked for {e['head_asked']}" if e.get("head_asked") else "")
    lines = ["", f"## End to end, EAGLE-3: head {e['head']} vs plain decoding ({e['dtype']}), greedy identical: "
             f"{'yes' if e['identical'] else 'NO'}", "",
             f"Head {head}; weights {e['head_weights']} sha256 {e['head_sha256']}; feature layers "
             f"{e['feature_layers']}.", ""]
    if e["head"].startswith("random"):
        lines += ["Random weights: tau and speedup measure the drafting machinery, not a trained head.", ""]
    elif e.get("head_training"):
        t = e["head_training"]
        lines += [f"Trained: {t.get('steps')} steps, {t.get('labels')} labels, target {t.get('target')}.", ""]
    lines += [f"Weights {e['dtype']} (asked: {e['requested_dtype']}), {_ran_md(e)}", "",
              f"Timed after an untimed pass over every prompt by every decoder ({e['warmup_seconds']:.0f} s).", "",
              "| tree | tokens | plain tok/s | speculative tok/s | speedup | tau | accepted length >= d | identical |",
              "|---|---|---|---|---|---|---|---|"]
    for r in e["rows"]:
        differ = [f"{p['prompt']} from token {p['first_difference']}" for p in r["prompts"] if not p["identical"]]
        reach = ", ".join(f"{x:.2f}" for x in r["acceptance_by_depth"])
        lines.append(f"| {r['tree']} | {r['tokens']} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | "
                     f"{r['speedup']:.2f} | {_fmt(r['tau'])} | {reach} | "
                     f"{'yes' if r['identical'] else 'NO (' + '; '.join(differ) + ')'} |")
    x = e["sampled"]
    lines += ["", f"Sampled (tree {x['tree']}, temperature {x['temperature']}, seed {x['seed']}, {x['prompt']}): " +
              (f"{x['tokens']} tokens, tau {_fmt(x['tau'])}, {x['verification']}." if x["error"] is None
               else f"FAILED: {x['error']}")]
    return lines


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ran_md(ran: dict[str, Any]) -> str:
    return f"attention and KV cache {ran['kv_dtype']}, batch-invariant: {'yes' if ran['batch_invariant'] else 'no'}."


def _identical(row: dict[str, Any]) -> str:
    if row["identical"]:
        return "yes"
    first = row.get("first_difference")
    return "NO" if first is None else f"NO (from token {first})"


def write_report(report: dict[str, Any], out: Path) -> Path:
    """gpu_check.json, gpu_check.md and, when the report has a verify or bandwidth section, gpu_check.png."""
    from perf.plots import gpu_check_plot

    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (out / "gpu_check.md").write_text(markdown(report), encoding="utf-8")
    if {"verify", "bandwidth"} & set(report["sections"]):
        gpu_check_plot(report, out / "gpu_check.png")
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    defaults = GpuCheckConfig()
    p = argparse.ArgumentParser(prog="python -m perf gpu-check", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=defaults.out, help="output directory; {date} and {machine} are filled in")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: checks shapes and files only")
    p.add_argument("--smollm2", type=Path, default=defaults.smollm2, help="the SmolLM2 checkpoint directory")
    p.add_argument("--smollm2-config", type=Path, default=defaults.smollm2_config,
                   help="builder YAML naming the drafter, its weights and tree")
    p.add_argument("--e2e-draft", default=defaults.e2e_draft, help="override the drafter of the e2e section")
    p.add_argument("--e2e-dtype", default=defaults.e2e_dtype,
                   help="dtype of the e2e and eagle3 sections' model (default: the config's build dtype)")
    p.add_argument("--merge", nargs="+", type=Path, metavar="DIR",
                   help="measure nothing: merge the gpu_check.json of runs of disjoint sections into --out")
    p.add_argument("--prompts", type=Path, default=defaults.prompts,
                   help="JSON Lines prompt file of the e2e and eagle3 sections")
    p.add_argument("--eagle3-head", type=Path, default=defaults.eagle3_head, metavar="DIR",
                   help="EAGLE-3 head of the eagle3 section (published layout); when absent, seeded random weights")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--sections", default=",".join(defaults.sections),
                   help=f"comma-separated subset of {','.join(SECTION_NAMES)}")
    ns = p.parse_args(argv)
    if ns.merge:
        try:
            report = merge_reports([read_json_object(d / "gpu_check.json", ConfigError) for d in ns.merge])
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        out = write_report(report, Path(ns.out))
        print(f"merged {len(ns.merge)} runs into {out}/gpu_check.json ({'ok' if report['ok'] else 'FAILED'})")
        return 0 if report["ok"] else 1
    try:
        config = GpuCheckConfig(out=ns.out, dry_run=ns.dry_run, smollm2=ns.smollm2, smollm2_config=ns.smollm2_config,
                                e2e_draft=ns.e2e_draft, e2e_dtype=ns.e2e_dtype, eagle3_head=ns.eagle3_head,
                                prompts=ns.prompts, seed=ns.seed,
                                sections=tuple(x.strip() for x in ns.sections.split(",") if x.strip()),
                                shapes=Shapes.tiny() if ns.dry_run else Shapes.full())
        report = run_gpu_check(config, log=lambda s: print(s, file=sys.stderr, flush=True))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = write_report(report, expand_out(config.out, report["machine"]))
    print(f"wrote {out}/gpu_check.json, gpu_check.md ({report['seconds']:.0f} s; "
          f"{'ok' if report['ok'] else 'FAILED'})")
    return 0 if report["ok"] else 1


__all__ = ["GpuCheckConfig", "Shapes", "markdown", "merge_reports", "run_gpu_check", "write_report"]
