"""A relay's group of agents as one answer and one command per round (capability ``group``: docs/coordinator.md,
"Relays").

Upstream, the relay merges the results of its agents that answered the same command in one batch into one
(``merge``): the drain's summaries combined (``cut.summary.combine``: associative, so the coordinator's
combination of the merged summaries is the one it would make of the nodes' own), the other ops' data merged as
the coordinator reads them (``MERGE``). Each merged result names its agents and their seconds; a failed result,
an op not in ``MERGE`` (prepare, persist, stop, abort: per-node facts the coordinator keeps) or an agent of
protocol 2 (views, not a summary) goes up as it came. Downstream, the coordinator sends a command due to several
carried agents with the same arguments once (``rounds``: the command and the agents it is for), and the relay
hands each its copy (``expand``), a targets command cut down to the communicators the agent's last summary named.

Both sides say ``can: ["group"]`` (the relay in its batch, the coordinator in its answer): a relay merges only
for a coordinator that said so, and a coordinator sends rounds only to a relay that said so; otherwise each
agent's results and commands travel on their own, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cryosleep.coordinator.protocol import drain_summary, summary_from_json, summary_to_json
from cryosleep.cut.summary import NodeSummary, combine
from cryosleep.errors import ProtocolError

__all__ = ["GROUP", "MERGE", "expand", "merge", "summaries"]

GROUP = "group"  # the capability


def _drain(datas: list[Mapping[str, Any]]) -> dict[str, Any]:
    return {"summary": summary_to_json(combine(summary_from_json(d["summary"]) for d in datas))}


def _none(datas: list[Mapping[str, Any]]) -> dict[str, Any]:
    return {}


def _records(datas: list[Mapping[str, Any]]) -> dict[str, Any]:
    return {"records": [r for d in datas for r in d.get("records") or ()]}


def _phases(datas: list[Mapping[str, Any]]) -> dict[str, Any]:
    out: dict[str, float] = {}
    for d in datas:
        for k, v in (d.get("phases") or {}).items():
            out[k] = max(out.get(k, 0.0), float(v))
    return {"phases": out}  # the slowest node's, per phase (the seconds of each node travel on their own)


def _resume(datas: list[Mapping[str, Any]]) -> dict[str, Any]:
    uids: dict[str, str] = {}
    need: set[str] = set()
    for d in datas:
        uids.update({str(k): str(v) for k, v in d["uids"].items()})
        need.update(str(i) for i in d["need"])
    return {"uids": uids, "need": sorted(need)}


MERGE: dict[str, Callable[[list[Mapping[str, Any]]], dict[str, Any]]] = {
    "hold": _drain, "report": _drain, "targets": _drain, "quiesce": _records, "capture": _phases,
    "resume": _resume, "relay": _none, "run": _none, "net_hold": _none, "net_release": _none}
"""The ops whose answers merge, and how: what the coordinator reads of them (machine.py), for the group."""


def merge(results: Iterable[tuple[str, Any]],
          comms: dict[str, set[str]] | None = None) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
    """The results of (agent, result) as merged results (those of two agents or more that answered one command
    alike) and, per agent, those that go up on their own. ``comms`` is told each agent's communicators (its
    drain summaries'), for ``expand``."""
    buckets: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    rest: dict[str, list[Any]] = {}
    for agent, r in results:
        ok = isinstance(r, dict) and r.get("ok") is True and r.get("op") in MERGE and isinstance(r.get("id"), str)
        data: Any = r.get("data") if ok else None
        if ok and r["op"] in ("hold", "report", "targets"):
            ok = isinstance(data, dict) and isinstance(data.get("summary"), dict)
            if ok and comms is not None and isinstance(data["summary"].get("comms"), dict):
                comms[agent] = set(data["summary"]["comms"])
        b = buckets.setdefault(r["id"], []) if ok else None
        if b is None or any(a == agent for a, _ in b):
            rest.setdefault(agent, []).append(r)
        else:
            b.append((agent, r))
    merged: list[dict[str, Any]] = []
    for cid, got in buckets.items():
        first = got[0][1]
        try:
            if len(got) < 2 or any(r.get("snapshot") != first.get("snapshot") or r.get("op") != first["op"]
                                   for _, r in got):
                raise ValueError("nothing to merge")
            data = MERGE[first["op"]]([r.get("data") or {} for _, r in got])
        except (KeyError, ValueError, TypeError, AttributeError):  # the coordinator says what is wrong with one
            for agent, r in got:
                rest.setdefault(agent, []).append(r)
            continue
        merged.append({"id": cid, "snapshot": first.get("snapshot"), "op": first["op"], "ok": True, "data": data,
                       "agents": [a for a, _ in got], "seconds": [float(r.get("seconds") or 0.0) for _, r in got]})
    return merged, rest


def expand(command: Mapping[str, Any], agent: str, comms: Mapping[str, set[str]]) -> Mapping[str, Any]:
    """One agent's copy of a command sent for its group: a targets command only with the communicators the
    agent's last summary named (all of them when the relay never saw one: an agent ignores the others)."""
    if command.get("op") != "targets" or agent not in comms:
        return command
    args = command.get("args") or {}
    mine = comms[agent]
    return {**command, "args": {**args, "targets": {k: t for k, t in (args.get("targets") or {}).items()
                                                    if k in mine}}}


def summaries(ok: Mapping[int, Mapping[str, Any]], ranks: Mapping[int, list[int]]) -> dict[int, NodeSummary]:
    """Each node's drain summary from its answer (``ok``: node -> data), decoded once per answer: the nodes of
    a merged answer share one data object, and so one summary (combine each once: ``{id(s): s}``). A merged
    summary is checked against its nodes' job ranks (``ranks``: their prepare answers): it may count no more
    ranks than they have, nor name a job rank of another node (ProtocolError otherwise). A relay can say
    what its agents did not within those bounds (docs/security.md, "Relays")."""
    out: dict[int, NodeSummary] = {}
    seen: dict[int, tuple[NodeSummary, list[int]]] = {}
    for n, d in ok.items():
        got = seen.get(id(d))
        if got is None:
            got = seen[id(d)] = (drain_summary(d), [])
        got[1].append(n)
        out[n] = got[0]
    for s, nodes in seen.values():
        if len(nodes) > 1:
            _check(s, nodes, ranks)
    return out


def _check(s: NodeSummary, nodes: list[int], ranks: Mapping[int, list[int]]) -> None:
    mine = {r for n in nodes for r in ranks.get(n, ())}
    named = set(s.unsettled) | set(s.stuck) | {r for c in s.comms.values() for r in c.holders}
    alien = sorted(named - mine)
    if s.ranks > len(mine) or alien:
        raise ProtocolError(f"a relay's merged answer for nodes {nodes[:8]}{'...' if len(nodes) > 8 else ''} does "
                            "not match them", f"it counts {s.ranks} rank(s) of their {len(mine)}"
                            + (f" and names job ranks of other nodes: {alien[:8]}" if alien else ""),
                            "the relay is out of date or not to be trusted: run it from this release, or let "
                            "its agents poll the coordinator directly")
