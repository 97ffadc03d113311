"""The console's count of failed generations is the log's: one per ``GroupFailed``.

Seen with a generator killed under Ray: its call carried 4 groups (rollout.groups_per_call),
the log has 4 GroupFailed and retries 4 groups, and the console said "failed=1" and
named one group ("(group g000048)")."""

from __future__ import annotations

import io

from rich.console import Console

from controller.observe import Progress


def _progress() -> tuple[Progress, io.StringIO]:
    out = io.StringIO()
    return Progress(10, console=Console(file=out, soft_wrap=True), enabled=False), out


def test_a_failed_call_counts_and_names_each_of_its_groups():
    progress, out = _progress()
    progress.failure("generator-0", ["g000048", "g000049", "g000050", "g000051"],
                     "generator-0 lost: ActorDiedError: died")
    progress.failure("generator-0", ["g000052"], "generator-0 lost: ActorDiedError: died")
    progress.step(3, 4, {"reward/mean": 0.5}, 0, 4)
    lines = out.getvalue().splitlines()
    assert lines[0] == ("generation failed on generator-0 (groups g000048, g000049, g000050, "
                        "g000051): generator-0 lost: ActorDiedError: died -- counted "
                        "under 'failed' (groups) from now on")
    assert len(lines) == 2 and lines[1].endswith(" failed=5"), lines
