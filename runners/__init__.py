"""Runners turn (config, workload) into a Measurement: the simulator and the real engines."""
