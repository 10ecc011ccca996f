"""Helpers shared by the tests (tests/) and the benchmarks (bench/), after Optuna's
`optuna/testing/`: a tiny random model built offline, the engines .ci/setup-engines installs,
and the small scenario and runner settings a real engine serves in seconds on 2 cores.

Dev-only: not an installed package; the tests and benchmarks run from the repository root.
"""
