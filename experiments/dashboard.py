"""The run's records as TensorBoard events in `<run>/tb` (process 0), next to metrics.jsonl.

Written with tensorboardX (a small pure-Python writer of TensorBoard's event files: protobuf and numpy, no
TensorFlow). Every numeric field of each metrics.jsonl record becomes a scalar at its step: `train/<field>` (loss,
lr, grad_norm, step_time, tokens_per_s or examples_per_s, mfu, memory_bytes where the backend reports it, the
loss's own metrics) and `val/<metric>` for the validation ones; the goodput split of the run (experiments/goodput.py)
at the end, as `goodput/<bucket>` fractions of the wall time. `tensorboard --logdir runs/` shows them.

A writer that fails (tensorboardX missing, the folder unwritable, a full disk) prints one warning and stops
writing; training goes on (metrics.jsonl is the record that counts).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


class Board:
    """TensorBoard scalars for a run (module docstring); every method is a no-op once the writer has failed."""

    def __init__(self, run_dir: Path, enabled: bool = True, say: Callable[[str], None] | None = None) -> None:
        self.dir = Path(run_dir) / "tb"
        self.say = say or (lambda text: print(text, file=sys.stderr, flush=True))
        self.writer: Any = None
        if enabled:
            self._guard(self._open)

    def _open(self) -> None:
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(self.dir), flush_secs=30)

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:  # never stops training: one warning, then no more events
            self.say(f"warning: TensorBoard events in {self.dir} stopped ({type(e).__name__}: {e}); training goes on, "
                     "metrics.jsonl has every record")  # fmt: skip
            writer, self.writer = self.writer, None
            if writer is not None:
                with contextlib.suppress(Exception):
                    writer.close()

    def record(self, rec: dict[str, Any]) -> None:
        """One metrics.jsonl record: its numeric fields at its step."""
        if self.writer is None:
            return
        step = int(rec["step"])

        def write() -> None:
            for key, value in rec.items():
                if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
                    continue
                if math.isfinite(value):
                    tag = f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"
                    self.writer.add_scalar(tag, value, step)

        self._guard(write)

    def goodput(self, summary: dict[str, Any], step: int) -> None:
        """The run's goodput (summed across attempts) and each bucket's fraction of the wall time, at `step`."""
        if self.writer is None or not summary.get("total", {}).get("wall"):
            return
        total = summary["total"]

        def write() -> None:
            self.writer.add_scalar("goodput/goodput", summary["goodput"], step)
            for bucket, seconds in total.items():
                if bucket != "wall":
                    self.writer.add_scalar(f"goodput/{bucket}", seconds / total["wall"], step)

        self._guard(write)

    def close(self) -> None:
        if self.writer is not None:
            self._guard(self.writer.close)
            self.writer = None
