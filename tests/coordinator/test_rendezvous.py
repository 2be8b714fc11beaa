"""The restore's board at the coordinator (coordinator/rendezvous.py), over real HTTP."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from cryosleep.agent import coordinated
from cryosleep.agent.coordinated import RestoreRendezvous
from cryosleep.coordinator import rendezvous
from cryosleep.errors import InterceptorError, NotEligible, UsageError
from tests.coordinator.helpers import Env


def test_posts_and_reads_by_prefix_per_snapshot(env: Env) -> None:
    c = env.client()
    assert c.rendezvous("s1", {"ready/0": {"ok": True}, "uid/a/1": "00ff"}) == {}
    got = c.rendezvous("s1", prefix="ready/")
    assert list(got) == ["ready/0"] and got["ready/0"]["value"] == {"ok": True} and got["ready/0"]["age_s"] >= 0
    assert c.rendezvous("s2", prefix="") == {}  # another snapshot's board is empty


def test_a_read_waits_for_enough_keys_and_wakes_when_they_come(env: Env) -> None:
    c = env.client()
    t = threading.Timer(0.3, lambda: env.client().rendezvous("s", {"ready/1": {"ok": True}}))
    t.start()
    start = time.monotonic()
    got = c.rendezvous("s", {"ready/0": {"ok": True}}, prefix="ready/", min_keys=2, wait_s=10)
    took = time.monotonic() - start
    t.join()
    assert sorted(got) == ["ready/0", "ready/1"] and 0.2 < took < 5
    start = time.monotonic()
    got = c.rendezvous("s", prefix="ready/", min_keys=3, wait_s=0.5)  # never comes: the wait ends
    assert len(got) == 2 and 0.4 < time.monotonic() - start < 5


def test_entries_expire_and_a_board_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    b = rendezvous.Board()
    b.exchange("s", {"k": 1})
    monkeypatch.setattr(rendezvous, "KEEP_S", 0.0)
    time.sleep(0.01)
    assert b.exchange("s", prefix="") == {"items": {}}
    monkeypatch.setattr(rendezvous, "MAX_KEYS", 2)
    with pytest.raises(UsageError, match="too many keys"):
        b.exchange("s", {"a": 1, "b": 2, "c": 3})


# ---- the nodes' side: agent/coordinated.py's RestoreRendezvous over the board --------------------------------

def node(env: Env, rank: int, timeout: float = 20.0) -> RestoreRendezvous:
    return RestoreRendezvous(env.client(), "snap", rank, 2, timeout)


def barrier_in_thread(rv: RestoreRendezvous, gen: int = 3) -> tuple[threading.Thread, list[BaseException | None]]:
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            rv.barrier(gen)
            out.append(None)
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def both_pass(env: Env, gens: tuple[int, int] = (3, 3)) -> tuple[RestoreRendezvous, RestoreRendezvous]:
    """Nodes 0 and 1 of one attempt, past the barrier together."""
    a, b = node(env, 0), node(env, 1)
    t, out = barrier_in_thread(a, gens[0])
    b.barrier(gens[1])
    t.join(10)
    assert out == [None] and a.attempt == b.attempt != ""
    return a, b


def test_every_node_passes_the_barrier_with_one_attempt_and_generation(env: Env) -> None:
    a, b = both_pass(env, (3, 7))
    assert a.generation() == b.generation() == 7 + 16


def test_a_failure_posted_before_this_node_began_still_stops_it(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    # the race the CI run found: node 1 fails its checks before node 0's restore has even begun; node 0 must not
    # wait out its whole timeout for a node that is not coming
    monkeypatch.setattr(coordinated, "READY_FRESH_S", 1.0)
    node(env, 1).failed(["image node-1/pages-1.img: checksum mismatch"])
    time.sleep(0.1)
    a = node(env, 0, timeout=30)
    start = time.monotonic()
    with pytest.raises(NotEligible, match="another node cannot take its image") as e:
        a.barrier(3)
    assert 0.9 < time.monotonic() - start < 10
    assert "node 1 on" in e.value.why and "checksum mismatch" in e.value.why and "before this restore" in e.value.why
    # and node 0 withdrew: it does not count as ready for anyone else
    assert env.client().rendezvous("snap", prefix="ready/0")["ready/0"]["value"]["ok"] is None


def test_a_failure_posted_while_waiting_stops_at_once(env: Env) -> None:
    a = node(env, 0, timeout=30)
    t, out = barrier_in_thread(a)
    time.sleep(0.3)
    start = time.monotonic()
    node(env, 1).failed(["no GPU 1 here"])
    t.join(10)
    assert isinstance(out[0], NotEligible) and "no GPU 1 here" in out[0].why and "before" not in out[0].why
    assert time.monotonic() - start < 5


def test_a_retry_is_not_stopped_by_the_failure_of_an_earlier_attempt(env: Env,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coordinated, "READY_FRESH_S", 1.0)
    node(env, 1).failed(["disk full"])  # the first attempt
    # the retry: node 0 starts first and waits past READY_FRESH_S; node 1 announces itself on starting, then takes
    # a while (fetching its image) before its own barrier
    a, b = node(env, 0), node(env, 1)
    b.announce()
    t, out = barrier_in_thread(a)
    time.sleep(1.5)
    assert out == []
    b.barrier(3)
    t.join(10)
    assert out == [None] and a.attempt == b.attempt


def test_a_node_failing_past_the_barrier_ends_the_others_wait_for_its_ids(env: Env) -> None:
    a, b = both_pass(env)
    b.failed(["criu restore failed: see node 1's log"])
    start = time.monotonic()
    with pytest.raises(InterceptorError, match="could not be rebuilt") as e:
        a.exchange(a.generation(), {1: b"\x01" * 128}, [2], time.monotonic() + 60)
    assert "node 1 on" in e.value.why and "criu restore failed" in e.value.why and time.monotonic() - start < 3


def test_ids_cross_between_nodes_of_one_attempt_only(env: Env) -> None:
    old_a, _ = both_pass(env)  # an earlier attempt that posted its ids, then failed
    old_a.exchange(old_a.generation(), {5: b"\x05" * 128}, [], time.monotonic() + 5)
    a, b = both_pass(env)
    assert a.attempt != old_a.attempt
    got: list[dict[int, bytes]] = []
    t = threading.Thread(target=lambda: got.append(b.exchange(b.generation(), {}, [5], time.monotonic() + 10)))
    t.start()
    time.sleep(0.5)
    assert got == []  # the earlier attempt's id for communicator 5 is not taken
    a.exchange(a.generation(), {5: b"\x55" * 128}, [], time.monotonic() + 5)
    t.join(10)
    assert got == [{5: b"\x55" * 128}]


def test_a_node_that_passed_an_earlier_attempt_does_not_pass_a_retry_for_it(env: Env) -> None:
    # the first attempt: both nodes passed the barrier, then it failed (say CRIU on node 1); node 1's retry
    # begins at once, and node 0's entry (ready, fresh) must not let it pass alone
    both_pass(env)
    retry = node(env, 1, timeout=1.5)
    with pytest.raises(NotEligible, match="not every node came") as e:
        retry.barrier(3)
    assert "[0]" in e.value.why


# ---- the job network's peers, learned on the run's board (agent/coordinated.py's NetPeers) -------------------

def net_peers(env: Env, run: str, rank: int, nnodes: int, ip: str, apply: Any) -> coordinated.NetPeers:
    n = coordinated.NetPeers(env.client(), run, rank, nnodes, ip, apply, lambda _m: None)
    n.wait_s = 0.0
    return n


def test_run_nodes_learn_each_others_underlay_and_drop_one_that_stopped_posting(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    applied: dict[int, list[list[str]]] = {0: [], 1: [], 2: []}
    nodes = [net_peers(env, "run1", r, 3, f"10.9.0.{r + 1}", applied[r].append) for r in range(3)]
    assert nodes[0].step() is False and applied[0] == [[]]  # alone on the board: no peer yet, told once
    assert nodes[1].step() is False and applied[1] == [["10.9.0.1"]]
    assert nodes[0].step() is False and applied[0] == [[], ["10.9.0.2"]]  # node 1 came: added
    assert nodes[2].step() is True and applied[2] == [["10.9.0.1", "10.9.0.2"]]
    assert nodes[0].step() is True and applied[0][-1] == ["10.9.0.2", "10.9.0.3"]
    assert nodes[0].step() is True and len(applied[0]) == 3  # no change: the overlay is left alone
    other = net_peers(env, "run2", 0, 2, "10.9.1.1", lambda _p: None)
    assert other.round() == ([], 0)  # another run's board
    same = net_peers(env, "run2", 1, 2, "10.9.1.1", lambda _p: None)
    assert same.step() is True and same.applied == []  # the other node is on this host: no overlay peer needed
    monkeypatch.setattr(coordinated, "NET_FRESH_S", 0.3)  # node 2 stops posting (its job ended, say)
    time.sleep(0.5)
    nodes[1].round()
    assert nodes[0].step() is False and applied[0][-1] == ["10.9.0.2"]
    monkeypatch.setattr(coordinated, "NET_FRESH_S", 35.0)  # it comes back on another host
    node2 = net_peers(env, "run1", 2, 3, "10.9.2.7", applied[2].append)
    assert node2.step() is True and nodes[0].step() is True and applied[0][-1] == ["10.9.0.2", "10.9.2.7"]


def test_after_stop_the_overlay_is_never_changed(env: Env) -> None:
    """The agent stops its NetPeers when the job ends, then releases the job's network: an update under way when
    stop() is called finishes first, and a round that ends after it applies nothing (it would recreate the
    overlay that the release removes)."""
    entered, release, applied = threading.Event(), threading.Event(), []

    def slow_apply(peers: list[str]) -> None:
        entered.set()
        release.wait(10)
        applied.append(peers)

    a = net_peers(env, "run3", 0, 2, "10.9.4.1", slow_apply)
    b = net_peers(env, "run3", 1, 2, "10.9.4.2", applied.append)
    b.round()
    t = threading.Thread(target=a.step)
    t.start()
    assert entered.wait(10)
    stopper = threading.Thread(target=a.stop)
    stopper.start()
    stopper.join(0.3)
    assert stopper.is_alive()  # waits for the update under way
    release.set()
    stopper.join(10)
    t.join(10)
    assert applied == [["10.9.4.2"]]
    b.stop()
    assert b.step() is False and applied == [["10.9.4.2"]]  # b had applied nothing; after stop it never will


def test_the_restore_barrier_hands_each_node_the_others_underlay(env: Env) -> None:
    rvs = [RestoreRendezvous(env.client(), "snapnet", r, 2, 20.0, underlay=f"10.9.3.{r + 1}") for r in range(2)]
    threads = [barrier_in_thread(rv) for rv in rvs]
    for t, out in threads:
        t.join(30)
        assert out == [None], out
    assert rvs[0].peers == ["10.9.3.2"] and rvs[1].peers == ["10.9.3.1"]


def test_a_restored_node_keeps_the_peers_of_its_barrier_until_they_had_the_time_to_post(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 0 restored, its peer learned at the barrier and applied; node 1, restored a moment later, has on the
    board only its old run's entry, stale: node 0's first round must not drop it from the overlay (the job's TCP
    between the nodes would stall until node 1 posts again, NET_REPOST_S later)."""
    old = net_peers(env, "run4", 1, 2, "10.9.5.2", lambda _p: None)
    old.round()  # the run before the snapshot
    monkeypatch.setattr(coordinated, "NET_FRESH_S", 0.3)
    time.sleep(0.5)  # ... long ago
    applied: list[list[str]] = []
    n = coordinated.NetPeers(env.client(), "run4", 0, 2, "10.9.5.1", applied.append, lambda _m: None,
                             known=["10.9.5.2"])
    n.wait_s = 0.0
    n.since = time.monotonic() + 10  # within its grace (NET_FRESH_S after it started)
    assert n.round() == ([], 0)  # the board alone would say: no peer
    n.step()
    assert applied == []  # the barrier's peer is kept, the overlay untouched
    n.since = time.monotonic() - 10  # past the grace, a peer that never posts is dropped as before
    n.step()
    assert applied == [[]]
