"""The built-in discrete-event simulator of a continuous-batching serving engine."""

from runners.sim.compiled import choose

# What runs the step loop: "compiled", or "source (why)" (runners.sim.compiled).
CORE = choose()
