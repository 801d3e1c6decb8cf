"""The demo's prompt sets keep their promises: no head-training prompt is a benchmark or calibration prompt, the
generated parts of train.jsonl are exactly what their generators write (no hand edits), and no generated prompt
touches a held-out topic."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "demo" / "smollm2" / "prompts"


@pytest.fixture(autouse=True)
def _generators_importable(monkeypatch):
    # the generators are scripts that import each other as siblings (`import broad`), as when run by path
    monkeypatch.syspath_prepend(str(PROMPTS))


def _load(name: str):
    return importlib.import_module(name)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_training_prompts_exclude_every_evaluation_prompt():
    train = {r["prompt"] for r in _records(PROMPTS / "train.jsonl")}
    evaluation = [PROMPTS / "calibration.jsonl", PROMPTS / "head-selection.jsonl", *sorted((ROOT / "perf" / "prompts").glob("*.jsonl"))]
    for path in evaluation:
        leaked = [r["id"] for r in _records(path) if r["prompt"] in train]
        assert not leaked, f"{path.name}: {leaked} are also head-training prompts"


@pytest.mark.parametrize("part", ["broad", "wide", "prose", "fresh"])
def test_generated_parts_are_what_their_generators_write(part):
    records = _records(PROMPTS / "train.jsonl")
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids))
    ours = [r for r in records if r["id"].startswith(f"{part}-")]
    module = _load(part)
    broad = _load("broad")
    earlier = broad.earlier_prompts(f"{part}-")
    assert earlier == {r["prompt"] for r in records[:ids.index(ours[0]["id"])]}  # the parts are in PARTS' order
    if part == "broad":
        want = module.broad_prompts()
    elif part == "wide":
        want, _ = module.wide_prompts(earlier)
    else:
        want = getattr(module, f"{part}_prompts")(earlier)
    assert [r["prompt"] for r in ours] == want
    assert [r["id"] for r in ours] == [f"{part}-{i:04d}" for i in range(len(want))]
    touching = [p for p in want if any(w in p.lower() for w in broad.EXCLUDED)]
    assert not touching


def test_fresh_subjects_stay_off_the_head_selection_prompts():
    """The head-selection prompts choose between heads on subjects no training prompt names: every one of them holds
    a word of fresh.SELECTION_EXCLUDED (so the list covers them), and no fresh prompt holds one (negative control:
    the selection prompts themselves would be refused)."""
    fresh = _load("fresh")
    selection = [r["prompt"] for r in _records(PROMPTS / "head-selection.jsonl")]
    uncovered = [p for p in selection if not any(w in p.lower() for w in fresh.SELECTION_EXCLUDED)]
    assert not uncovered
    train = [r["prompt"] for r in _records(PROMPTS / "train.jsonl") if r["id"].startswith(fresh.PREFIX)]
    assert train and not [p for p in train if fresh.touches_held_out(p)]
    assert all(fresh.touches_held_out(p) for p in selection)


def test_self_written_requests_keep_the_rules_they_were_kept_by():
    """The magpie-* part was sampled from the target (regenerating it takes the model and minutes, so the test checks
    the committed lines instead): each line passes magpie.keep against everything before it (length, no repeat of any
    earlier prompt or held-out prompt, no held-out subject's word), in PARTS' order (negative controls: keep refuses a
    head-selection prompt, a repeat in other case, and a request too short)."""
    magpie = _load("magpie")
    broad = _load("broad")
    records = _records(PROMPTS / "train.jsonl")
    ids = [r["id"] for r in records]
    ours = [r for r in records if r["id"].startswith(magpie.PREFIX)]
    assert len(ours) >= 1000
    assert [r["id"] for r in ours] == [f"{magpie.PREFIX}{i:04d}" for i in range(len(ours))]
    assert broad.earlier_prompts(magpie.PREFIX) == {r["prompt"] for r in records[:ids.index(ours[0]["id"])]}
    seen = magpie.taken()
    for r in ours:
        assert magpie.keep(r["prompt"], seen), r["id"]
        seen.add(r["prompt"].lower())
    selection = _records(PROMPTS / "head-selection.jsonl")[0]["prompt"]
    assert not magpie.keep(selection, set())
    assert not magpie.keep(ours[0]["prompt"].upper(), seen)
    assert not magpie.keep("Tell me a joke.", set())
