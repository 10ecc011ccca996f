"""Scenarios (workload, SLA, objectives, pick rule) and the scoring of measurements."""
