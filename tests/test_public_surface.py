"""``DataStatesIO`` shows Lightning's ``CheckpointIO`` and the documented user API, nothing else: the wiring that the
callback, the metrics, the demo, the benchmark and the tests use lives on its ``CheckpointPipeline``
(``lightning_datastates.plugin.pipeline_of``)."""

from __future__ import annotations

import pickle

from lightning.pytorch.plugins.io import CheckpointIO

from lightning_datastates import DataStatesIO

#: Lightning's interface, which the plugin implements.
CHECKPOINT_IO = {"save_checkpoint", "load_checkpoint", "remove_checkpoint", "teardown"}
#: The documented user API (README: ``plugin.stats``, ``plugin.drain()``; the settings as ``plugin.config``).
USER_API = {"config", "stats", "drain"}
#: What the plugin used to show beside those, now on its pipeline.
WIRING = {
    "engine",
    "lazy_for_save",
    "counts_as_existing",
    "prepare_arena",
    "prepare_planning",
    "saves_sharded",
    "barrier",
    "is_pending",
    "raise_pending_failure",
    "clean_stale",
    "clean_once",
    "arena_occupancy",
    "enable_sharded",
    "disable_sharded",
    "attach",
    "detach",
    "writer_for",
}


def _public(names: list[str]) -> set[str]:
    return {name for name in names if not name.startswith("_")}


def test_checkpoint_io_contributes_its_four_methods_only() -> None:
    assert _public(dir(CheckpointIO)) == CHECKPOINT_IO


def test_the_plugin_shows_checkpoint_io_and_the_user_api_only() -> None:
    # Names inherited as they are (not overridden by DataStatesIO) do not count; CheckpointIO's four are overridden.
    inherited = {name for name in _public(dir(CheckpointIO)) | _public(dir(object)) if name not in vars(DataStatesIO)}
    assert _public(dir(DataStatesIO())) - inherited == CHECKPOINT_IO | USER_API


def test_the_wiring_is_on_the_pipeline() -> None:
    from lightning_datastates.pipeline import CheckpointPipeline
    from lightning_datastates.plugin import pipeline_of

    plugin = DataStatesIO()
    pipeline = pipeline_of(plugin)
    assert isinstance(pipeline, CheckpointPipeline) and pipeline_of(plugin) is pipeline
    assert pipeline.config is plugin.config
    assert WIRING | {"drain", "stats"} <= _public(dir(pipeline))
    assert not WIRING & _public(dir(plugin))


def test_a_pickled_plugin_gets_a_fresh_pipeline_with_the_same_settings(tmp_path) -> None:
    from lightning_datastates.plugin import pipeline_of

    plugin = DataStatesIO(host_cache="8MiB", writer_threads=2)
    pipeline = pipeline_of(plugin)
    pipeline.writer_for(str(tmp_path / "a.ckpt"))
    pipeline.clean_stale(str(tmp_path))
    assert pipeline.attach(object())  # type: ignore[arg-type]
    clone = pickle.loads(pickle.dumps(plugin))
    fresh = pipeline_of(clone)
    assert fresh is not pipeline and fresh.config == plugin.config and fresh.config is clone.config
    assert fresh._engine is None and fresh._owner is None and fresh._writers == {}
    assert fresh._cleaned_directories == set() and fresh._sharded is None
