"""TensorBoard event files without TensorFlow: scalars and text, written by the host loop.

`tensorboard` ships the event-file writer and the protos; TensorFlow is not
needed (and not a dependency). `tensorboard --logdir WORKDIR/tb` reads them.
"""

from __future__ import annotations

import pathlib
import time
from typing import Mapping


class SummaryWriter:
    """Appends scalar and text summaries to an event file under `logdir`."""

    def __init__(self, logdir):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.logdir = pathlib.Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(self.logdir))

    def _write(self, summary, step: int) -> None:
        from tensorboard.compat.proto import event_pb2

        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """One scalar per tag; None values are left out (NaN is written as is: TensorBoard shows it)."""
        from tensorboard.compat.proto import summary_pb2

        items = [summary_pb2.Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()
                 if v is not None]
        self._write(summary_pb2.Summary(value=items), step)

    def text(self, step: int, tag: str, markdown: str) -> None:
        from tensorboard.plugins.text import summary as text_summary

        self._write(text_summary.text_pb(tag, markdown), step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def read_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from the event files under `logdir` (for tests and notebooks)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
