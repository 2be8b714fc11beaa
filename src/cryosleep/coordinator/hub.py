"""The coordinator's side of the agents' connections, in memory: command queues, results, liveness.

Each registered agent (one incarnation of it) has an outbox of commands not yet answered. A long poll takes
the commands that are due (never delivered, or delivered ``redeliver_s`` ago without an answer: at least
once); a result removes its command and wakes whoever waits for it. An agent is alive while it has a poll
open, or polled within ``lost_after_s``; one that said it leaves (``leave``: its job ended on its node, so the
agent exits) is not, from that moment, and says why. Everything here is guarded by one lock. A poll is held on
the HTTP server's event loop (coordinator/httpserver.py), not in a thread: ``poll_open``, ``poll_due`` and
``poll_close``, woken through the waker it registered, so that a command wakes only its own agent's poll and
a result only the round's waiter (once all its answers are in).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cryosleep.coordinator.protocol import Command, Op, Result

REDELIVER_S = 5.0


@dataclass
class Pending:
    id: str
    snapshot: str
    job: str
    op: Op
    args: Mapping[str, Any]  # the op's args (protocol.PAYLOADS)
    deadline: float  # monotonic, on the coordinator's clock
    delivered: float | None = None

    def command(self, now: float) -> Command:
        budget = max(0.0, self.deadline - now)
        return Command(self.id, self.snapshot, self.job, self.op, budget, time.time() + budget, self.args)


@dataclass
class AgentLine:
    agent_id: str
    job: str
    node_rank: int
    incarnation: str
    outbox: dict[str, Pending] = field(default_factory=dict)
    last_seen: float = 0.0
    polling: int = 0
    replaced: bool = False
    left: str | None = None  # why the agent left (its job ended there), or None
    wakers: list[Callable[[], None]] = field(default_factory=list)  # held polls on an event loop (poll_open)


class Hub:
    def __init__(self, redeliver_s: float = REDELIVER_S) -> None:
        self.lock = threading.RLock()
        self.results_cond = threading.Condition(self.lock)
        self.lines: dict[str, AgentLine] = {}
        self.results: dict[tuple[str, str], Result] = {}
        self.arrivals: dict[str, list[tuple[str, Result]]] = {}  # command id -> (agent, result), arrival order
        self.redeliver_s = redeliver_s
        self.seen_wall: dict[str, float] = {}  # heartbeats not yet written to the catalog
        self.expected: dict[str, int] = {}  # command id -> answers its round waits for (send_round)
        self.closed = False

    def attach(self, agent_id: str, job: str, node_rank: int, incarnation: str) -> None:
        """A (re-)registration. A new incarnation replaces the old line: its queued commands are dropped (the
        process that was to run them is gone) and a snapshot waiting on it sees the restart."""
        with self.lock:
            old = self.lines.get(agent_id)
            if old is not None and old.incarnation == incarnation:
                old.last_seen = time.monotonic()
                old.left = None  # registered again after leaving: it is here
                return
            if old is not None:
                old.replaced = True
                self._wake(old)
            self.lines[agent_id] = AgentLine(agent_id, job, node_rank, incarnation, last_seen=time.monotonic())
            self.results_cond.notify_all()

    def line(self, agent_id: str) -> AgentLine | None:
        with self.lock:
            return self.lines.get(agent_id)

    def incarnation(self, agent_id: str) -> str | None:
        with self.lock:
            a = self.lines.get(agent_id)
            return a.incarnation if a else None

    def alive(self, agent_id: str, lost_after_s: float, now: float | None = None) -> bool:
        with self.lock:
            a = self.lines.get(agent_id)
            if a is None or a.left is not None:
                return False
            return a.polling > 0 or (now or time.monotonic()) - a.last_seen < lost_after_s

    def left(self, agent_id: str) -> str | None:
        """Why the registered agent left (its job ended on its node), or None while it has not."""
        with self.lock:
            a = self.lines.get(agent_id)
            return a.left if a is not None else None

    def leave(self, agent_id: str, incarnation: str, reason: str) -> bool:
        """The agent says it goes (its job ended on its node): from now on it is not alive, with ``reason``
        instead of an agent lost after ``lost_after_s`` of silence, and a snapshot waiting on it fails at once.
        False: this incarnation is not the registered one."""
        with self.lock:
            a = self.lines.get(agent_id)
            if a is None or a.incarnation != incarnation:
                return False
            a.left = reason or "its agent left"
            self._wake(a)
            self.results_cond.notify_all()
            return True

    def last_seen_age(self, agent_id: str) -> float | None:
        with self.lock:
            a = self.lines.get(agent_id)
            if a is None:
                return None
            return 0.0 if a.polling else time.monotonic() - a.last_seen

    # ---- commands ------------------------------------------------------------------------------------------

    def send(self, agent_id: str, cmd_id: str, snapshot: str, job: str, op: Op, args: Mapping[str, Any],
             deadline: float) -> None:
        with self.lock:
            a = self.lines[agent_id]
            if cmd_id in a.outbox or (agent_id, cmd_id) in self.results:
                return  # already queued or answered: sending again is a no-op
            a.outbox[cmd_id] = Pending(cmd_id, snapshot, job, op, args, deadline)
            self._wake(a)

    def send_round(self, cmd_id: str, snapshot: str, job: str, op: Op, args: Mapping[str, Mapping[str, Any]],
                   deadline: float) -> None:
        """``send`` to every agent of ``args`` (agent -> its arguments) under one lock acquisition, and wake
        the round's waiter (``wait_arrivals``) only once every one of them answered, or at a failure, a replaced
        or departed agent: with 2,048 agents, one wake-up per answer was 2,048 lock round trips a round."""
        with self.lock:
            self.expected[cmd_id] = len(args)
            for agent_id, a in args.items():
                self.send(agent_id, cmd_id, snapshot, job, op, a, deadline)

    def end_round(self, cmd_id: str, unanswered: Iterable[str]) -> None:
        """The round's waiter is done: the commands still unanswered are cancelled (one lock acquisition)."""
        with self.lock:
            self.expected.pop(cmd_id, None)
            for agent_id in unanswered:
                self.cancel(agent_id, cmd_id)

    def cancel(self, agent_id: str, cmd_id: str) -> None:
        with self.lock:
            a = self.lines.get(agent_id)
            if a is not None:
                a.outbox.pop(cmd_id, None)

    @staticmethod
    def _wake(a: AgentLine) -> None:
        for w in a.wakers:
            w()

    def poll_open(self, agent_id: str, incarnation: str, results: Sequence[Result],
                  waker: Callable[[], None]) -> AgentLine | None:
        """A long poll begins: records the ``results`` it carries (with its commands, one lock acquisition
        each: with thousands of agents polling, the lock is what they share) and counts the poll open;
        ``waker()`` (called under the lock, from any thread) whenever ``poll_due`` may have something new. None
        when this incarnation is not (or no longer) the registered one, or it left (the agent must register
        again). Every open poll is closed with ``poll_close``."""
        with self.lock:
            a = self.lines.get(agent_id)
            if a is None or a.incarnation != incarnation or a.left is not None:
                return None
            for res in results:
                self._put(a, res)
            a.polling += 1
            a.wakers.append(waker)
            return a

    def poll_due(self, a: AgentLine) -> list[Command] | bool | None:
        """An open poll looks: the commands due (never delivered, or delivered ``redeliver_s`` ago without an
        answer), [] when it should answer with none (the hub closed, the agent left), None when its incarnation
        was replaced, False when it should go on waiting (until woken, or ``redeliver_s`` at most)."""
        with self.lock:
            now = time.monotonic()
            got = self._due(a, now)
            return [p.command(now) for p in got] if isinstance(got, list) else got

    def _due(self, a: AgentLine, now: float) -> list[Pending] | bool | None:
        a.last_seen = now
        self.seen_wall[a.agent_id] = time.time()
        if a.replaced or self.closed or a.left is not None:
            return None if a.replaced else []
        due = [p for p in a.outbox.values() if p.delivered is None or now - p.delivered >= self.redeliver_s]
        if not due:
            return False
        for p in due:
            p.delivered = now
        return due

    def poll_close(self, a: AgentLine, waker: Callable[[], None]) -> None:
        with self.lock:
            a.polling -= 1
            a.last_seen = time.monotonic()
            try:
                a.wakers.remove(waker)
            except ValueError:
                pass

    # ---- a relay's batched poll (service.py, coordinator/relay.py) -------------------------------------------

    def batch_open(self, polls: Sequence[tuple[str, str, Sequence[Result]]],
                   waker: Callable[[], None]) -> dict[str, AgentLine | None]:
        """``poll_open`` for each (agent, incarnation, results) a relay carries, under one lock acquisition and
        with one waker: the batch is woken when any of its agents may have something due."""
        with self.lock:
            return {agent: self.poll_open(agent, inc, results, waker) for agent, inc, results in polls}

    def batch_due(self, lines: Mapping[str, AgentLine]) -> dict[str, list[Command] | None]:
        """``poll_due`` for every line of a batch (one lock acquisition): only the agents whose poll should be
        answered now (their commands, [] or None as ``poll_due`` says); the others go on waiting."""
        with self.lock:
            out: dict[str, list[Command] | None] = {}
            for agent, a in lines.items():
                got = self.poll_due(a)
                if got is not False:
                    out[agent] = got if isinstance(got, list) else None
            return out

    def batch_rounds(self, lines: Mapping[str, AgentLine]) -> tuple[dict[str, list[Command] | None],
                                                                    list[tuple[Command, list[str]]]]:
        """``batch_due`` for a relay that takes a command once for several of its agents (coordinator/group.py):
        an agent whose only due command is one of a round, with the same arguments (the same object: the
        machine gives one to every node alike) as other carried agents', goes in that command's round (the
        command once, and the agents it is for); the others are answered one by one, as ``batch_due``."""
        with self.lock:
            now = time.monotonic()
            out: dict[str, list[Command] | None] = {}
            shared: dict[tuple[str, int], list[tuple[str, Pending]]] = {}
            for agent, a in lines.items():
                got = self._due(a, now)
                if got is False:
                    continue
                if isinstance(got, list) and len(got) == 1:
                    shared.setdefault((got[0].id, id(got[0].args)), []).append((agent, got[0]))
                else:
                    out[agent] = [p.command(now) for p in got] if isinstance(got, list) else None
            rounds: list[tuple[Command, list[str]]] = []
            for group in shared.values():
                if len(group) == 1:
                    out[group[0][0]] = [group[0][1].command(now)]
                else:
                    rounds.append((group[0][1].command(now), [agent for agent, _ in group]))
            return out, rounds

    def put_merged(self, res: Result, agents: Sequence[tuple[str, str, float]]) -> bool:
        """A relay's merged answer (coordinator/group.py) to command ``res.id`` for (agent, incarnation, its
        seconds): recorded for every agent, sharing ``res.data``, or for none when one of them is not the
        registered incarnation or no longer waits for it (a repeat, or it answered on its own meanwhile: its
        answer would be counted twice; the others get the command again and answer again)."""
        with self.lock:
            lines = [self.lines.get(agent) for agent, _, _ in agents]
            if len({agent for agent, _, _ in agents}) != len(agents) or not all(
                    a is not None and a.incarnation == inc and res.id in a.outbox
                    for a, (_, inc, _) in zip(lines, agents, strict=True)):
                return False
            got = self.arrivals.setdefault(res.id, [])
            now = time.monotonic()
            for a, (agent, _, seconds) in zip(lines, agents, strict=True):
                assert a is not None
                a.last_seen = now
                del a.outbox[res.id]
                one = replace(res, seconds=seconds)
                self.results[(agent, res.id)] = one
                got.append((agent, one))
            if len(got) >= self.expected.get(res.id, 0):
                self.results_cond.notify_all()
            return True

    def batch_close(self, lines: Iterable[AgentLine], waker: Callable[[], None]) -> None:
        with self.lock:
            for a in lines:
                self.poll_close(a, waker)

    def _put(self, a: AgentLine, res: Result) -> None:
        a.last_seen = time.monotonic()
        if a.outbox.pop(res.id, None) is None:
            return  # a repeat, or an answer to a command given up on: nobody waits for it
        self.results[(a.agent_id, res.id)] = res
        got = self.arrivals.setdefault(res.id, [])
        got.append((a.agent_id, res))
        if not res.ok or len(got) >= self.expected.get(res.id, 0):
            self.results_cond.notify_all()

    def put_result(self, agent_id: str, incarnation: str, res: Result) -> bool:
        """Records the answer to a queued command; the first one for a command id wins, repeats and answers to
        cancelled commands are ignored. False: this incarnation is not the registered one (its answer is about
        work a restarted agent no longer has)."""
        with self.lock:
            a = self.lines.get(agent_id)
            if a is None or a.incarnation != incarnation:
                return False
            self._put(a, res)
            return True

    def result(self, agent_id: str, cmd_id: str) -> Result | None:
        with self.lock:
            return self.results.get((agent_id, cmd_id))

    def arrived(self, cmd_id: str, seen: int) -> list[tuple[str, Result]]:
        """The results for ``cmd_id`` (agent, result), in arrival order, from the ``seen``-th on: a waiter takes
        only what is new at each wake-up (with 2,048 nodes, re-reading every node's slot at every result would be
        quadratic)."""
        with self.lock:
            got = self.arrivals.get(cmd_id)
            return got[seen:] if got else []

    def health(self, agents: list[str], lost_after_s: float) -> dict[str, tuple[str | None, bool, float | None]]:
        """Per agent: (registered incarnation, alive, seconds since its last poll), under one lock acquisition."""
        now = time.monotonic()
        with self.lock:
            out: dict[str, tuple[str | None, bool, float | None]] = {}
            for a in agents:
                line = self.lines.get(a)
                if line is None:
                    out[a] = (None, False, None)
                else:
                    age = 0.0 if line.polling else now - line.last_seen
                    alive = line.left is None and (line.polling > 0 or age < lost_after_s)
                    out[a] = (line.incarnation, alive, age)
            return out

    def stats(self, lost_after_s: float) -> tuple[int, int, int, int]:
        """(agents registered, alive, polls open, commands queued and not answered), for the metrics."""
        now = time.monotonic()
        with self.lock:
            lines = [a for a in self.lines.values() if not a.replaced]
            alive = sum(1 for a in lines if a.left is None and (a.polling > 0 or now - a.last_seen < lost_after_s))
            return (len(lines), alive, sum(a.polling for a in lines), sum(len(a.outbox) for a in lines))

    def forget(self, snapshot: str) -> None:
        """Drops a finished snapshot's results and queued commands."""
        with self.lock:
            for key in [k for k, r in self.results.items() if r.snapshot == snapshot]:
                del self.results[key]
            for cid in [c for c, got in self.arrivals.items() if got[0][1].snapshot == snapshot]:
                del self.arrivals[cid]
            for a in self.lines.values():
                for cid in [c for c, p in a.outbox.items() if p.snapshot == snapshot]:
                    del a.outbox[cid]

    def drain_heartbeats(self) -> dict[str, float]:
        with self.lock:
            out, self.seen_wall = self.seen_wall, {}
            return out

    def wait_arrivals(self, cmd_id: str, seen: int, until: float) -> None:
        """Waits (at most until ``until``, monotonic, and 0.2 s at a time) for a change: for a round sent with
        ``send_round``, every answer in or a failed one; else any result for ``cmd_id`` beyond the ``seen`` ones;
        an agent replaced or gone. The caller re-checks what it waits for."""
        with self.lock:
            if len(self.arrivals.get(cmd_id, ())) > seen:
                return
            left = until - time.monotonic()
            if left > 0:
                self.results_cond.wait(min(left, 0.2))

    def close(self) -> None:
        with self.lock:
            self.closed = True
            for a in self.lines.values():
                self._wake(a)
            self.results_cond.notify_all()
