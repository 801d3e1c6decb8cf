"""Progress reporting for the build's stages: a silent reporter for library use, a `rich` one for the CLI.

    with progress.stage("trtllm checkpoint", total=tp_size, unit="rank") as advance:
        ...; advance(1)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

Advance = Callable[[int], None]


class Progress(Protocol):
    def stage(self, name: str, total: int | None = None, unit: str = "") -> AbstractContextManager[Advance]: ...

    def note(self, message: str) -> None: ...


class NullProgress:
    """Reports nothing (library calls, tests)."""

    @contextmanager
    def stage(self, name: str, total: int | None = None, unit: str = "") -> Iterator[Advance]:
        yield lambda n: None

    def note(self, message: str) -> None:
        return None


class RichProgress:
    """One line per stage with a spinner, a bar when the stage has a total, and the elapsed time."""

    def __init__(self, console=None) -> None:
        from rich.console import Console

        self.console = console or Console(stderr=True)

    @contextmanager
    def stage(self, name: str, total: int | None = None, unit: str = "") -> Iterator[Advance]:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.progress import (
            Progress as RichBar,
        )

        counter = DownloadColumn() if unit == "bytes" else MofNCompleteColumn()
        columns = [SpinnerColumn(), TextColumn("{task.description}")]
        if total is not None:
            columns += [BarColumn(), counter]
        columns.append(TimeElapsedColumn())
        start = time.perf_counter()
        with RichBar(*columns, console=self.console, transient=True) as bar:
            task = bar.add_task(name, total=total)
            yield lambda n: bar.advance(task, n)
        self.console.print(f"[green]done[/green] {name} [dim]({time.perf_counter() - start:.1f} s)[/dim]")

    def note(self, message: str) -> None:
        self.console.print(message)


__all__ = ["Progress", "NullProgress", "RichProgress", "Advance"]
