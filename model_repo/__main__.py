"""python -m model_repo {render,check}

    render --engine ENGINE_DIR --output REPO_DIR [--backend python|tensorrtllm] [--config OPTIONS.yaml] [options]
           write a Triton model repository for an engine directory: python (default) serves our runtime
           (ensemble, preprocessing, spec_decode); tensorrtllm serves the built TensorRT-LLM engine with NVIDIA's
           tensorrtllm backend in the inflight_batcher_llm layout plus our verification stage
           (model_repo/tensorrtllm.py)
    check  REPO_DIR    parse every config.pbtxt of a repository back (strict) and list its models

Options are the fields of `model_repo.render.RepoOptions` (python) or `model_repo.tensorrtllm.TrtllmRepoOptions`
(tensorrtllm): flags override the YAML file's keys; unknown flags or keys, or another backend's options, fail. Exit
status 0 on success, 2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Sequence
from typing import Any

from model_repo.render import RepoOptions, read_repo, render
from model_repo.tensorrtllm import BACKENDS, TrtllmRepoOptions, render_tensorrtllm
from runtime import schema
from runtime.errors import ConfigError, SpectreeError

_HELP = {
    "engine": "engine directory (engine.json) or Hugging Face checkpoint directory",
    "output": "repository directory to create",
    "engine_path_in_server": "the engine's path as the server sees it (e.g. a container mount)",
    "device": "spec_decode instance kind: cpu (KIND_CPU) or cuda (KIND_GPU)",
    "instances": "spec_decode instances (each loads the model)",
    "max_concurrent_requests": "requests decoded together per instance (in-flight batching: one target forward per "
                               "step for all of them); more wait in the queue",
    "prefill_chunk": "prompt tokens per request per step (a long prompt joins the batch over several steps)",
    "tree_budget": "tree nodes one step verifies across an instance's batch: trees are pruned to an even share, so "
                   "speculation shrinks as the batch grows (default: none, whole trees)",
    "max_queue_size": "requests waiting (FIFO) per instance; more are refused with UNAVAILABLE (HTTP 503), "
                      "message 'overloaded: ...' (default 32)",
    "kv_memory_mb": "KV cache the running generations of an instance may reserve together; a request that can "
                    "never fit is refused (default: half the memory free once the model is loaded)",
    "max_prompt_bytes": "largest text_input / messages in bytes, checked before tokenising (default: 16 per token "
                        "of context)",
    "max_stop_words": "stop strings per request (default 16)",
    "max_stop_word_bytes": "UTF-8 bytes per stop string (default 256)",
    "skip_checksums": "do not verify the engine's files against engine.json before rendering",
    "max_tokens_limit": "largest max_tokens a request may ask for (default: the engine's context length)",
    "torch_threads": "torch intra-op threads per instance (0: torch's default, one per core)",
    "draft": "override the engine's drafter: medusa | eagle | lookup | none",
    "draft_model": "override the drafter weights directory",
    "tree": "override the static tree: preset name or JSON list of choice paths",
    "dtype": "override the weights dtype: auto | float32 | bfloat16 | float16",
    "max_draft_len": "override the most draft nodes per step",
    "force": "replace an existing output directory",
    "trtllm_engine": "tensorrtllm: the trtllm-build output directory (default ENGINE/trtllm_engine)",
    "trtllm_engine_path_in_server": "tensorrtllm: the TensorRT-LLM engine's path as the server sees it",
    "max_batch_size": "python: rows per request the ensemble takes, [batch, 1] tensors as tensorrtllm_backend's "
                      "(default 8); tensorrtllm: triton_max_batch_size (default: the engine's build.max_batch_size)",
    "max_queue_delay_microseconds": "tensorrtllm: dynamic batching queue delay",
    "kv_cache_free_gpu_mem_fraction": "tensorrtllm: GPU memory fraction for the KV cache",
}
OPTION_CLASSES = {"python": RepoOptions, "tensorrtllm": TrtllmRepoOptions}


def _base_type(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m model_repo", description="Render Triton model repositories.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", help="render a model repository for an engine directory")
    r.add_argument("--config", help="YAML file of RepoOptions keys (flags override it)")
    r.add_argument("--backend", choices=BACKENDS, default=BACKENDS[0],
                   help="python: our runtime behind Triton's python backend; tensorrtllm: the TensorRT-LLM engine "
                        "behind NVIDIA's tensorrtllm backend (untested without a GPU)")
    hints = {**typing.get_type_hints(TrtllmRepoOptions), **typing.get_type_hints(RepoOptions)}
    fields = {f.name: f for cls in OPTION_CLASSES.values() for f in dataclasses.fields(cls)}
    for f in fields.values():
        flag = "--" + f.name.replace("_", "-")
        tp = _base_type(hints[f.name])
        # default SUPPRESS: only options actually given land in the namespace, so the dataclass keeps the defaults.
        if tp is bool:
            r.add_argument(flag, dest=f.name, action="store_true", default=argparse.SUPPRESS, help=_HELP[f.name])
        else:
            r.add_argument(flag, dest=f.name, type=tp, default=argparse.SUPPRESS, help=_HELP[f.name])
    c = sub.add_parser("check", help="parse a repository's config.pbtxt files back")
    c.add_argument("repo")
    return p


def _options(ns: argparse.Namespace) -> RepoOptions | TrtllmRepoOptions:
    cls = OPTION_CLASSES[ns.backend]
    names = {f.name for f in dataclasses.fields(cls)}
    other = sorted(n for c in OPTION_CLASSES.values() for n in (f.name for f in dataclasses.fields(c))
                   if n not in names and hasattr(ns, n))
    if other:
        flags = ", ".join("--" + n.replace("_", "-") for n in other)
        raise ConfigError(f"--backend {ns.backend} does not take {flags}")
    data: dict[str, Any] = {}
    if ns.config:
        loaded, _ = schema.read_yaml(ns.config, ConfigError)
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {ns.config}: expected a mapping of option -> value, got "
                              f"{type(loaded).__name__}")
        data.update(loaded)
    for f in dataclasses.fields(cls):
        if hasattr(ns, f.name):
            data[f.name] = getattr(ns, f.name)
    return schema.load(cls, data, ConfigError, source=ns.config or "command line")


def main(argv: Sequence[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    try:
        if ns.command == "render" and ns.backend == "tensorrtllm":
            trt = render_tensorrtllm(_options(ns))
            print(f"rendered {trt.path} (models: {', '.join(trt.configs)}; TensorRT-LLM engine {trt.trtllm_engine}; "
                  "untested without a GPU and TensorRT-LLM)")
        elif ns.command == "render":
            repo = render(_options(ns))
            print(f"rendered {repo.path} (models: {', '.join(repo.configs)}; context {repo.max_context} tokens, "
                  f"max_tokens limit {repo.max_tokens_limit})")
        else:
            configs = read_repo(ns.repo)
            for name, cfg in configs.items():
                kind = cfg.platform or cfg.backend
                extra = ", decoupled" if cfg.decoupled else ""
                print(f"{name}: {kind}{extra}; inputs {', '.join(i.name for i in cfg.input)}; "
                      f"outputs {', '.join(o.name for o in cfg.output)}")
    except (SpectreeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
