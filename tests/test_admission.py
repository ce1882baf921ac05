"""The pure decisions of capture admission (capture/admission.py): how many checkpoints may be in flight, and when
earlier checkpoints hold arena space a new one needs."""

from __future__ import annotations

from lightning_datastates.capture.admission import arena_shortfall, pending_limit


def test_two_checkpoints_per_writer_and_never_fewer_than_two_in_flight() -> None:
    assert [pending_limit(n) for n in (1, 2, 4)] == [2, 4, 8]


def test_an_empty_arena_never_falls_short() -> None:
    assert arena_shortfall(payload_bytes=10**9, arena_bytes=100, held_bytes=0) is None


def test_held_space_falls_short_only_when_the_rest_is_smaller_than_the_payload() -> None:
    assert arena_shortfall(payload_bytes=10, arena_bytes=100, held_bytes=80) is None
    assert arena_shortfall(payload_bytes=30, arena_bytes=100, held_bytes=80) == (
        "the host arena (100 bytes) holds 80 bytes of earlier checkpoints"
    )


def test_a_payload_larger_than_the_arena_needs_all_of_it() -> None:
    # It streams through the arena: any byte held by earlier checkpoints makes it wait.
    assert arena_shortfall(payload_bytes=500, arena_bytes=100, held_bytes=1) is not None
