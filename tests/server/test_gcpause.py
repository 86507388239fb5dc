"""ditattn.server.gcpause: the collector's time is counted, and freezing takes the loaded objects out of later
collections."""

import gc

from ditattn.server import gcpause


def test_collector_time_is_counted_once_installed():
    gcpause.install()
    gcpause.install()  # idempotent: one callback, not two
    assert gc.callbacks.count(gcpause._track) == 1
    before = gcpause.seconds()
    junk = [[i] for i in range(200_000)]  # many tracked objects: a full collection walks them
    gc.collect()
    del junk
    assert gcpause.seconds() > before


def test_freeze_loaded_moves_what_is_alive_out_of_collections():
    loaded = [{"layer": i} for i in range(5_000)]
    try:
        frozen = gcpause.freeze_loaded()
        assert frozen == gc.get_freeze_count() >= len(loaded)
        gen2 = gc.get_objects(generation=2)
        assert not any(o is loaded for o in gen2)  # the permanent generation is not walked
    finally:
        gc.unfreeze()  # the rest of the test session collects as before
