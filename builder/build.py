"""`build_engine(config)`: one checked config -> a self-contained engine directory (format: runtime/engine.py).

Everything is written into a fresh temporary directory next to the output and renamed into place at the end, so
an interrupted or failing build never leaves a partial directory where a good one was (with --force the old
engine is moved aside, the new one renamed in, and only then the old one deleted). A build that was killed (SIGKILL,
power loss) cannot clean up after itself: the next build of the same output removes what it left (the temporary
siblings whose process is gone; a moved-aside old engine only once a new one is in place).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from builder import trtllm
from builder.config import BuildConfig, BuildError, BuildPlan
from builder.drafters import builder_kind
from builder.plan import make_drafter, plan_build
from builder.progress import NullProgress, Progress
from runtime.checkpoint import load_checkpoint
from runtime.draft_spec import FIELD_NAMES
from runtime.engine import (
    BUILD_SCRIPT,
    DRAFT_DIR,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    ONNX_FILE,
    PLAN_FILE,
    TARGET_FILE,
    TRTLLM_DIR,
    is_engine_dir,
    iter_files,
    model_config_dict,
    open_engine,
    sha256_file,
)
from runtime.drafters.datastore import DATASTORE_FILE
from runtime.files import remove_stale_work_dirs, work_dir

TOOL = "spectree-builder"
MODEL_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "merges.txt", "chat_template.jinja",
)


BUILDING, REPLACED = "building", "replaced"  # the work_dir tags: the engine being built, the one it replaces


@dataclass(frozen=True)
class StageRecord:
    name: str
    status: str  # "done" | "skipped"
    detail: str  # what it produced, or why it was skipped
    seconds: float


@dataclass(frozen=True)
class BuildResult:
    output: Path
    manifest: dict[str, Any]
    stages: tuple[StageRecord, ...]

    @property
    def skipped(self) -> tuple[StageRecord, ...]:
        return tuple(s for s in self.stages if s.status == "skipped")


DISTRIBUTION = "spectree-llm"  # pyproject.toml's [project] name ("spectree" on the package index is another project)


def tool_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown"


def build_engine(config: BuildConfig, force: bool = False, progress: Progress | None = None) -> BuildResult:
    """Build the engine directory `config.build.output`; see the module docstring for the guarantees."""
    progress = progress or NullProgress()
    stages: list[StageRecord] = []
    t_start = time.perf_counter()

    def record(name: str, status: str, detail: str, t0: float) -> None:
        stages.append(StageRecord(name, status, detail, time.perf_counter() - t0))

    t0 = time.perf_counter()
    with progress.stage("validate config against checkpoints"):
        plan = plan_build(config)
    record("validate", "done", f"{plan.model.architecture}, {plan.draft.kind}, {plan.dtype} "
           f"({plan.dtype_choice.reason}), tp {config.build.tp_size}", t0)
    output = plan.output
    _check_output(output, force)
    output.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_work_dirs(output, BUILDING)
    if output.exists():
        remove_stale_work_dirs(output, REPLACED)
    tmp = work_dir(output, BUILDING)
    tmp.mkdir()
    try:
        manifest = _build_into(tmp, plan, progress, record)
        _install(tmp, output, force)
    except BaseException:  # KeyboardInterrupt included: the partial directory must go either way
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = time.perf_counter() - t_start
    stages.append(StageRecord("total", "done", str(output), total))
    return BuildResult(output=output, manifest=manifest, stages=tuple(stages))


def _check_output(output: Path, force: bool) -> None:
    if not output.exists():
        return
    if not force:
        raise BuildError(f"output {output} already exists; pass --force to replace it")
    if not output.is_dir() or (not is_engine_dir(output) and any(output.iterdir())):
        raise BuildError(f"refusing to replace {output}: it is not an engine directory (no {MANIFEST}) and not empty")


def _install(tmp: Path, output: Path, force: bool) -> None:
    if not output.exists():
        os.rename(tmp, output)
        return
    _check_output(output, force)
    backup = work_dir(output, REPLACED)
    os.rename(output, backup)
    try:
        os.rename(tmp, output)
    except BaseException:
        os.rename(backup, output)
        raise
    shutil.rmtree(backup, ignore_errors=True)


def _build_into(tmp: Path, plan: BuildPlan, progress: Progress, record) -> dict[str, Any]:
    config = plan.config
    src = config.model.checkpoint

    t0 = time.perf_counter()
    with progress.stage("load target checkpoint"):
        model_config, tensors = load_checkpoint(src, dtype=plan.dtype, runs_here=False)
        from runtime.model import TargetModel

        model = TargetModel.from_state(model_config, tensors, source=str(src))
        drafter = make_drafter(config, model, config.source)
    record("load", "done", f"{sum(t.numel() for t in tensors.values()):,} target parameters", t0)

    t0 = time.perf_counter()
    with progress.stage("copy configs and tokenizer"):
        copied = [name for name in MODEL_FILES + TOKENIZER_FILES if (src / name).is_file()]
        for name in copied:
            shutil.copyfile(src / name, tmp / name)
    record("tokenizer", "done", ", ".join(copied), t0)

    t0 = time.perf_counter()
    tp = config.build.tp_size
    with progress.stage("TensorRT-LLM checkpoint", total=tp, unit="rank") as advance:
        trt_tensors, layout = trtllm.checkpoint_tensors(plan, tensors, drafter)
        ckpt_config = trtllm.checkpoint_config(plan, drafter)
        trtllm.write_checkpoint(tmp, ckpt_config, trt_tensors, layout, tp, on_rank=lambda r: advance(1))
        del trt_tensors
    dtype_note = trtllm.dtype_note(plan.dtype)
    progress.note(dtype_note)
    record("trtllm", "done", f"{ckpt_config['architecture']}, {tp} rank file(s); {dtype_note}", t0)
    if trtllm.trtllm_dtype(plan.dtype) != plan.dtype:
        # The runtime keeps its own dtype: its weights go beside the TensorRT-LLM checkpoint (runtime/engine.py).
        t0 = time.perf_counter()
        with progress.stage(f"runtime weights ({plan.dtype})"):
            from safetensors.torch import save_file

            (tmp / TARGET_FILE).parent.mkdir()
            save_file({n: t.contiguous().clone() for n, t in tensors.items()}, str(tmp / TARGET_FILE),
                      metadata={"format": "pt"})
        record("target", "done", f"{TARGET_FILE} ({plan.dtype})", t0)

    draft_path = None
    if plan.draft.drafter_kind.weighted:
        t0 = time.perf_counter()
        with progress.stage("draft weights"):
            draft_path = _write_draft(tmp / DRAFT_DIR, plan, drafter)
        record("draft", "done", f"{DRAFT_DIR}/ ({plan.draft.kind})", t0)

    t0 = time.perf_counter()
    deploy = builder_kind(plan.draft.kind).deploy_files(plan, drafter)
    for rel, text in deploy.items():  # what serves the drafter on other engines (its kind's)
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(text, encoding="utf-8")
    if deploy:
        record("deploy", "done", ", ".join(sorted(deploy)), t0)

    onnx_record = _onnx_stage(tmp, plan, model, progress, record)
    trt_record = _tensorrt_stage(tmp, plan, onnx_record, progress, record)

    header = f"Generated by {TOOL} {tool_version()} from {config.source} ({_now()})."
    (tmp / BUILD_SCRIPT).write_text(trtllm.build_script(plan, header), encoding="utf-8")

    rel_files = list(iter_files(tmp))
    for rel in rel_files:  # readable by a server running as another user (safetensors writes 0600)
        (tmp / rel).chmod(0o755 if rel == BUILD_SCRIPT or str(rel).endswith(".sh") else 0o644)
    total_bytes = sum((tmp / f).stat().st_size for f in rel_files)
    t0 = time.perf_counter()
    files: dict[str, dict[str, Any]] = {}
    with progress.stage("checksums", total=total_bytes, unit="bytes") as advance:
        for rel in rel_files:
            files[rel] = {"size": (tmp / rel).stat().st_size, "sha256": sha256_file(tmp / rel, advance)}
    record("checksums", "done", f"{len(files)} files, {total_bytes:,} bytes", t0)

    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model": model_config_dict(plan.model),
        "dtype": plan.dtype,
        # what the config asked for ("auto": the runtime chooses again for the machine that loads the engine)
        "dtype_requested": plan.dtype_choice.requested,
        "dtype_reason": plan.dtype_choice.reason,
        "draft": _draft_section(plan, drafter, draft_path),
        "limits": {
            "max_seq_len": plan.max_seq_len,
            "max_draft_len": config.build.max_draft_len,
            "max_batch_size": config.build.max_batch_size,
            "tp_size": tp,
        },
        "trtllm": {
            "version": trtllm.TRTLLM_VERSION,
            "checkpoint": TRTLLM_DIR,
            "architecture": ckpt_config["architecture"],
            "dtype": ckpt_config["dtype"],
            "dtype_note": dtype_note,
            "tp_size": tp,
            "build_script": BUILD_SCRIPT,
            "build_command": ["trtllm-build", *trtllm.build_args(plan)],
            "run_args": trtllm.run_args(plan),
            "run_launcher": trtllm.run_launcher(plan).strip(),
            "engine_dir": trtllm.TRTLLM_ENGINE_DIR,
            "choices": None if plan.draft.static_tree is None else trtllm.choices_string(plan.draft.static_tree),
        },
        "onnx": onnx_record,
        "tensorrt": trt_record,
        "tokenizer": [f for f in copied if f in TOKENIZER_FILES],
        "provenance": {
            "tool": TOOL,
            "version": tool_version(),
            "config_hash": config.config_hash(),
            "config": config.to_dict(),
            "config_file": config.source,
            "built_at": _now(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "files": files,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    open_engine(tmp)  # the manifest must parse back before the directory goes live
    return manifest


def _write_draft(out: Path, plan: BuildPlan, drafter: Any) -> str:
    """draft/: the drafter's config.json and weights in their public format (the runtime's own loaders read it back),
    and the head directory's datastore of the target's answers when it has one."""
    out.mkdir(parents=True)
    src = plan.config.draft.checkpoint
    shutil.copyfile(src / "config.json", out / "config.json")
    builder_kind(plan.draft.kind).write_weights(out, drafter)
    if (src / DATASTORE_FILE).is_file():
        shutil.copyfile(src / DATASTORE_FILE, out / DATASTORE_FILE)
    return DRAFT_DIR


def _draft_section(plan: BuildPlan, drafter: Any, draft_path: str | None) -> dict[str, Any]:
    """engine.json "draft": the plan's DraftSpec record (its weights at `draft_path` in the engine) plus the heads'
    shapes under "config"."""
    d = dataclasses.replace(plan.draft, path=draft_path, max_draft_len=None).to_dict()  # "limits" holds the max
    kind, path = FIELD_NAMES["kind"].record, FIELD_NAMES["path"].record
    return {kind: d.pop(kind), path: d.pop(path), "config": builder_kind(plan.draft.kind).draft_config(drafter), **d}


def _onnx_stage(tmp: Path, plan: BuildPlan, model: Any, progress: Progress, record) -> dict[str, Any]:
    t0 = time.perf_counter()
    if not plan.config.build.onnx:
        record("onnx", "skipped", "build.onnx is false", t0)
        return {"status": "skipped", "reason": "build.onnx is false in the config"}
    import warnings

    from builder.onnx_stage import export_verify_step
    from plugins.tree_attention.spec import (
        PLUGIN_NAME,
        PLUGIN_NAMESPACE,
        PLUGIN_VERSION,
    )

    with progress.stage("ONNX export + checks (verification step)"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation chatter; real failures raise
        result = export_verify_step(model, tmp / ONNX_FILE)
    record("onnx", "done", f"{ONNX_FILE}, {result.plugin_nodes} plugin nodes", t0)
    return {
        "status": "built",
        "path": ONNX_FILE,
        "external_data": [p.name for p in result.files[1:]],
        "plugin": {"op_type": PLUGIN_NAME, "namespace": PLUGIN_NAMESPACE, "version": PLUGIN_VERSION,
                   "nodes": result.plugin_nodes},
        "inputs": result.inputs,
        "outputs": result.outputs,
    }


def _tensorrt_stage(tmp: Path, plan: BuildPlan, onnx_record: dict[str, Any], progress: Progress, record):
    t0 = time.perf_counter()
    if not plan.config.build.tensorrt:
        reason = "build.tensorrt is false in the config"
    elif onnx_record["status"] != "built":
        reason = "no model.onnx to build from (the ONNX stage was skipped)"
    else:
        from builder.tensorrt_stage import build_plan, unavailable_reason

        reason = unavailable_reason()
        if reason is None:
            with progress.stage("TensorRT engine"):
                result = build_plan(tmp / ONNX_FILE, tmp / PLAN_FILE, plan)
            if result.built:
                record("tensorrt", "done", f"{PLAN_FILE} ({result.reason})", t0)
                return {"status": "built", "path": PLAN_FILE, "reason": result.reason, "profile": result.profile}
            reason = result.reason
        progress.note(f"[yellow]skipped[/yellow] TensorRT engine: {reason}")
    record("tensorrt", "skipped", reason, t0)
    return {"status": "skipped", "reason": reason}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


__all__ = ["build_engine", "BuildResult", "BuildError", "StageRecord", "tool_version"]
