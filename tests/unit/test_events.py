import json

import pytest

from crucible.events import Event, JsonlCallback, Metric


def test_jsonl_sink_stores_each_record_once_across_reopens(tmp_path):
    sink = JsonlCallback(tmp_path)
    sink.metric(Metric("train_loss", 1, 2.5, replica=0))
    sink.event(Event("bypass", 1, replica=0, stage=1, detail={"strategy": "skip"}))
    sink.close()
    again = JsonlCallback(tmp_path)
    again.metric(Metric("train_loss", 1, 2.5, replica=0))       # a resumed run replays step 1
    again.metric(Metric("train_loss", 2, 2.0, replica=0))
    again.event(Event("bypass", 1, replica=0, stage=1, detail={"strategy": "skip"}))
    again.close()
    metrics = (tmp_path / "metrics.jsonl").read_text().splitlines()
    events = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(m)["global_step"] for m in metrics] == [1, 2]
    assert len(events) == 1 and json.loads(events[0])["id"] == "bypass:1:0:1:0"


def test_a_torn_last_line_is_dropped_before_appending(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"name": "val_loss", "global_step": 1, "value": 3.0, '
                                            '"tokens": null, "replica": null}\n{"name": "val_')
    sink = JsonlCallback(tmp_path)
    sink.metric(Metric("val_loss", 2, 2.5))
    sink.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["global_step"] for m in lines] == [1, 2]


def test_unknown_event_kind_is_refused():
    with pytest.raises(ValueError, match="allowed: failure_start"):
        Event("explode", 1)
