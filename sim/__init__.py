"""Virtual-time simulation of the real controller at cluster scale.

The real ``Controller`` (pumps, policies, reducer, ``LogWriter`` on a real store) runs on
an event loop whose clock jumps to the next timer instead of sleeping (``sim.clock``),
driven by simulated generators and a simulated trainer (``sim.workers``) whose durations
come from a seeded distribution or from a recorded run's log (``sim.timings``). Only
durations are simulated: every decision, event and invariant is the real code's.
"""
