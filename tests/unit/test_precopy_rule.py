"""capture/precopy.py's rule for a job whose pre-copy saves little: the next snapshots dump plain, and every
RETRY_EVERY-th tries again."""

from __future__ import annotations

from pathlib import Path

from cryosleep.capture import precopy
from cryosleep.capture.track import Tracker
from cryosleep.store.manifest import PRECOPY_PARENT, Precopy


def test_a_pre_copy_that_saved_little_makes_the_next_snapshots_plain_until_a_retry(tmp_path: Path) -> None:
    t = Tracker(tmp_path / "track")
    assert precopy.worth_it(t) == ""  # no pre-copy yet: try it
    precopy.learn(t, Precopy(parent=PRECOPY_PARENT, pages_parent=900), pages_written=100)
    assert t.last_share == 0.9 and precopy.worth_it(t) == ""
    precopy.learn(t, Precopy(parent=PRECOPY_PARENT, pages_parent=160), pages_written=840)  # rewrote 84% since
    plain = [precopy.worth_it(t) for _ in range(2 * precopy.RETRY_EVERY)]
    assert "16%" in plain[0] and "rewrote" in plain[0]
    tried = [i for i, why in enumerate(plain) if not why]  # every RETRY_EVERY-th snapshot pre-copies again
    assert tried == [precopy.RETRY_EVERY - 1, 2 * precopy.RETRY_EVERY - 1], plain
    precopy.learn(t, Precopy(parent=PRECOPY_PARENT, pages_parent=0), pages_written=0)  # no pages: nothing learnt
    assert t.last_share == 0.16
    t.close()
