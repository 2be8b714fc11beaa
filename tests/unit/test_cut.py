"""The consistent cut (cryosleep.cut.rules) on simulated programs: deterministic, no processes.

A small model of the interceptor's gate (docs/interceptor.md, "The gate in HOLD") runs several ranks'
programs step by step under a seeded scheduler: collectives, sends and receives are enqueued and counted
when admitted, ``Sync`` waits until the peers issued the matching calls (as a stream synchronize does),
groups are never held inside. The HOLD lands at a seeded moment; the test then plays the agent:
decide -> write targets -> let the ranks move a little -> decide again. Every run must reach DONE with every
member of every communicator at exactly the same counters, no target ever beyond what the programs
issue, and the programs must then run to their end once the gates open (the cut broke nothing).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from cryosleep.core.interceptor import CommSlot, Rebuild, SlotState, WaitKind
from cryosleep.cut import (
    Action,
    CommTarget,
    RankView,
    Targets,
    cut_problems,
    decide,
    max_targets,
    relay_plan,
    stuck_ranks,
    to_cut,
)


@dataclass(frozen=True)
class Coll:
    comm: str


@dataclass(frozen=True)
class Send:
    comm: str
    peer: int  # the peer's rank in the communicator


@dataclass(frozen=True)
class Recv:
    comm: str
    peer: int


@dataclass(frozen=True)
class Group:
    ops: tuple[Coll | Send | Recv, ...]


@dataclass(frozen=True)
class Sync:
    """Waits until every call this thread issued was matched by its peers (cudaStreamSynchronize)."""


Op = Coll | Send | Recv | Group | Sync
Micro = tuple[str, str, int]  # (kind, comm, peer): kinds coll, send, recv, gstart, gend, sync


def flatten(ops: list[Op]) -> list[Micro]:
    out: list[Micro] = []
    for op in ops:
        if isinstance(op, Group):
            out.append(("gstart", "", -1))
            out.extend(flatten(list(op.ops)))
            out.append(("gend", "", -1))
        elif isinstance(op, Coll):
            out.append(("coll", op.comm, -1))
        elif isinstance(op, Send):
            out.append(("send", op.comm, op.peer))
        elif isinstance(op, Recv):
            out.append(("recv", op.comm, op.peer))
        else:
            out.append(("sync", "", -1))
    return out


@dataclass
class Counters:
    seq: int = 0
    send: list[int] = field(default_factory=list)
    recv: list[int] = field(default_factory=list)


@dataclass
class Thread:
    prog: list[Micro]
    pc: int = 0
    depth: int = 0
    busy: bool = False  # admitted and counted, not yet returned
    held_on: Micro | None = None
    issued: list[tuple[str, str, int, int]] = field(default_factory=list)  # (kind, comm, peer, index)

    @property
    def done(self) -> bool:
        return self.pc >= len(self.prog) and not self.busy


class Sim:
    """A job: communicators (name -> job ranks, index = rank in the communicator) and per-rank threads."""

    def __init__(self, comms: dict[str, list[int]], programs: dict[int, list[list[Op]]]) -> None:
        self.comms = comms
        self.ident = {name: 0x1000 + i for i, name in enumerate(sorted(comms))}
        self.threads = {r: [Thread(flatten(p)) for p in progs] for r, progs in programs.items()}
        self.count: dict[int, dict[str, Counters]] = {}
        self.target: dict[int, dict[str, Counters]] = {}
        self.waiting: dict[int, dict[str, list[int]]] = {}
        for r in programs:
            mine = [c for c, members in comms.items() if r in members]
            self.count[r] = {c: Counters(0, [0] * len(comms[c]), [0] * len(comms[c])) for c in mine}
            self.target[r] = {c: Counters(0, [0] * len(comms[c]), [0] * len(comms[c])) for c in mine}
            self.waiting[r] = {c: [0, 0, -1] for c in mine}
        self.hold = False
        self.totals = self._totals()

    def me(self, rank: int, comm: str) -> int:
        return self.comms[comm].index(rank)

    def _totals(self) -> dict[tuple[str, int, int], int]:
        """What the programs issue in all: ("coll", comm, -1) per member, ("pair", comm, a, b) sends."""
        out: dict[tuple[str, int, int], int] = {}
        for r, threads in self.threads.items():
            for t in threads:
                for kind, comm, peer in t.prog:
                    if kind == "coll":
                        key = (comm, r, -1)
                    elif kind == "send":
                        key = (comm, self.me(r, comm), peer)
                    else:
                        continue
                    out[key] = out.get(key, 0) + 1
        for comm, members in self.comms.items():  # every member issues the same collectives
            counts = {out.get((comm, r, -1), 0) for r in members}
            assert len(counts) == 1, f"bad test program: {comm} collectives differ between members"
        return out

    # ---- the gate ----
    def at_cut(self, rank: int) -> bool:
        for c, n in self.count[rank].items():
            t = self.target[rank][c]
            if n.seq < t.seq or any(a < b for a, b in zip(n.send, t.send, strict=True)) or any(
                    a < b for a, b in zip(n.recv, t.recv, strict=True)):
                return False
        return True

    def admissible(self, rank: int, t: Thread, op: Micro) -> bool:
        kind, comm, peer = op
        if not self.hold or t.depth > 0:
            return True
        if kind == "gstart":
            return not self.at_cut(rank)
        n, tg = self.count[rank][comm], self.target[rank][comm]
        if kind == "coll":
            return n.seq < tg.seq
        if kind == "send":
            return n.send[peer] < tg.send[peer]
        return n.recv[peer] < tg.recv[peer]

    def matched(self, rank: int, item: tuple[str, str, int, int]) -> bool:
        kind, comm, peer, index = item
        if kind == "coll":
            return all(self.count[r][comm].seq >= index for r in self.comms[comm])
        other = self.comms[comm][peer]
        me = self.me(rank, comm)
        if kind == "send":
            return self.count[other][comm].recv[me] >= index
        return self.count[other][comm].send[me] >= index

    def step(self, rank: int, t: Thread) -> bool:
        """One step of one thread; False when it cannot move (held, blocked in Sync, or done)."""
        if t.busy:
            t.busy = False
            t.pc += 1
            return True
        if t.pc >= len(t.prog):
            return False
        op = t.prog[t.pc]
        kind, comm, peer = op
        if kind == "sync":
            if all(self.matched(rank, i) for i in t.issued):
                t.issued.clear()
                t.pc += 1
                return True
            return False
        if kind == "gend":
            t.depth -= 1
            t.pc += 1
            return True
        if not self.admissible(rank, t, op):
            if t.held_on is None:
                t.held_on = op
                if kind != "gstart":
                    w = self.waiting[rank][comm]
                    w[0] += 1
                    w[1] = {"coll": WaitKind.COLL, "send": WaitKind.SEND, "recv": WaitKind.RECV}[kind]
                    w[2] = peer
            return False
        if t.held_on is not None:
            if t.held_on[0] != "gstart":
                self.waiting[rank][t.held_on[1]][0] -= 1
            t.held_on = None
        if kind == "gstart":
            t.depth += 1
        else:
            n = self.count[rank][comm]
            if kind == "coll":
                n.seq += 1
                t.issued.append(("coll", comm, -1, n.seq))
            elif kind == "send":
                n.send[peer] += 1
                t.issued.append(("send", comm, peer, n.send[peer]))
            else:
                n.recv[peer] += 1
                t.issued.append(("recv", comm, peer, n.recv[peer]))
        t.busy = True
        return True

    def run(self, rng: random.Random, steps: int) -> None:
        every = [(r, t) for r, ts in self.threads.items() for t in ts]
        for _ in range(steps):
            r, t = rng.choice(every)
            self.step(r, t)

    def quiet(self) -> bool:
        """Nothing can move (each thread tried once; a successful try is undone by no one, so it is real)."""
        return not any(self.step(r, t) for r, ts in self.threads.items() for t in ts)

    def run_to_end(self, rng: random.Random, limit: int = 200_000) -> None:
        for _ in range(limit):
            if all(t.done for ts in self.threads.values() for t in ts):
                return
            if self.quiet():
                break
            self.run(rng, 50)
        stuck = {r: [t.prog[t.pc] for t in ts if not t.done] for r, ts in self.threads.items()}
        raise AssertionError(f"the programs did not finish after the cut: {stuck}")

    # ---- what the agent sees and writes ----
    def views(self) -> list[RankView]:
        out = []
        for r, threads in self.threads.items():
            slots = []
            for i, (c, n) in enumerate(sorted(self.count[r].items())):
                t = self.target[r][c]
                w = self.waiting[r][c]
                slots.append(CommSlot(
                    index=i, state=SlotState.LIVE, vid=i + 1, ident=self.ident[c], rank=self.me(r, c),
                    nranks=len(self.comms[c]), parent_vid=0, color=0, key=0, rebuild=Rebuild.FROM_ID, flags=0,
                    device=-1, seq=n.seq, coll_target=t.seq, uid_gen=0, waiting=w[0], waiting_kind=w[1],
                    waiting_peer=w[2], send=tuple(n.send), recv=tuple(n.recv), send_target=tuple(t.send),
                    recv_target=tuple(t.recv)))
            busy = sum(t.busy for t in threads)
            in_group = sum(t.depth > 0 for t in threads)
            held = sum(t.held_on is not None for t in threads)
            out.append(RankView(rank=r, comms=tuple(slots), held=held, busy=busy, in_group=in_group,
                                targets_gen=1, settled_gen=1, settled=not busy and not in_group and self.at_cut(r)))
        return out

    def write(self, targets: dict[int, CommTarget]) -> None:
        by_ident = {v: k for k, v in self.ident.items()}
        for ident, t in targets.items():
            comm = by_ident[ident]
            n = len(self.comms[comm])
            for me, r in enumerate(self.comms[comm]):
                tg = self.target[r][comm]
                tg.seq = t.coll
                tg.send = [t.pairs.get((me, p), 0) for p in range(n)]
                tg.recv = [t.pairs.get((p, me), 0) for p in range(n)]

    def within_programs(self, targets: dict[int, CommTarget]) -> list[str]:
        """Targets beyond what the programs issue (must be none)."""
        by_ident = {v: k for k, v in self.ident.items()}
        bad = []
        for ident, t in targets.items():
            comm = by_ident[ident]
            total = self.totals.get((comm, self.comms[comm][0], -1), 0)
            if t.coll > total:
                bad.append(f"{comm}: collective target {t.coll} > {total} issued by the programs")
            for (a, b), n in t.pairs.items():
                if n > self.totals.get((comm, a, b), 0):
                    bad.append(f"{comm}: pair {a}->{b} target {n} > {self.totals.get((comm, a, b), 0)}")
        return bad

    def consistent(self) -> list[str]:
        bad = []
        for comm, members in self.comms.items():
            seqs = {self.count[r][comm].seq for r in members}
            if len(seqs) > 1:
                bad.append(f"{comm}: members at different sequence numbers {seqs}")
            for a, ra in enumerate(members):
                for b, rb in enumerate(members):
                    if self.count[ra][comm].send[b] != self.count[rb][comm].recv[a]:
                        bad.append(f"{comm}: {a} sent {self.count[ra][comm].send[b]} to {b}, "
                                   f"which received {self.count[rb][comm].recv[a]}")
        for r, threads in self.threads.items():
            if any(t.depth for t in threads):
                bad.append(f"rank {r}: a thread is inside a group at the cut")
            if not self.at_cut(r):
                bad.append(f"rank {r}: below its targets at the cut")
        return bad


def drive(sim: Sim, rng: random.Random, max_rounds: int = 2000) -> int:
    """The snapshot sequence's drain (``to_cut``, the loop ``coordinator/machine.py`` runs) against the simulation,
    the ranks moving while each round is read and written; the clock is the round. Returns the rounds asked."""
    sim.hold = True
    sim.write({})  # HOLD with every target at 0
    floor: dict[int, CommTarget] = {}

    def ask(rnd: int, targets: Targets | None) -> list[RankView]:
        nonlocal floor
        if rnd > max_rounds:
            raise AssertionError(f"no convergence in {max_rounds} rounds")
        if targets is not None:
            assert not sim.within_programs(dict(targets)), sim.within_programs(dict(targets))
            sim.write(dict(targets))
            floor = dict(targets)
        elif sim.quiet():  # (quiet() itself may have moved threads, up to where they are held)
            again = decide(float(rnd), 1e9, sim.views(), floor)
            if again.action is Action.WAIT:
                raise AssertionError(f"deadlock: nothing can move and the cut is not reached ({again.reason})")
        sim.run(rng, rng.randint(0, 12))  # the ranks move while the agent reads and writes
        return sim.views()

    sim.run(rng, rng.randint(0, 12))
    clock = iter(range(10**9))
    d, _, rounds = to_cut(sim.views(), ask, 1e9, lambda: float(next(clock)))
    assert d.action is Action.DONE, d.reason
    assert not sim.within_programs(d.targets), sim.within_programs(d.targets)
    return rounds


# ---- the programs -----------------------------------------------------------------------------------

def data_parallel(steps: int = 12) -> Sim:
    prog: list[Op] = [op for _ in range(steps) for op in (Coll("W"), Coll("W"), Coll("W"), Sync())]
    return Sim({"W": [0, 1, 2, 3]}, {r: [prog] for r in range(4)})


def overlapping(steps: int = 10) -> Sim:
    """World plus subgroups, each rank issuing its collectives in its own order within a step."""
    comms = {"W": [0, 1, 2, 3], "A": [0, 1], "B": [2, 3], "E": [1, 2], "S": [3, 1]}
    order = {0: ["A", "W"], 1: ["W", "S", "E", "A"], 2: ["E", "B", "W"], 3: ["B", "W", "S"]}
    progs: dict[int, list[list[Op]]] = {}
    for r, o in order.items():
        step: list[Op] = [*(Coll(c) for c in o), Sync()]
        progs[r] = [step * steps]
    return Sim(comms, progs)


def held_short(steps: int = 10) -> Sim:
    """docs/interceptor.md's case for the stuck rule: ranks 1 and 2 share Y, which comes before W in program
    order; ranks 0 and 3 are not in Y and run ahead on W."""
    comms = {"W": [0, 1, 2, 3], "Y": [1, 2]}
    outer: list[Op] = [op for _ in range(steps) for op in (Coll("W"), Sync())]
    inner: list[Op] = [op for _ in range(steps) for op in (Coll("Y"), Sync(), Coll("W"), Sync())]
    return Sim(comms, {0: [outer], 1: [inner], 2: [inner], 3: [outer]})


def pipeline(steps: int = 6, micro: int = 3, stages: int = 4) -> Sim:
    """Stage s receives activations from s-1 and sends to s+1, then the gradients the other way."""
    progs = {}
    for s in range(stages):
        ops: list[Op] = []
        for _ in range(steps):
            for _ in range(micro):
                if s > 0:
                    ops += [Recv("P", s - 1), Sync()]
                if s < stages - 1:
                    ops.append(Send("P", s + 1))
            for _ in range(micro):
                if s < stages - 1:
                    ops += [Recv("P", s + 1), Sync()]
                if s > 0:
                    ops.append(Send("P", s - 1))
            ops += [Sync(), Coll("W"), Sync()]  # and a data-parallel allreduce at the end of the step
        progs[s] = [ops]
    return Sim({"P": list(range(stages)), "W": list(range(stages))}, progs)


def grouped(steps: int = 8, n: int = 4) -> Sim:
    comms = {"W": list(range(n)), "H": [0, 1], "K": [2, 3]}
    progs = {}
    for r in range(n):
        half = "H" if r < 2 else "K"
        ops: list[Op] = []
        for _ in range(steps):
            ops += [Group((Send("W", (r + 1) % n), Recv("W", (r - 1) % n))), Sync()]  # a ring
            ops += [Group(tuple(x for p in range(n) if p != r for x in (Send("W", p), Recv("W", p)))), Sync()]
            ops += [Group((Coll("W"), Coll(half), Coll("W"))), Sync()]
        progs[r] = [ops]
    return Sim(comms, progs)


def threads_ahead(steps: int = 10) -> Sim:
    """Rank 0's main thread enqueues a whole epoch before synchronizing; every rank also has a second thread
    issuing on its own communicator, far ahead of or behind the main ones."""
    comms = {"W": [0, 1, 2, 3], "S": [0, 1, 2, 3]}
    eager: list[Op] = [*(Coll("W") for _ in range(steps * 2)), Sync()]
    stepwise: list[Op] = [op for _ in range(steps) for op in (Coll("W"), Coll("W"), Sync())]
    side: list[Op] = [*(Coll("S") for _ in range(3 * steps)), Sync()]
    return Sim(comms, {0: [eager, side], 1: [stepwise, side], 2: [stepwise, side], 3: [stepwise, side]})


PROGRAMS = {"data-parallel": data_parallel, "overlapping": overlapping, "held-short": held_short,
            "pipeline": pipeline, "grouped": grouped, "threads-ahead": threads_ahead}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_every_program_converges_at_every_moment(name: str) -> None:
    for seed in range(25):
        rng = random.Random(f"{name}/{seed}")
        sim = PROGRAMS[name]()
        sim.run(rng, rng.randint(0, 400))  # the HOLD lands at a random moment
        drive(sim, rng)
        assert sim.consistent() == [], (seed, sim.consistent())
        sim.hold = False  # RUN: the programs must finish from the cut
        sim.run_to_end(rng)


def test_the_held_short_case_needs_the_stuck_rule() -> None:
    """Ranks 0 and 3 issued W#1; ranks 1 and 2 are held at Y#1 (nobody issued it): only raising Y frees them."""
    sim = held_short()
    rng = random.Random(1)
    for r in (0, 3):
        sim.step(r, sim.threads[r][0])  # W#1 admitted
    sim.hold = True
    sim.write({})
    for _ in range(5):
        for r in (1, 2):
            sim.step(r, sim.threads[r][0])  # held at Y#1
    views = sim.views()
    d = decide(0.0, 10.0, views, {})
    assert d.action is Action.WRITE and d.stuck == ()  # the maxima first: W to 1
    sim.write(d.targets)
    for _ in range(5):
        for r in (1, 2):
            sim.step(r, sim.threads[r][0])
    views = sim.views()
    assert stuck_ranks(views) == [1, 2]
    d = decide(1.0, 10.0, views, d.targets)
    assert d.action is Action.WRITE and d.stuck == (1, 2)
    assert d.targets[sim.ident["Y"]].coll == 1 and "held at collective 1" in d.reason
    sim.write(d.targets)
    drive(sim, rng)
    assert sim.consistent() == []


def test_a_group_past_the_targets_raises_the_others() -> None:
    """A group admitted while its rank was short of the cut carries counters past the targets: the new
    maxima become the other members' targets."""
    sim = grouped()
    sim.hold = True
    sim.write({})
    t = sim.threads[0][0]
    sim.target[0]["W"].send[3] = 1  # short on W (one send to 3 owed): the next group start is admitted
    while t.pc < 4:  # gstart, send, recv (inside the group: never held), gend
        assert sim.step(0, t)
    views = sim.views()
    assert views[0].comms[sorted(sim.count[0]).index("W")].send[1] == 1
    d = decide(0.0, 10.0, views, {})
    assert d.action is Action.WRITE
    assert d.targets[sim.ident["W"]].pairs[(0, 1)] == 1 and d.targets[sim.ident["W"]].pairs[(3, 0)] == 1


def test_the_deadline_gives_up_naming_ranks_and_communicators() -> None:
    sim = data_parallel()
    for r in (0, 1, 3):
        for _ in range(4):  # W#1, W#2 (each: admitted, then returned)
            assert sim.step(r, sim.threads[r][0])
    sim.threads[2] = []  # rank 2 computes for ever: it never reaches its next NCCL call
    sim.hold = True
    sim.write({})
    d = decide(0.0, 10.0, sim.views(), {})
    assert d.action is Action.WRITE
    sim.write(d.targets)
    assert decide(5.0, 10.0, sim.views(), d.targets).action is Action.WAIT
    d = decide(11.0, 10.0, sim.views(), d.targets)
    assert d.action is Action.GIVE_UP
    assert "rank 2: communicator 0000000000001000 (4 ranks): 0 of 2 collectives issued" in d.reason
    assert "no thread held" in d.reason and "rank 0" not in d.reason


def _slot(ident: int, rank: int, nranks: int, **kw: int) -> CommSlot:
    base = dict(index=0, state=SlotState.LIVE, vid=1, ident=ident, rank=rank, nranks=nranks, parent_vid=0, color=0,
                key=0, rebuild=Rebuild.FROM_ID, flags=0, device=-1, seq=0, coll_target=0, uid_gen=0, waiting=0,
                waiting_kind=0, waiting_peer=-1, send=(0,) * nranks, recv=(0,) * nranks,
                send_target=(0,) * nranks, recv_target=(0,) * nranks)
    base.update(kw)
    return CommSlot(**base)  # type: ignore[arg-type]


def _settled(rank: int, *slots: CommSlot) -> RankView:
    return RankView(rank=rank, comms=slots, settled=True, targets_gen=2, settled_gen=2)


def test_a_cut_that_cannot_be_rebuilt_is_refused() -> None:
    # rank 1 destroyed communicator 7 already; rank 0 still holds it: it could not be re-created
    views = [_settled(0, _slot(7, 0, 2, seq=3, coll_target=3)), _settled(1)]
    d = decide(0.0, 10.0, views, {7: CommTarget(3)})
    assert d.action is Action.GIVE_UP and "only job ranks [0] hold it" in d.reason
    # finalized on one member only
    views = [_settled(0, _slot(7, 0, 2, seq=3, coll_target=3, state=SlotState.FINALIZED)),
             _settled(1, _slot(7, 1, 2, seq=3, coll_target=3))]
    assert "finalized by job ranks [0] but not yet by [1]" in " ".join(cut_problems(views))
    # a user reduction operator alive
    views = [RankView(0, (_slot(7, 0, 1, seq=1, coll_target=1),), settled=True, premul_live=1)]
    assert decide(0.0, 10.0, views).action is Action.GIVE_UP
    # and the same cut, consistent: done
    views = [_settled(0, _slot(7, 0, 2, seq=3, coll_target=3)), _settled(1, _slot(7, 1, 2, seq=3, coll_target=3))]
    assert decide(0.0, 10.0, views, {7: CommTarget(3)}).action is Action.DONE


def test_targets_never_go_down() -> None:
    views = [RankView(0, (_slot(5, 0, 2, seq=2),)), RankView(1, (_slot(5, 1, 2, seq=1),))]
    t = max_targets(views, {5: CommTarget(4, {(0, 1): 2}), 9: CommTarget(1)})
    assert t[5] == CommTarget(4, {(0, 1): 2}) and t[9] == CommTarget(1)


def test_relay_plan_copies_rank_zeros_id_to_the_others() -> None:
    a0 = _slot(5, 0, 3, uid_gen=7, index=2)
    a1 = _slot(5, 1, 3, uid_gen=6, index=0)
    a2 = _slot(5, 2, 3, uid_gen=7, index=1)  # already has it
    b0 = _slot(6, 0, 2, uid_gen=6)  # rank 0 of communicator 6 has not published yet
    b1 = _slot(6, 1, 2, uid_gen=6, index=3)
    split = _slot(8, 1, 2, rebuild=Rebuild.SPLIT, index=4)
    relays, pending = relay_plan([(0, [a0, b0]), (1, [a1, b1, split]), (2, [a2])], gen=7)
    assert [(r.ident, r.source, r.dest) for r in relays] == [(5, (0, 2), ((1, 0),))]
    assert pending == [6]
