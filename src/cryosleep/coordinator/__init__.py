"""The coordinator: snapshots of jobs that span nodes, run across their node agents (docs/coordinator.md).

    protocol   the JSON messages between the coordinator and the node agents (commands, results, counters)
    hub        the agents' connections in memory: command queues (long poll), results, liveness
    machine    the snapshot state machine across nodes: one phase list, one deadline, one rollback
    embedded   the same state machine in a one-node job's agent, in-process against its own node
    catalog    SQLite: jobs, agents, snapshots, per-node images and phase times, events
    core       the service's logic without HTTP: registration, polls, triggers, one run per job, recovery
    service    the HTTP API (bearer token) around ``core``; `cryosleep coordinator serve`
    client     the CLI's client, and the node agent's side: ``NodeBackend`` + ``AgentRunner``
    rendezvous where the nodes restoring one snapshot meet: the barrier, the id relay
    sim        simulated node agents and ranks (tests, bench/coordinator_scale.py)
"""

from cryosleep.coordinator.client import AgentRunner, CoordinatorClient, NodeBackend, Registration
from cryosleep.coordinator.protocol import PROTOCOL_VERSION, Command, Mode, Op, Result

__all__ = [
    "PROTOCOL_VERSION",
    "AgentRunner",
    "Command",
    "CoordinatorClient",
    "Mode",
    "NodeBackend",
    "Op",
    "Registration",
    "Result",
]
