import gc

from pipeline.collector import YOUNG_COLLECTION_EVERY, collecting_less, collector_off, collector_time


def test_collector_time_sums_the_collections_inside_the_block_and_stops_after():
    callbacks = list(gc.callbacks)
    with collector_time() as spent:
        gc.collect()
        gc.collect()
    assert spent[0] > 0
    assert gc.callbacks == callbacks
    after = spent[0]
    gc.collect()
    assert spent[0] == after


def test_collector_off_holds_the_collector_off_and_leaves_it_as_it_found_it():
    with collector_off():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_off():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_collecting_less_sets_the_process_settings_and_restores_them():
    threshold = gc.get_threshold()
    with collecting_less():
        assert gc.get_threshold() == (YOUNG_COLLECTION_EVERY, *threshold[1:])
        assert gc.get_freeze_count() > 0  # what existed is out of the generations
    assert gc.get_threshold() == threshold
    assert gc.get_freeze_count() == 0
