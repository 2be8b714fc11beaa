"""The drain's decision (coordinator/drain.py): pure, with its reasons."""

from __future__ import annotations

from cryosleep.coordinator.drain import MIGRATE, SUSPEND, decide, fall_back


def test_a_spare_with_nodes_staying_elsewhere_migrates_only_the_drained_nodes() -> None:
    d = decide("exp", "hostB", [1], 2, ["hostC"], "")
    assert d.action == MIGRATE and d.spare == ["hostC"] and d.nodes == [1]
    assert "only those nodes move (node 1 to hostC)" in d.reasons[2]


def test_no_spare_or_no_node_to_stay_suspends_and_queues() -> None:
    d = decide("exp", "hostB", [1], 2, [], "node 1 needs a host with no GPU in particular")
    assert d.action == SUSPEND and "no free compatible spare: node 1 needs a host" in d.reasons[1]
    every = decide("exp", "hostB", [1, 0], 2, ["hostC", "hostD"], "")
    assert every.action == SUSPEND and every.nodes == [0, 1] and "none would hold at the cut" in every.reasons[2]


def test_a_failed_migration_falls_back_saying_why() -> None:
    d = decide("exp", "hostB", [1], 2, ["hostC"], "")
    d.migration = "exp-1"
    fall_back(d, "node 1 persisted no image")
    assert d.action == SUSPEND and "the migration exp-1 failed (node 1 persisted no image)" in d.reasons[-1]
