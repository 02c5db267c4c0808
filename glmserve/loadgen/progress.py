"""A live progress bar (rich) over a run's requests: done / total, with completed, cancelled and
errors counts and the latest TTFT. Off when ``enabled`` is False (tests, piped output)."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from glmserve.loadgen.request_record import RequestRecord


class LiveProgress:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[counts]}"), TimeElapsedColumn(),
                                  disable=not enabled, transient=False)
        self._task = None
        self._counts = {"ok": 0, "cancelled": 0, "error": 0}

    def __enter__(self) -> LiveProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def section(self, label: str, total: int) -> None:
        if self._task is not None:
            self._progress.update(self._task, visible=True)
        self._counts = {"ok": 0, "cancelled": 0, "error": 0}
        self._task = self._progress.add_task(label, total=total, counts=self._text(None))

    def _text(self, last: RequestRecord | None) -> str:
        c = self._counts
        ttft = f" ttft {last.ttft_s * 1000:.0f} ms" if last is not None and last.ttft_s is not None else ""
        return f"ok {c['ok']} cancelled {c['cancelled']} errors {c['error']}{ttft}"

    def done(self, record: RequestRecord) -> None:
        self._counts[record.status] += 1
        if self._task is not None:
            self._progress.update(self._task, advance=1, counts=self._text(record))
