"""The terminal's view of a run: a progress bar with the latest step's summary line
(`saccade.metrics.format_step`) and a sample of its completions under it."""

from __future__ import annotations


class ProgressBar:
    """A rich progress bar that shows the latest step summary, and under it an optional note
    line (a sample of the step's completions), cut to the terminal's width; a no-op when disabled.

    `with ProgressBar(True, total, "rl") as advance: advance("step 3 | reward 0.5", note="...")`."""

    def __init__(self, enabled: bool, total: int, label: str):
        self.enabled, self.total, self.label = enabled, total, label

    def __enter__(self):
        if not self.enabled:
            return lambda text, note=None: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.text import Text

        class NotedProgress(Progress):
            note = ""

            def get_renderables(self):
                yield from super().get_renderables()
                if self.note:  # one line, never wrapped: a long sample must not push the bar around
                    yield Text(self.note, no_wrap=True, overflow="ellipsis", style="dim")

        self._progress = NotedProgress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
        )
        self._progress.start()
        self._task = self._progress.add_task(self.label, total=self.total, info="")

        def advance(text: str, note: str | None = None) -> None:
            if note is not None:
                self._progress.note = note
            self._progress.update(self._task, advance=1, info=text)

        return advance

    def __exit__(self, *exc):
        if self.enabled:
            self._progress.stop()
        return False
