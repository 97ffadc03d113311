"""The memory check of the long-log bench points: estimate, print, refuse when short."""

from __future__ import annotations

import sys


def available_bytes() -> int | None:
    """MemAvailable of this machine (None where /proc/meminfo is not there)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(events: int, bytes_per_event: int, what: str, force: bool) -> None:
    """Print the estimate for ``events``; exit with one line when it exceeds 80% of the
    available memory (unless ``force``)."""
    need, have = events * bytes_per_event, available_bytes()
    print(f"memory: ~{need / 2**30:.1f} GiB ({what}) estimated for {events:,} events; "
          f"available {'?' if have is None else f'{have / 2**30:.1f} GiB'}")
    if have is not None and need > have * 0.8 and not force:
        sys.exit(f"not enough memory for {events:,} events: ~{need / 2**30:.1f} GiB needed, "
                 f"{have / 2**30:.1f} GiB available; run a smaller --events or pass --force")
