"""The real controller on the virtual clock: deterministic logs, real decisions."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import msgspec
import pytest

from controller.config import load_config
from controller.core.fold import fold_raw
from controller.core.turns import expanded
from controller.projector import Projector
from events.codec import encode
from events.memory_store import MemoryEventStore
from sim.clock import VirtualTimeLoop
from sim.harness import simulate, SimSpec
from sim.partial import SimPartialGenerator
from sim.timeline import timeline_of
from sim.timings import Lognormal, Pareto, RecordedTimings, SyntheticTimings
from sim.workers import Fleet
from workers.api import GenerationRequest

#: fields that depend on the machine or the wall clock, not on the simulation
WALL_CLOCK_FIELDS = ("ts", "host", "pid")


def _config_items(window: int = 1, steps: int = 6, generators: int = 8) -> list[str]:
    return [
        f"run.steps={steps}", f"rollout.num_generators={generators}", "rollout.groups_per_call=1",
        "train.groups_per_step=8", "train.groups_per_microbatch=4",
        f"staleness.window_versions={window}", "checkpoint.every_steps=3",
    ]


def _config(window: int = 1, steps: int = 6, generators: int = 8):
    return load_config(None, _config_items(window, steps, generators))


def _timings(seed: int) -> SyntheticTimings:
    return SyntheticTimings(generation=Lognormal(20.0, 0.8), train_per_sequence_s=0.05,
                            finish=1.0, publish=2.0, checkpoint=5.0, seed=seed)


def _log(store: MemoryEventStore, run_id: str) -> list[bytes]:
    """Encoded events, wall-clock fields of the two events written before the loop masked."""
    out = []
    for stored in store.read(run_id):
        raw = msgspec.json.decode(encode(stored.event))
        if stored.position <= 2:  # RunStarted, ControllerStarted: real time, host, pid
            for name in WALL_CLOCK_FIELDS:
                raw.pop(name, None)
        out.append(msgspec.json.encode(raw))
    return out


def _run(seed: int, window: int = 1, store: MemoryEventStore | None = None):
    store = store or MemoryEventStore()
    out = simulate(store, SimSpec(config=_config(window), timings=_timings(seed), run_id="sim"))
    return store, out


def test_same_seed_same_log_bytes():
    a, out_a = _run(seed=7)
    b, out_b = _run(seed=7)
    assert _log(a, "sim") == _log(b, "sim")
    assert out_a.virtual_s == out_b.virtual_s > 100  # many simulated minutes
    c, _ = _run(seed=8)
    assert _log(c, "sim") != _log(a, "sim")


def test_the_log_is_a_valid_run_of_the_real_controller():
    store, out = _run(seed=1)
    entries = [(e.position, e.data) for e in store.read_raw("sim")]
    state = fold_raw(entries)  # every invariant of the reducer holds
    assert state.trainer_version == 6 and state.finished
    assert len(state.checkpoints) == 2
    # events carry virtual time: the log spans the simulated run, not the real one
    timeline, _ = timeline_of(store, "sim")
    assert timeline.wall_s == pytest.approx(out.virtual_s, rel=0.2)
    assert timeline.groups_consumed == 48
    assert set(timeline.lags) <= {0, 1}
    # the simulated trainer's busy time is what the log says it was
    assert timeline.trainer_busy_s == pytest.approx(out.trainer_busy_s, rel=1e-6)


def test_a_wider_window_trains_faster_and_staler():
    _, sync = _run(seed=3, window=0)
    _, async1 = _run(seed=3, window=1)
    tl = {}
    for name, out in (("sync", sync), ("async", async1)):
        tl[name], _ = timeline_of(out.writer.store, "sim")
    assert tl["async"].wall_s < tl["sync"].wall_s
    assert max(tl["sync"].lags) == 0 < max(tl["async"].lags)


def test_generators_that_refit_only_between_calls_make_the_publish_wait():
    """vLLM without chunks: no group spans a refit, and each publish waits for the calls
    in flight -- the torch sampler's publish takes its own time only."""
    vllm = ("rollout.backend=vllm", "model.kind=hf", "model.path=unused")
    runs = {}
    for name, extra in (("torch", ()), ("vllm", vllm)):
        cfg = load_config(None, [*_config_items(), *extra])
        store = MemoryEventStore()
        runs[name] = (store, simulate(store, SimSpec(config=cfg, timings=_timings(5), run_id=name)))
    spans = {name: [(g.weight_version_start, g.weight_version_end)
                    for g in out.writer.state.groups.values() if g.weight_version_end is not None]
             for name, (_, out) in runs.items()}
    assert any(a != b for a, b in spans["torch"]) and all(a == b for a, b in spans["vllm"])
    published = 2.0 * (1 + 6)  # the first weights, then one publish per version
    assert runs["torch"][1].refit_s == pytest.approx(published)
    assert runs["vllm"][1].refit_s > published + 10.0


def test_pareto_has_its_median_and_its_capped_mean():
    law = Pareto(20.0, alpha=1.2, cap_s=400.0)
    assert law.scale_s * 0.5 ** (-1 / law.alpha) == pytest.approx(20.0, rel=1e-12)
    # E[min(X, cap)] = integral of P(X > x) over [0, cap]: 1 below the scale, (x_m/x)^a above
    n, xm = 200_000, law.scale_s
    h = (law.cap_s - xm) / n
    tail = sum((xm / (xm + (i + 0.5) * h)) ** law.alpha for i in range(n)) * h  # midpoint rule
    assert law.mean_s == pytest.approx(xm + tail, rel=1e-6)
    draws = [law.draw(random.Random(i)) for i in range(2000)]
    assert max(draws) == 400.0 and min(draws) >= xm


@pytest.mark.parametrize("per_call, dedupes", [(1, True), (3, True), (1, False), (3, False)])
def test_simulated_episodes_fold_clean_with_every_turn_recorded(per_call, dedupes):
    # 3-turn episodes: per turn the model segments and intent, then the results and the
    # observations (none after the last) -- in a pause of their own, or riding with the
    # next turn's intent when the env deduplicates: the core checks order, keys and that
    # each committed reward is the sum of its turns'
    cfg = load_config(None, [
        "run.steps=4", "rollout.num_generators=4", f"rollout.groups_per_call={per_call}",
        "train.groups_per_step=4", "train.groups_per_microbatch=2", "rollout.partial.enabled=true",
        "rollout.samples_per_group=2", "rollout.partial.record_linger_s=0"])
    store = MemoryEventStore()
    simulate(store, SimSpec(config=cfg, timings=_timings(3), run_id="ep", episode_turns=3,
                            episode_dedupes=dedupes))
    result = Projector(store).get("ep")
    assert result.problem is None, result.problem
    state = result.state
    committed = [g for g in state.groups.values() if g.committed_position is not None]
    assert len(committed) >= 16 and all(g.episode is not None for g in committed)
    assert all([len(r) for r in g.episode.rewards] == [3, 3] for g in committed)
    kinds = Counter(type(e).__name__ for e in _as_read(store)
                    if getattr(e, "group_id", None) == committed[0].group_id)
    assert (kinds["EnvStepsRequested"], kinds["EnvStepsCompleted"], kinds["SegmentsRecorded"]) == (3, 3, 5)
    # the events of one append share its virtual timestamp: 6 pauses, or 3 + the last results
    pauses = {e.ts for e in _as_read(store) if type(e).__name__.startswith("EnvSteps")
              and e.group_id == committed[0].group_id}
    assert len(pauses) == (4 if dedupes else 6)


def _as_read(store: MemoryEventStore) -> list:
    """Run "ep"'s events as readers see them: a pause as the events it stands for."""
    return list(expanded(e.event for e in store.read("ep")))


def _env_batches(linger_s: float) -> tuple[int, int]:
    """(env events, distinct appends holding them) of a 3-turn episode run with an env
    that cannot deduplicate (two pauses a turn): the events of one append share its
    virtual timestamp."""
    cfg = load_config(None, [
        "run.steps=4", "rollout.num_generators=4", "rollout.groups_per_call=1",
        "train.groups_per_step=4", "train.groups_per_microbatch=2", "rollout.partial.enabled=true",
        "rollout.samples_per_group=2", f"rollout.partial.record_linger_s={linger_s}",
        "rollout.partial.record_linger_siblings=0"])  # 4 generators: the linger on all the same
    store = MemoryEventStore()
    simulate(store, SimSpec(config=cfg, timings=_timings(3), run_id="ep", episode_turns=3,
                            episode_dedupes=False))
    result = Projector(store).get("ep")
    assert result.problem is None, result.problem
    env = [e for e in _as_read(store) if type(e).__name__.startswith("EnvSteps")]
    return len(env), len({e.ts for e in env})


def _episode_run_end(linger_s: float, generators: int, siblings: int = 0) -> float:
    """Virtual time at the end of a short 3-turn episode run."""
    cfg = load_config(None, [
        "run.steps=2", f"rollout.num_generators={generators}", "rollout.groups_per_call=1",
        "train.groups_per_step=2", "train.groups_per_microbatch=2", "rollout.partial.enabled=true",
        "rollout.samples_per_group=2", f"rollout.partial.record_linger_s={linger_s}",
        f"rollout.partial.record_linger_siblings={siblings}"])
    store = MemoryEventStore()
    simulate(store, SimSpec(config=cfg, timings=_timings(3), run_id="ep", episode_turns=3))
    assert Projector(store).get("ep").problem is None
    return list(store.read("ep"))[-1].event.ts


def test_a_pause_no_other_call_can_join_does_not_wait_for_the_linger():
    # one generator: every pause is the only call in flight, so the linger (here 5 s,
    # virtual) has nobody to wait for; before, each pause paid all of it
    assert _episode_run_end(5.0, generators=1) == _episode_run_end(0.0, generators=1)
    # with several generators a pause still waits for the others (the test below)
    assert _episode_run_end(5.0, generators=2) > _episode_run_end(0.0, generators=2)


def test_a_fleet_smaller_than_the_linger_siblings_does_not_linger():
    # 2 generators: one other call in flight, fewer than record_linger_siblings, so a
    # pause is appended at once and the 5 s linger costs the run nothing
    assert (_episode_run_end(5.0, generators=2, siblings=8)
            == _episode_run_end(0.0, generators=2, siblings=8))
    assert (_episode_run_end(5.0, generators=2, siblings=1)
            > _episode_run_end(0.0, generators=2, siblings=1))


def _partial_run_end(linger_s: float) -> float:
    """Virtual time at the end of a short partial-rollout run of 4 generators whose groups
    flush every 4 tokens (not only at refits: a call may end while another's flush waits)."""
    cfg = load_config(None, [
        "run.steps=3", "rollout.num_generators=4", "rollout.groups_per_call=1",
        "train.groups_per_step=2", "train.groups_per_microbatch=2", "rollout.partial.enabled=true",
        "rollout.partial.segment_tokens=4", "rollout.samples_per_group=2",
        f"rollout.partial.record_linger_s={linger_s}",
        "rollout.partial.record_linger_siblings=0"])
    store = MemoryEventStore()
    simulate(store, SimSpec(config=cfg, timings=_timings(3), run_id="pr"))
    assert Projector(store).get("pr").problem is None
    return list(store.read("pr"))[-1].event.ts


def test_a_call_that_ends_elsewhere_ends_the_linger_it_leaves_alone():
    # A flush lingers for the other calls in flight; when one of them commits (or fails)
    # instead of flushing, the calls left may all be waiting: nobody else can join. Here
    # every linger ends that way or by a join within 5 s, so a 100x longer linger changes
    # nothing; before, a flush left alone waited its linger out (204.3 s vs 222.4 s).
    assert _partial_run_end(500.0) == _partial_run_end(5.0)


def test_pauses_of_several_groups_share_one_append_within_the_linger():
    # group commit of flushes: with a linger the pauses of the 4 generators' groups that
    # come within it are recorded by one append (same virtual time), and the log still
    # folds clean; without one, each pause is its own append
    events, appends = _env_batches(0.0)
    assert appends == events
    events, appends = _env_batches(0.5)
    assert appends < events


def test_a_per_version_budget_is_what_the_real_controller_admits_by():
    """``staleness.budget_basis = "per_version"`` (verl's run-ahead) with 10 groups per
    version at 8 per step: before every admission the per-version count was under 10, and
    a finished step's groups held the budget until its publish landed, where the live
    basis would have had room."""
    from controller.core import policies, reducer
    from controller.core.state import RunState
    from events.schema import RolloutAdmitted

    cfg = load_config(None, [*_config_items(generators=16), "staleness.buffer_groups=10",
                             "staleness.budget_basis=per_version"])
    store = MemoryEventStore()
    simulate(store, SimSpec(config=cfg, timings=_timings(3), run_id="sim"))
    state, counts, held = RunState(), [], 0
    for stored in store.read("sim"):
        if type(stored.event) is RolloutAdmitted:
            counts.append(policies.budget_count(state, "per_version"))
        state = reducer.apply(state, stored)
        held += policies.live_groups(state) < 10 <= policies.budget_count(state, "per_version")
    assert state.trainer_version == 6 and state.finished
    assert max(counts) == 9 and held > 0

    # the replay's gate trace reads the recorded basis: it agrees with the gate throughout
    from replay import staleness

    trace, disagreements = staleness.Trace(), []

    class Judge:
        def watches(self):
            def check(event, position, state):
                gate = policies.admission(state, dispatch_version=state.weight_version,
                                          window=1, groups_per_step=8, capacity=10,
                                          basis="per_version")
                if bool(trace.gate_closed[-1]) == gate.allowed:
                    disagreements.append(position)
            return {cls: check for cls in trace.watches()}

    result = Projector(store).get("sim", observers=[trace, Judge()])
    assert result.problem is None
    assert any(trace.gate_closed) and disagreements == []
    # and the report says what its capacity counted
    method = staleness.analyze(result.state, trace).gate_method
    assert method.startswith("gate closed while live groups + groups trained since the last "
                             "publish >= capacity or ")


class _BatchesStore(MemoryEventStore):
    """The in-memory store, noting each append's event types and groups."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[tuple[str, str]]] = []

    def append(self, run_id, events, **kwargs):  # type: ignore[no-untyped-def]
        self.batches.append([(type(e).__name__, getattr(e, "group_id", "")) for e in expanded(events)])
        return super().append(run_id, events, **kwargs)


def test_a_finished_group_commits_with_the_pauses_that_follow_within_the_linger():
    # a group's last call ends right after its last pause is recorded; its commit waits
    # for the linger (here 3 s of ~7 s turns) with the fleet's next pauses instead of
    # taking an append of its own (one group per call: before, a commit never shared one)
    cfg = load_config(None, [
        "run.steps=4", "rollout.num_generators=4", "rollout.groups_per_call=1",
        "train.groups_per_step=4", "train.groups_per_microbatch=2", "rollout.partial.enabled=true",
        "rollout.samples_per_group=2", "rollout.partial.record_linger_s=3.0",
        "rollout.partial.record_linger_siblings=0"])
    store = _BatchesStore()
    simulate(store, SimSpec(config=cfg, timings=_timings(3), run_id="ep", episode_turns=3))
    assert Projector(store).get("ep").problem is None
    mixed = [b for b in store.batches if any(t == "GroupCommitted" for t, _ in b)
             and any(t.startswith("EnvSteps") and g not in {g for t, g in b if t == "GroupCommitted"}
                     for t, g in b)]
    assert len(mixed) >= 3, store.batches


def _refit_run(flush_on_refit: bool):
    """A partial-rollout run whose groups outlive refits: 16-token windows, 64-token groups."""
    cfg = load_config(None, [
        "run.steps=6", "rollout.num_generators=4", "rollout.groups_per_call=1",
        "train.groups_per_step=2", "train.groups_per_microbatch=2", "rollout.partial.enabled=true",
        "rollout.partial.segment_tokens=16", "rollout.samples_per_group=2",
        f"rollout.partial.flush_on_refit={str(flush_on_refit).lower()}"])
    store = MemoryEventStore()
    timings = SyntheticTimings(generation=Lognormal(20.0, 0.8), train_per_sequence_s=0.05,
                               finish=1.0, publish=2.0, checkpoint=5.0, seed=5,
                               tokens_per_sample=64, lengths_follow_time=True)
    simulate(store, SimSpec(config=cfg, timings=timings, run_id="rf"))
    assert Projector(store).get("rf").problem is None  # folds clean, every rule held
    return [s.event for s in store.read("rf")]


def test_a_refit_closes_a_segment_without_a_flush_and_the_commit_gives_its_versions():
    deferred, eager = _refit_run(False), _refit_run(True)
    kinds = Counter(type(e).__name__ for e in deferred)
    eager_kinds = Counter(type(e).__name__ for e in eager)
    assert kinds["GroupCommitted"] == eager_kinds["GroupCommitted"]
    assert 0 < kinds["SegmentsRecorded"] < eager_kinds["SegmentsRecorded"]
    commits = [e for e in deferred if type(e).__name__ == "GroupCommitted"]
    spanning = [c for c in commits if c.weight_version_start != c.weight_version_end]
    assert spanning and all(c.version_runs for c in spanning)
    assert not any(c.version_runs for c in commits if c not in spanning)
    # every flush holds one version, and a commit's runs agree with what was flushed
    for c in spanning:
        for n, runs in zip(c.lengths, c.version_runs):
            assert sum(runs[1::2]) == n and runs[0::2] == sorted(set(runs[0::2]))


def _one_group(refits: list[float], *, lengths: list[int], seconds: float, segment_tokens: int,
               paused_refits: int = 0, flush_on_refit: bool = False):
    """One group alone on a deferred-refit simulated generator, ``seconds`` over its
    longest length (1 s a token below); the fleet's version moves at each of ``refits``
    (virtual seconds), and ``paused_refits`` more times while the group waits at its
    first flush. Returns (virtual time of each outcome, outcome)."""
    loop = VirtualTimeLoop()
    timings = RecordedTimings(generation={"g": seconds}, rewards={"g": [0.0] * len(lengths)},
                              lengths={"g": lengths}, microbatches={}, finish={}, publish={},
                              checkpoint={})
    fleet = Fleet(loop=loop, timings=timings)
    gen = SimPartialGenerator("gen", fleet, segment_tokens, flush_on_refit)
    req = GenerationRequest(group_id="g", attempt=1, prompt_index=0, n_samples=len(lengths), seed=0)

    def move() -> None:
        fleet.weight_version += 1
        for notify in list(fleet.on_refit):
            notify()

    async def publisher() -> None:
        for at in refits:
            await asyncio.sleep(at - loop.time())
            move()

    async def controller() -> list:
        outs = []
        while not outs or outs[-1][1].status != "done":
            out = (await gen.generate([req]))[0]
            outs.append((loop.time(), out))
            if len(outs) == 1 and outs[0][1].status == "flushed":
                for _ in range(paused_refits):
                    move()
        return outs

    async def main() -> list:
        return (await asyncio.gather(controller(), publisher()))[0]

    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def test_a_refit_mid_token_costs_the_group_no_virtual_time():
    # 10 tokens at 1 s; the refit at 2.5 s lands inside token 3, which the new weights
    # finish: the group ends at 10 s, as without a refit (it was re-timed from token 2: 10.5)
    (t, out), = _one_group([2.5], lengths=[10, 4], seconds=10.0, segment_tokens=100)
    assert t == 10.0
    assert out.version_runs == [[0, 2, 1, 8], [0, 2, 1, 2]]
    # and a window full at 4 tokens is still reached at 4 s, split at the refit
    outs = _one_group([2.5], lengths=[10, 4], seconds=10.0, segment_tokens=4)
    assert [t for t, _ in outs] == [4.0, 6.0, 10.0]
    assert [(o.flush.weight_version, [(s.start, s.length) for s in o.flush.segments])
            for _, o in outs[:2]] == [(0, [(0, 2), (0, 2)]), (1, [(2, 4), (2, 2)])]


def test_a_commits_versions_are_its_tokens_not_the_admission_s():
    # the refit lands during the first token: every token is v1, so is the oldest
    (_, out), = _one_group([0.5], lengths=[10, 4], seconds=10.0, segment_tokens=100)
    assert (out.weight_version_start, out.weight_version_end) == (1, 1)
    assert out.version_runs == [[1, 10], [1, 4]]


@pytest.mark.parametrize("flush_on_refit", [False, True])
def test_a_refit_while_the_group_waits_at_its_flush_applies_to_its_next_tokens(flush_on_refit):
    # flushed at 4 tokens, two refits land before the controller calls again: the
    # tokens after the flush are v2's (they were counted at v0 before)
    outs = _one_group([], lengths=[10, 6], seconds=10.0, segment_tokens=4, paused_refits=2,
                      flush_on_refit=flush_on_refit)
    assert [o.status for _, o in outs] == ["flushed", "flushed", "done"]
    assert outs[1][1].flush.weight_version == 2
    done = outs[-1][1]
    assert (done.weight_version_start, done.weight_version_end) == (0, 2)
    assert done.version_runs == [[0, 4, 2, 6], [0, 4, 2, 2]]


def _two_groups(lengths_a: list[int], lengths_b: list[int], *, segment_tokens: int,
                seconds: tuple[float, float] | None = None):
    """Groups "a" and "b" in ONE call of a simulated partial generator (1 s a token, or
    ``seconds`` each over its longest length); (virtual time, the statuses of the call's
    outcomes) per call until both are done."""
    loop = VirtualTimeLoop()
    seconds = seconds or (float(max(lengths_a)), float(max(lengths_b)))
    timings = RecordedTimings(
        generation={"a": seconds[0], "b": seconds[1]},
        rewards={"a": [0.0] * len(lengths_a), "b": [0.0] * len(lengths_b)},
        lengths={"a": lengths_a, "b": lengths_b}, microbatches={}, finish={}, publish={},
        checkpoint={})
    gen = SimPartialGenerator("gen", Fleet(loop=loop, timings=timings), segment_tokens)
    reqs = {g: GenerationRequest(group_id=g, attempt=1, prompt_index=0, n_samples=len(n), seed=0)
            for g, n in (("a", lengths_a), ("b", lengths_b))}

    async def controller() -> list[tuple[float, list[str]]]:
        calls = []
        while reqs:
            outs = await gen.generate(list(reqs.values()))
            calls.append((loop.time(), [o.status for o in outs]))
            for g, o in zip(list(reqs), outs):
                if o.status == "done":
                    del reqs[g]
        return calls

    try:
        return loop.run_until_complete(controller())
    finally:
        loop.close()


def test_a_call_returns_at_a_flush_point_or_when_all_its_groups_are_done():
    # the protocol (docs/segments.md): a call returns at the first flush point of any of
    # its groups, or when all are done. Group "a" ends (3 tokens) before either reaches
    # a flush point; returning then, "done" beside a "pending" and no flush, stopped the
    # controller ("a generator call returned unfinished groups without a flush"): every
    # simulated partial run with rollout.groups_per_call > 1, `simulate` of a recorded one too
    calls = [c for _, c in _two_groups([3, 2], [10, 10], segment_tokens=4)]
    assert all("flushed" in c or set(c) == {"done"} for c in calls), calls
    assert calls[0] == ["done", "flushed"]


def test_a_group_paused_by_another_groups_flush_keeps_the_part_of_a_token_it_decoded():
    # "a" takes 1 s a token and flushes every 2; "b" takes 2.5 s a token (10 s for its
    # 4). Each of a's flushes ends the call inside one of b's tokens: b went on from its
    # last whole token, decoding that part again at every pause, and took longer than its
    # time (a recorded partial run of 4 groups a call simulated 68 % slower than it ran)
    calls = _two_groups([4], [4], segment_tokens=2, seconds=(4.0, 10.0))
    assert calls == [(2.0, ["flushed", "pending"]), (5.0, ["done", "flushed"]), (10.0, ["done"])]


def test_a_recorded_shape_of_several_groups_per_call_simulates_with_partial_rollouts():
    cfg = load_config(None, [
        "run.steps=4", "rollout.num_generators=2", "rollout.groups_per_call=4",
        "train.groups_per_step=4", "train.groups_per_microbatch=2", "rollout.partial.enabled=true",
        "rollout.partial.segment_tokens=4", "rollout.samples_per_group=2"])
    store = MemoryEventStore()
    timings = SyntheticTimings(generation=Lognormal(20.0, 0.8), train_per_sequence_s=0.05,
                               finish=1.0, publish=2.0, checkpoint=5.0, seed=3,
                               tokens_per_sample=12, lengths_follow_time=True)
    simulate(store, SimSpec(config=cfg, timings=timings, run_id="gpc"))
    state = Projector(store).get("gpc").require()
    assert state.trainer_version == 4
