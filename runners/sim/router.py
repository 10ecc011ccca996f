"""The router in front of a deployment of several chips, as the simulator models it: requests
go to the instances of a role in turn, in arrival order (round-robin, as vLLM's
disaggregated-serving test proxy, toy_proxy_server.py, and a plain load balancer do)."""

from __future__ import annotations

from objectives.scenario import Closed, Workload
from runners.load.workload import Requests, make_requests


def at_fleet_rate(workload: Workload, chips: int) -> Workload:
    """A per-chip workload at the rate a deployment of `chips` receives: `chips` times the rate
    (a closed loop: times the requests in flight), the same number of requests (so a window
    `chips` times shorter in time: a deployment's load is fleet_window)."""
    arrival = workload.arrival
    if isinstance(arrival, Closed):
        update: dict[str, float] = {"concurrency": arrival.concurrency * chips}
    else:
        update = {"rate": arrival.rate * chips}
    return workload.model_copy(update={"arrival": arrival.model_copy(update=update)})


def fleet_window(workload: Workload, chips: int) -> Workload:
    """The deployment's load over as long a span as one chip's window: `chips` times the rate
    and `chips` times the requests."""
    return at_fleet_rate(workload, chips).model_copy(
        update={"num_requests": workload.num_requests * chips}
    )


def replica_requests(workload: Workload, replicas: int) -> Requests:
    """What one of `replicas` co-located replicas serves of the deployment's traffic: every
    replicas-th request of `replicas` times the per-chip load (identical replicas see alike
    streams, so one stands for all). Each replica of a closed loop keeps its own requests in
    flight."""
    if replicas == 1 or workload.arrival.kind == "closed":
        return make_requests(workload)
    requests = make_requests(fleet_window(workload, replicas))
    assert requests.arrival_s is not None, "an open loop has arrival times"
    arrivals = requests.arrival_s[::replicas]
    return requests.every(replicas, arrivals - arrivals[0])
