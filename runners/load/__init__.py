"""The load a trial puts on an engine and what is read from it: the workload's requests
(`workload`, `prompts`), the load generator (`loadgen`), the metric definitions
(`measurement`) and the search for the highest rate that meets the SLA (`capacity`). The
simulator and the real engines share all of it."""
