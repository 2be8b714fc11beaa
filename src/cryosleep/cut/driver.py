"""The agent's side of the interceptor protocol: the steps a node's ranks go through, over their control blocks.

One ``Driver`` drives the control blocks of a job's ranks on this node through the steps of
docs/interceptor.md ("The agent's procedures"). It decides nothing about the cut: the snapshot sequence
(``coordinator/machine.py``) runs the drain's rounds with ``cryosleep.cut.rules.to_cut`` over every node's
views, and each node carries out its share of a round here:

    hold           zero every target, set the HOLD deadline, HOLD(g): every thread stops at its next NCCL call
    apply_targets  one round of the drain: the targets written, the answers awaited, fresh views read
    quiesce        QUIESCE(g): every rank flushes and destroys its real communicators
    rebuild        REBUILD(g), relaying each communicator's fresh unique id from its rank-0 member to the others
    run            RUN(g): the gates open, the fast path is back

Every command carries a new generation, one counter for the whole job. The way back from a failure is the
sequence's rollback, whose node side (``capture.snapshot.undo_nccl``) uses ``requiesce`` and ``resume``
here: ranks still live get RUN, or, next to quiesced ones, are quiesced too so that every member re-creates
the same communicators.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping

from cryosleep.core.interceptor import Cmd, ControlBlock, Rebuild, SlotState, State
from cryosleep.cut.rules import (
    RankView,
    Targets,
    relay_plan,
    slot_targets,
)
from cryosleep.errors import CaptureFailed, InterceptorError

# How long a control thread may take to answer a command that involves no NCCL work (it polls every
# 5 ms while running, every 1 ms otherwise).
ANSWER_TIMEOUT_S = 10.0
# REBUILD and the RUN after it run after the capture, when the snapshot's own deadline may be spent:
# they get their own time.
REBUILD_TIMEOUT_S = 120.0
# A HOLD the agent leaves behind (the agent died) is released by the interceptor this long after the
# snapshot's deadline.
HOLD_GRACE_S = 5.0
# How often a wait asks whether the ranks it waits for still have a worker process.
GONE_EVERY_S = 0.2

STATE_NAMES = {int(s): s.name for s in State}


def read_view(rank: int, block: ControlBlock) -> RankView:
    """One rank's block, read once: what ``decide`` needs. The answer to the targets is read first, so that
    the counters read after it are never older than the ``settled`` they are judged with."""
    targets_gen = block.targets_gen
    settled_gen, settled = block.settled()
    comms = tuple(block.comms())
    return RankView(rank=rank, comms=comms, held=block.held, busy=block.busy, in_group=block.in_group,
                    targets_gen=targets_gen, settled_gen=settled_gen, settled=settled,
                    premul_live=block.premul_live)


class Driver:
    """The control blocks of one job's ranks (job rank -> block), driven together.

    ``discover`` (optional) returns the blocks published now by ranks other than the given ones; a rank that
    publishes its block during a drain (its first NCCL call) is brought into the HOLD at once. ``live``
    (optional) returns the PIDs (inside the job's namespace) of the job's processes still running: a wait for
    the answer of a rank whose worker is not among them, twice in a row, ends then instead of at its deadline
    (a job that ends as a snapshot starts would otherwise hold the snapshot for the whole of its deadline).
    """

    def __init__(self, blocks: Mapping[int, ControlBlock],
                 discover: Callable[[Collection[int]], Mapping[int, ControlBlock]] | None = None,
                 log: Callable[[str], None] | None = None,
                 live: Callable[[], Collection[int]] | None = None) -> None:
        self.blocks: dict[int, ControlBlock] = dict(sorted(blocks.items()))
        self.discover = discover
        self.log = log or (lambda _msg: None)
        self.live = live
        self._gone_checked = 0.0
        self._missing: set[int] = set()  # ranks whose worker was not running at the last check
        self.gen = max((max(b.cmd()[1], b.state()[1]) for b in self.blocks.values()), default=0)
        self.touched = False  # a command was written: rollback has something to undo
        self.hold_deadline_ns = 0

    @property
    def ranks(self) -> list[int]:
        return list(self.blocks)

    def close(self) -> None:
        for b in self.blocks.values():
            b.close()
        self.blocks = {}

    # ---- commands and answers ----------------------------------------------------------------------

    def exited(self, ranks: Collection[int]) -> list[int]:
        """Those of ``ranks`` whose worker has exited (asked at most every GONE_EVERY_S; [] in between)."""
        now = time.monotonic()
        if self.live is None or not ranks or now - self._gone_checked < GONE_EVERY_S:
            return []
        self._gone_checked = now
        running = set(self.live())
        missing = {r for r in ranks if self.blocks[r].pid not in running}
        dead, self._missing = sorted(missing & self._missing), missing
        return dead

    def check_alive(self, waiting: str) -> None:
        """Raises if a rank's worker has exited (two looks, GONE_EVERY_S apart, agree) while waiting for ``waiting``."""
        dead = self.exited(self.ranks)
        if dead:
            self._raise_exited(dead, waiting)

    def _raise_exited(self, dead: list[int], waiting: str) -> None:
        raise InterceptorError(f"the worker of rank(s) {dead} exited", f"while waiting for {waiting}",
                               "the job ended or a rank died; the snapshot cannot be taken", ranks=dead)

    def command(self, cmd: Cmd, ranks: Iterable[int] | None = None) -> int:
        """Writes ``cmd`` with a new generation on the given ranks (default: all); returns the generation."""
        self.gen += 1
        self.touched = True
        for r in self.ranks if ranks is None else ranks:
            self.blocks[r].command(cmd, self.gen)
        return self.gen

    def command_at(self, cmd: Cmd, gen: int) -> int:
        """Writes ``cmd`` as generation ``gen`` on every rank: one the caller agreed on with other nodes (a
        multi-node restore's REBUILD), above every generation these blocks hold. Returns ``gen``."""
        if gen <= self.gen:
            raise InterceptorError(f"generation {gen} of {cmd.name} is not above the blocks' {self.gen}",
                                   "the nodes agreed on a generation some rank here has already seen",
                                   "restore the job again (its nodes agree on a fresh generation)")
        self.gen = gen - 1
        return self.command(cmd)

    def wait(self, state: State, gen: int, deadline: float, ranks: Iterable[int] | None = None) -> None:
        """Waits until every given rank answers ``state`` for ``gen``; InterceptorError names the ranks
        that answered ERROR (with the interceptor's reason) or did not answer in time."""
        pending = list(self.ranks if ranks is None else ranks)
        nap = 0.0005
        while pending:
            errors: dict[int, str] = {}
            still: list[int] = []
            for r in pending:
                st, g = self.blocks[r].state()
                if (st, g) == (state, gen):
                    continue
                if st == State.ERROR and g == gen:
                    errors[r] = self.blocks[r].error
                else:
                    still.append(r)
            if errors:
                raise InterceptorError(f"the NCCL interceptor refused {self._cmd_of(state).name}",
                                       "; ".join(f"rank {r}: {e}" for r, e in errors.items()),
                                       "see the workers' logs (lines 'cryosleep-nccl[PID]')", ranks=sorted(errors))
            pending = still
            if not pending:
                return
            dead = self.exited(pending)
            if dead:
                self._raise_exited(dead, f"{state.name}({gen})")
            if time.monotonic() > deadline:
                seen = ", ".join(f"rank {r} {self._state_text(r)}" for r in pending)
                raise InterceptorError(f"the NCCL interceptor did not answer {self._cmd_of(state).name}",
                                       f"waiting for {state.name}({gen}): {seen}",
                                       "a worker may be stopped, gone, or stuck inside an NCCL call",
                                       ranks=pending)
            time.sleep(nap)
            nap = min(nap * 2, 0.01)

    @staticmethod
    def _cmd_of(state: State) -> Cmd:
        return {State.RUNNING: Cmd.RUN, State.HOLDING: Cmd.HOLD, State.QUIESCED: Cmd.QUIESCE,
                State.PREPARED: Cmd.PREPARE, State.OFFLOADED: Cmd.OFFLOAD}.get(state, Cmd.REBUILD)

    def answers(self, cmd: Cmd, state: State, ranks: Iterable[int], deadline: float) -> dict[int, str]:
        """Writes ``cmd`` on ``ranks`` and waits for each answer; returns the ranks that did not answer
        ``state`` with why (the interceptor's error, or no answer by the deadline)."""
        todo = list(ranks)
        if not todo:
            return {}
        return self.collect(cmd, state, self.command(cmd, todo), todo, deadline)

    def collect(self, cmd: Cmd, state: State, gen: int, ranks: Iterable[int], deadline: float) -> dict[int, str]:
        """The answers to ``cmd`` written as generation ``gen`` on ``ranks``: returns the ranks that did not
        answer ``state`` with why. A rank whose command word has moved past ``gen`` (a newer command was written
        to it since) is not waited for: it answers that one."""
        todo = list(ranks)
        failed: dict[int, str] = {}
        nap = 0.0005
        while todo:
            still = []
            for r in todo:
                st, g = self.blocks[r].state()
                if (g == gen and st == state) or self.blocks[r].cmd()[1] > gen:
                    continue
                if g == gen and st == State.ERROR:
                    failed[r] = self.blocks[r].error
                else:
                    still.append(r)
            todo = still
            for r in self.exited(todo):
                failed[r] = f"its worker exited before answering {cmd.name}"
                todo.remove(r)
            if todo and time.monotonic() > deadline:
                failed.update({r: f"no answer to {cmd.name} (still {self._state_text(r)})" for r in todo})
                break
            time.sleep(nap)
            nap = min(nap * 2, 0.01)
        return failed

    # ---- the fast path (docs/interceptor.md, "The fast path") ---------------------------------------

    def fast_ranks(self) -> list[int]:
        """Ranks with device memory the interceptor can move itself (served by it, or mapped by the application)."""
        return [r for r, b in self.blocks.items() if b.devmem.on and b.devmem.moved_bytes > 0]

    def prepare(self, ranks: Iterable[int], deadline: float) -> dict[int, str]:
        """PREPARE (job running): each rank's pinned staging file grown to its device memory."""
        return self.answers(Cmd.PREPARE, State.PREPARED, ranks, deadline)

    def offload(self, ranks: Iterable[int], deadline: float) -> dict[int, str]:
        """OFFLOAD (quiesced): each rank copies its device memory out and releases it. A rank that refuses
        keeps its memory (and its state QUIESCED): it takes the plain path."""
        failed = self.answers(Cmd.OFFLOAD, State.OFFLOADED, ranks, deadline)
        if failed:  # back to QUIESCED (what the rest and a restore expect), memory reloaded if any went out
            again = self.answers(Cmd.RELOAD, State.QUIESCED, failed, time.monotonic() + ANSWER_TIMEOUT_S)
            if again:
                raise InterceptorError("a refused fast-path capture could not be undone",
                                       "; ".join(f"rank {r}: {why}" for r, why in again.items()),
                                       "see the workers' logs (lines 'cryosleep-nccl[PID]')", ranks=sorted(again))
        return failed

    def reload(self, ranks: Iterable[int], deadline: float) -> None:
        """RELOAD: device memory back at its addresses (after the CUDA restore and unlock)."""
        failed = self.answers(Cmd.RELOAD, State.QUIESCED, ranks, deadline)
        if failed:
            raise InterceptorError("device memory could not be brought back",
                                   "; ".join(f"rank {r}: {why}" for r, why in failed.items()),
                                   "see the workers' logs (lines 'cryosleep-nccl[PID]')", ranks=sorted(failed))

    def _state_text(self, rank: int) -> str:
        st, g = self.blocks[rank].state()
        return f"{STATE_NAMES.get(st, str(st))}({g})"

    # ---- drain -------------------------------------------------------------------------------------

    def views(self) -> list[RankView]:
        return [read_view(r, b) for r, b in self.blocks.items()]

    def _hold_ranks(self, ranks: list[int]) -> None:
        for r in ranks:
            b = self.blocks[r]
            b.zero_targets()
            b.bump_targets_gen()
            b.set_hold_deadline_ns(self.hold_deadline_ns)

    def hold(self, deadline: float) -> None:
        """HOLD with every target at 0: each thread stops at its next NCCL call. ``deadline`` is the
        snapshot's (monotonic seconds); the interceptors release a HOLD still in force a little after it."""
        self.hold_deadline_ns = int((deadline + HOLD_GRACE_S) * 1e9)
        self._hold_ranks(self.ranks)
        gen = self.command(Cmd.HOLD)
        self.wait(State.HOLDING, gen, min(deadline, time.monotonic() + ANSWER_TIMEOUT_S))

    def join_late_ranks(self, deadline: float) -> None:
        """Ranks that published their block after the HOLD (their first NCCL call) join it."""
        if self.discover is None:
            return
        fresh = dict(self.discover(set(self.blocks)))
        if not fresh:
            return
        self.log(f"ranks {sorted(fresh)} published their control blocks during the drain: holding them too")
        self.blocks.update(fresh)
        self.blocks = dict(sorted(self.blocks.items()))
        self._hold_ranks(list(fresh))
        for b in fresh.values():
            b.command(Cmd.HOLD, self.gen)
        self.wait(State.HOLDING, self.gen, min(deadline, time.monotonic() + ANSWER_TIMEOUT_S), ranks=fresh)

    def write_targets(self, targets: Targets, views: list[RankView]) -> dict[int, int]:
        """Writes every slot's targets that differ, then bumps each rank's targets_gen; returns those."""
        for v in views:
            b = self.blocks[v.rank]
            for s in v.comms:
                want = slot_targets(targets, s)
                if want != (s.coll_target, s.send_target, s.recv_target):
                    b.set_targets(s.index, *want)
        return {r: b.bump_targets_gen() for r, b in self.blocks.items()}

    def _wait_answers(self, gens: Mapping[int, int], deadline: float) -> None:
        nap = 0.0002
        while pending := [r for r, g in gens.items() if self.blocks[r].settled()[0] != g]:
            if time.monotonic() > deadline:
                return  # decide() sees who did not answer and gives up
            dead = self.exited(pending)
            if dead:
                self._raise_exited(dead, "their answer to the drain's targets")
            time.sleep(nap)
            nap = min(nap * 2, 0.005)

    def apply_targets(self, targets: Targets, deadline: float) -> list[RankView]:
        """One round of a drain decided elsewhere (the coordinator, over every node's ranks): the targets
        written, the ranks' answers awaited (until ``deadline``), their fresh views returned."""
        self._wait_answers(self.write_targets(targets, self.views()), deadline)
        return self.views()

    # ---- quiesce, rebuild, run ---------------------------------------------------------------------

    def quiesce(self, deadline: float) -> None:
        """QUIESCE(g) right after the drain: every rank destroys its real communicators."""
        gen = self.command(Cmd.QUIESCE)
        try:
            self.wait(State.QUIESCED, gen, max(deadline, time.monotonic() + ANSWER_TIMEOUT_S))
        except InterceptorError as e:
            raise CaptureFailed("the NCCL communicators could not be quiesced", f"{e.what}: {e.why}",
                                "the job was resumed and goes on running; see the workers' logs") from e
        late = sorted(self.discover(set(self.blocks))) if self.discover is not None else []
        if late:  # they ran free, outside the cut: capturing them now could split a communicator's creation
            raise CaptureFailed("ranks started using NCCL during the snapshot",
                                f"ranks {late} published their control blocks after the cut was reached",
                                "the job was resumed and goes on running; snapshot again", ranks=late)

    def rebuild(self, timeout: float = REBUILD_TIMEOUT_S) -> None:
        """REBUILD(g) on every rank, relaying fresh unique ids, until every rank answers RUNNING(g). The
        application's threads stay held until ``run()``."""
        gen = self.command(Cmd.REBUILD)
        self.rebuild_wait(gen, time.monotonic() + timeout)

    def _relay(self, gen: int, uids: Mapping[int, bytes]) -> list[int]:
        """One pass of the id relay for REBUILD(gen): each communicator's fresh id copied from its rank-0
        member's slot (or, for a member elsewhere, from ``uids``: ident -> id) into the other members' slots.
        Returns the communicators whose id is not known yet. Raises if a rank answered ERROR."""
        slots = [(r, b.comms()) for r, b in self.blocks.items()]
        relays, pending = relay_plan(slots, gen)
        for relay in relays:
            src_rank, src_index = relay.source
            uid_gen, uid = self.blocks[src_rank].uid(src_index)
            if uid_gen != gen:
                continue
            for dst_rank, dst_index in relay.dest:
                self.blocks[dst_rank].put_uid(dst_index, uid, gen)
        if uids:
            for r, ss in slots:
                for s in ss:
                    if s.rank != 0 and s.ident in uids and s.uid_gen != gen and s.rebuild == Rebuild.FROM_ID:
                        self.blocks[r].put_uid(s.index, uids[s.ident], gen)
            pending = [i for i in pending if i not in uids]
        failed = [f"rank {r}: {b.error}" for r, b in self.blocks.items() if b.state() == (State.ERROR, gen)]
        if failed:
            raise InterceptorError("the NCCL communicators could not be rebuilt", "; ".join(failed),
                                   "see the workers' logs (lines 'cryosleep-nccl[PID]')")
        return pending

    def rebuild_wait(self, gen: int, deadline: float, uids: Mapping[int, bytes] | None = None) -> None:
        """Relays ids until every rank answers RUNNING(gen) (``uids``: ids of communicators whose rank-0
        member runs on another node, relayed by the coordinator)."""
        nap = 0.0002
        limit = deadline - time.monotonic()
        while True:
            pending = self._relay(gen, uids or {})
            states = {r: b.state() for r, b in self.blocks.items()}
            if all(s == (State.RUNNING, gen) for s in states.values()):
                return
            if time.monotonic() > deadline:
                late = [f"rank {r} {self._state_text(r)}" for r, s in states.items() if s != (State.RUNNING, gen)]
                why = "still " + ", ".join(late)
                if pending:
                    why += "; no fresh id yet from the rank-0 member of " + ", ".join(f"{i:016x}" for i in pending)
                raise InterceptorError(f"the NCCL communicators were not rebuilt within {limit:.0f} s", why,
                                       "see the workers' logs (lines 'cryosleep-nccl[PID]')")
            time.sleep(nap)
            nap = min(nap * 2, 0.005)

    def published(self, gen: int, deadline: float) -> tuple[dict[int, bytes], list[int]]:
        """After REBUILD(gen) on a node of a multi-node job: waits until the rank-0 member of every communicator
        that has one here published its fresh id (relaying it to the members here meanwhile); returns those
        ids (ident -> id) and the communicators whose rank-0 member runs elsewhere (their ids must be relayed)."""
        members = [(b, s) for b in self.blocks.values() for s in b.comms()
                   if s.state == SlotState.LIVE and s.rebuild == Rebuild.FROM_ID]
        roots = {s.ident for _, s in members if s.rank == 0}
        need = sorted({s.ident for _, s in members} - roots)
        nap = 0.0002
        while True:
            pending = set(self._relay(gen, {})) & roots
            if not pending:
                break
            if time.monotonic() > deadline:
                raise InterceptorError("the NCCL communicators were not rebuilt in time",
                                       "no fresh id yet from the rank-0 member of " + ", ".join(
                                           f"{i:016x}" for i in sorted(pending)),
                                       "see the workers' logs (lines 'cryosleep-nccl[PID]')")
            time.sleep(nap)
            nap = min(nap * 2, 0.005)
        out: dict[int, bytes] = {}
        for b, s in members:
            if s.rank == 0:
                uid_gen, uid = b.uid(s.index)
                if uid_gen == gen:
                    out[s.ident] = uid
        return out, need

    def run(self, timeout: float = ANSWER_TIMEOUT_S) -> None:
        """RUN(g): every gate opens and the fast path is back."""
        gen = self.command(Cmd.RUN)
        self.wait(State.RUNNING, gen, time.monotonic() + timeout)
        self.touched = False

    def resume(self, retries: int = 1) -> None:
        """After a capture (or a restore): rebuild, then run. A rebuild that fails on some ranks is retried
        (the ranks that did rebuild are quiesced again first, so that every member re-creates the same
        communicators); the application's threads stay held until every rank has rebuilt."""
        for attempt in range(retries + 1):
            try:
                self.rebuild()
                break
            except InterceptorError as e:
                if attempt == retries:
                    raise
                self.log(f"rebuild failed ({e.why}); quiescing the rebuilt ranks and retrying")
                # the failure is seen as soon as one rank answers it: let the others finish their REBUILD first, or
                # a rank that goes live after this look would not be quiesced, and would not re-create its
                # communicators with the others on the retry (seen under load: the retry then hung)
                self.settle(time.monotonic() + REBUILD_TIMEOUT_S)
                live = [r for r, b in self.blocks.items() if b.comms_live]
                if live:
                    self.requiesce(live, time.monotonic() + REBUILD_TIMEOUT_S)
        self.run()

    def settle(self, deadline: float) -> list[int]:
        """Waits until no rank is REBUILDING (each has answered its REBUILD, either way), or the deadline; returns
        the ranks still rebuilding then."""
        nap = 0.0005
        while True:
            busy = [r for r, b in self.blocks.items() if b.state()[0] == State.REBUILDING]
            if not busy or time.monotonic() > deadline:
                return busy
            time.sleep(nap)
            nap = min(nap * 2, 0.01)

    def requiesce(self, ranks: list[int], deadline: float) -> None:
        """Quiesces ranks that are live and exactly at the cut (targets = their own counters)."""
        for r in ranks:
            b = self.blocks[r]
            for s in b.comms():
                b.set_targets(s.index, s.seq, s.send, s.recv)
            b.bump_targets_gen()
            b.set_hold_deadline_ns(int((deadline + HOLD_GRACE_S) * 1e9))
        gen = self.command(Cmd.HOLD, ranks)
        self.wait(State.HOLDING, gen, deadline, ranks)
        gen = self.command(Cmd.QUIESCE, ranks)
        self.wait(State.QUIESCED, gen, deadline, ranks)
