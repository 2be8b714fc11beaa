"""The test's agent for the interceptor's own tests: the package's control-block reader/writer
(``cryosleep.core.interceptor``), the node's side of the protocol (``cryosleep.cut.driver``) and the drain's
rounds the snapshot sequence runs (``cryosleep.cut.rules.to_cut``), with the short names and fixed timeouts
these tests use. There is one implementation of the protocol; this only adapts it."""

from __future__ import annotations

import time

from cryosleep.core.interceptor import BLOCK_SIZE, Cmd, ControlBlock, Rebuild, State
from cryosleep.cut.driver import Driver
from cryosleep.cut.rules import Action, CommTarget, Decision, RankView, Targets, to_cut
from cryosleep.errors import InterceptorError

__all__ = ["BLOCK_SIZE", "CMD_QUIESCE", "REBUILD_ID", "REBUILD_SPLIT", "ST_HOLDING", "ST_QUIESCED", "Agent",
           "CommTarget", "Ctl", "CtlError", "drain"]

Ctl = ControlBlock
CtlError = InterceptorError
CMD_QUIESCE = Cmd.QUIESCE
REBUILD_ID, REBUILD_SPLIT = Rebuild.FROM_ID, Rebuild.SPLIT
ST_HOLDING, ST_QUIESCED = State.HOLDING, State.QUIESCED


def drain(driver: Driver, deadline: float) -> Decision:
    """The drain as a snapshot runs it on one node (``coordinator/machine.py``'s drain over
    ``agent/coordinated.py``'s targets and report operations): ``to_cut``'s rounds, each carried out by the
    driver. Raises CtlError when the ranks give up short of the cut."""

    def ask(_round: int, targets: Targets | None) -> list[RankView]:
        if targets is None:  # the targets stand: the ranks move on toward them
            time.sleep(0.002)
            return driver.views()
        return driver.apply_targets(targets, deadline)

    d, _, _ = to_cut(driver.views(), ask, deadline, time.monotonic)
    if d.action is not Action.DONE:
        raise CtlError("the ranks did not reach a consistent cut", d.reason)
    return d


class Agent(Driver):
    """The driver over a list of blocks (job rank = position), every step bounded by ``timeout``."""

    def __init__(self, ctls: list[ControlBlock], timeout: float = 10.0) -> None:
        super().__init__(dict(enumerate(ctls)))
        self.timeout = timeout

    def command_all(self, cmd: Cmd) -> int:
        return self.command(cmd)

    def hold(self, targets: dict[int, CommTarget] | None = None,  # type: ignore[override]
             release_after: float | None = None) -> int:
        """HOLD (every thread stops at its next call), then the given targets if any; returns its generation.
        ``release_after``: the interceptors release the HOLD by themselves after that many seconds."""
        super().hold(time.monotonic() + self.timeout)
        if release_after is not None:
            for b in self.blocks.values():
                b.set_hold_deadline(release_after)
        if targets:
            self.write_targets(targets, self.views())
        return self.gen

    def drain(self) -> Decision:
        return drain(self, time.monotonic() + self.timeout)

    def quiesce(self) -> None:  # type: ignore[override]
        super().quiesce(time.monotonic() + self.timeout)

    def wait_error(self, gen: int) -> list[str]:
        """Waits for ERROR(gen) on every rank; returns their error texts."""
        deadline = time.monotonic() + self.timeout
        for r, b in self.blocks.items():
            while b.state() != (State.ERROR, gen):
                if time.monotonic() > deadline:
                    raise CtlError(f"rank {r}: {self._state_text(r)}, not ERROR({gen})")
                time.sleep(0.002)
        return [b.error for b in self.blocks.values()]
