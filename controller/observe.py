"""Where a run reports: structlog JSON logs, per-step metrics (JSONL + TensorBoard),
and the live progress display for people.

All of it is shell: nothing here is read back by the controller (the log is the truth).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import structlog
from rich.console import Console
from rich.live import Live
from rich.table import Table


def configure_logging(log_file: Path, *, level: int = logging.INFO) -> None:
    """structlog JSON lines to ``log_file`` (people read the console display instead)."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    handle = open(log_file, "a", buffering=1)  # noqa: SIM115 - lives for the process
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.WriteLoggerFactory(file=handle),
        cache_logger_on_first_use=False,
    )


class MetricsSink:
    """Per-step metrics to ``metrics.jsonl`` and TensorBoard event files."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
            except Exception:  # TensorBoard is optional output; JSONL always works
                self._tb = None

    def write(self, step: int, trainer_version: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "trainer_version": trainer_version, "time": time.time(), **metrics}
        self._file.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, trainer_version)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


class Progress:
    """A live table for people: step, trainer_version, reward, lag, the train/inference
    mismatch (KL(generator || trainer) at the trainer's version), groups/s, buffer."""

    COLUMNS = (
        "step", "version", "reward", "lag mean/max", "mismatch kl", "groups/s", "buffer",
        "in flight", "failed",
    )

    def __init__(self, total_steps: int, *, console: Console | None = None, enabled: bool = True):
        self.total_steps = total_steps
        # soft_wrap: plain lines (piped, --no-progress) are never cut at 80 columns
        self.console = console or Console(stderr=True, soft_wrap=True)
        self.enabled = enabled and self.console.is_terminal
        self._rows: list[tuple[str, ...]] = []
        self._live: Live | None = None
        self._status = ""
        #: groups whose attempt failed so far (one GroupFailed each, the failure budget's
        #: unit; a call carries rollout.groups_per_call), and the errors printed in full
        self.failed_groups = 0
        self._causes: set[str] = set()

    def __enter__(self) -> "Progress":
        if self.enabled:
            self._live = Live(self._render(), console=self.console, refresh_per_second=4)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def status(self, text: str) -> None:
        self._status = text
        if self._live is not None:
            self._live.update(self._render())

    def step(self, step: int, version: int, m: dict[str, float], buffer: int, in_flight: int) -> None:
        row = (
            str(step),
            f"{version}/{self.total_steps}",
            f"{m.get('reward/mean', float('nan')):.3f}",
            f"{m.get('lag/mean', 0):.2f}/{m.get('lag/max', 0):.0f}",
            f"{m['mismatch_kl']:.1e}" if "mismatch_kl" in m else "-",
            f"{m.get('perf/groups_per_s', 0):.2f}",
            str(buffer),
            str(in_flight),
            str(self.failed_groups),
        )
        self._rows.append(row)
        if self._live is not None:
            self._live.update(self._render())
        else:  # not a terminal: one plain line per step
            self.console.print(" ".join(f"{c}={v}" for c, v in zip(self.COLUMNS, row)))

    def warn(self, text: str) -> None:
        """A line above the table (or among the plain lines) that a person should see."""
        self.console.print(f"warning: {text}", markup=False, highlight=False)

    def failure(self, worker: str, group_ids: list[str], cause: str) -> None:
        """A generator call failed: its groups counted (the table's ``failed``, as many as
        the log's ``GroupFailed``), and printed in full the first time its error is seen
        (a new error gets its own line), naming every group the call carried."""
        self.failed_groups += len(group_ids)
        if cause not in self._causes:
            self._causes.add(cause)
            which = f"group {group_ids[0]}" if len(group_ids) == 1 else f"groups {', '.join(group_ids)}"
            self.console.print(
                f"generation failed on {worker} ({which}): {cause} -- counted "
                "under 'failed' (groups) from now on", markup=False, highlight=False,
            )
        if self._live is not None:
            self._live.update(self._render())

    def notice(self, text: str) -> None:
        """A line above the table (or among the plain lines): something the run
        recovered from, said once, with its cause."""
        self.console.print(text, markup=False, highlight=False)

    def _render(self) -> Table:
        failed = f"  failed groups: {self.failed_groups}" if self.failed_groups else ""
        table = Table(title=f"rl-controller  {self._status}{failed}", expand=False)
        for col in self.COLUMNS:
            table.add_column(col, justify="right")
        for row in self._rows[-15:]:
            table.add_row(*row)
        return table
