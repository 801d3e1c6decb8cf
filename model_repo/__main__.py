"""python -m model_repo {render,check}

    render --engine ENGINE_DIR --output REPO_DIR [--config OPTIONS.yaml] [options]
           write a Triton model repository (ensemble, preprocessing, spec_decode) for an engine directory
    check  REPO_DIR    parse every config.pbtxt of a repository back (strict) and list its models

Options are the fields of `model_repo.render.RepoOptions`: flags override the YAML file's keys; unknown flags or
keys fail. Exit status 0 on success, 2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from model_repo.render import RenderError, RepoOptions, read_repo, render
from runtime.errors import SpectreeError

_HELP = {
    "engine": "engine directory (engine.json) or Hugging Face checkpoint directory",
    "output": "repository directory to create",
    "engine_path_in_server": "the engine's path as the server sees it (e.g. a container mount)",
    "device": "spec_decode instance kind: cpu (KIND_CPU) or cuda (KIND_GPU)",
    "instances": "spec_decode instances (each loads the model)",
    "max_concurrent_requests": "generations at once per instance; more are refused with UNAVAILABLE",
    "max_tokens_limit": "largest max_tokens a request may ask for (default: the engine's context length)",
    "torch_threads": "torch intra-op threads per instance (0: torch's default, one per core)",
    "draft": "override the engine's drafter: medusa | eagle | lookup | none",
    "draft_model": "override the drafter weights directory",
    "tree": "override the static tree: preset name or JSON list of choice paths",
    "dtype": "override the weights dtype: float32 | bfloat16 | float16",
    "max_draft_len": "override the most draft nodes per step",
    "force": "replace an existing output directory",
}


def _base_type(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m model_repo", description="Render Triton model repositories.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", help="render a model repository for an engine directory")
    r.add_argument("--config", help="YAML file of RepoOptions keys (flags override it)")
    hints = typing.get_type_hints(RepoOptions)
    for f in dataclasses.fields(RepoOptions):
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


def _options(ns: argparse.Namespace) -> RepoOptions:
    data: dict[str, Any] = {}
    if ns.config:
        import yaml

        path = Path(ns.config)
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise RenderError(f"--config {path}: cannot read ({exc})") from exc
        if not isinstance(loaded, dict):
            raise RenderError(f"--config {path}: expected a mapping of option -> value, got {type(loaded).__name__}")
        data.update(loaded)
    for f in dataclasses.fields(RepoOptions):
        if hasattr(ns, f.name):
            data[f.name] = getattr(ns, f.name)
    return RepoOptions.from_mapping(data, ns.config or "command line")


def main(argv: Sequence[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    try:
        if ns.command == "render":
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
