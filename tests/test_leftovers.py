"""The rule for leftovers of dead writers (records/leftovers.py), pure: names and who is gone."""

from __future__ import annotations

from lightning_datastates.records.leftovers import (
    TEMP_SUFFIX,
    LeftoverOwner,
    leftover_name,
    parse_leftover_name,
    this_process,
    writer_gone,
)

HERE = LeftoverOwner("node-1", 100)


def _alive(pid: int) -> bool:
    return pid in (100, 200)


def test_a_leftover_name_tells_its_writer_and_never_matches_ckpt() -> None:
    name = leftover_name("epoch=1.ckpt", TEMP_SUFFIX)
    assert name.startswith(".epoch=1.ckpt.") and name.endswith(TEMP_SUFFIX) and not name.endswith(".ckpt")
    parsed = parse_leftover_name(name, TEMP_SUFFIX)
    assert parsed is not None and parsed.name == "epoch=1.ckpt" and parsed.owner == this_process()
    assert parse_leftover_name(name, ".datastates-upload") is None  # another kind of leftover
    for other in ("epoch=1.ckpt", f"plain{TEMP_SUFFIX}", f".x.host.notapid.0123abcd{TEMP_SUFFIX}"):
        assert parse_leftover_name(other, TEMP_SUFFIX) is None


def test_a_leftover_name_is_shortened_to_fit() -> None:
    name = leftover_name("m" * 300, TEMP_SUFFIX, max_length=255)
    assert len(name) == 255
    parsed = parse_leftover_name(name, TEMP_SUFFIX)
    assert parsed is not None and parsed.owner == this_process()


def test_writer_gone_asks_this_host_and_waits_for_others() -> None:
    def gone(owner: LeftoverOwner | None, age_s: float | None, tracks: bool = False) -> bool:
        return writer_gone(owner, age_s, 3600.0, tracks_own_writes=tracks, here=HERE, alive=_alive)

    assert not gone(LeftoverOwner("node-1", 200), 1e9)  # alive on this host: kept, however old
    assert gone(LeftoverOwner("node-1", 300), 0.0)  # dead on this host: gone at once
    assert not gone(HERE, 1e9)  # this process, which cannot tell its writes in flight: kept
    assert gone(HERE, 0.0, tracks=True)  # this process, its writes in flight already set aside: gone
    assert not gone(LeftoverOwner("node-2", 300), 60.0)  # another host: kept while young
    assert gone(LeftoverOwner("node-2", 300), 3601.0)  # ... gone once old
    assert not gone(None, 60.0) and gone(None, 3601.0) and gone(None, None)  # no owner known; unknown age is old
