"""bench/load/timeline.py on hand-made timelines: stages joined by request id, the
dominant stage, and the picture."""

from __future__ import annotations

import matplotlib.image

from bench.load import timeline

T = 1_000.0


def timelines() -> dict[str, list[dict]]:
    # r1 went through a prefill server; r2 was prefilled on the decode server; r3 is not ours.
    return {
        "router": [
            {"request_id": "r1", "arrived": T, "opened": T + 0.2, "first_token": T + 1.6, "last_token": T + 2.0},
            {"request_id": "r2", "arrived": T + 0.5, "opened": T + 0.6, "first_token": T + 0.9, "last_token": T + 1.1},
            {"request_id": "r3", "arrived": T, "opened": T + 0.1},
            {"request_id": "r4", "arrived": T + 3, "opened": T + 3.1, "first_token": T + 3.2, "last_token": T + 3.3},
        ],
        "decode": [
            {"request_id": "r1", "reserved": T + 0.1, "kv_arrived": T + 1.5, "first_token": T + 1.6},
            {"request_id": "r2", "reserved": T + 0.55, "first_token": T + 0.9},
        ],
        "prefill": [
            {
                "request_id": "r1",
                "received": T + 0.25,
                "computing": T + 0.5,
                "prefilled": T + 1.4,
                "transfer_ended": T + 1.45,
            }
        ],
    }


def test_stages_are_joined_by_request_id_in_order_of_arrival():
    r1, r2 = timeline.join(timelines(), ["r1", "r2"])
    assert r1.request_id == "r1" and r2.request_id == "r2"
    assert [(n, round(a - T, 2), round(b - T, 2)) for n, a, b in r1.stages] == [
        ("router wait", 0.0, 0.1),
        ("reservation", 0.1, 0.2),
        ("prefill queue", 0.25, 0.5),
        ("prefill compute", 0.5, 1.4),
        ("KV after compute", 1.4, 1.5),
        ("decode", 1.5, 2.0),
    ]
    # r2 was prefilled on the decode server: its first token splits that from decoding
    assert [(n, round(a - T, 2), round(b - T, 2)) for n, a, b in r2.stages] == [
        ("router wait", 0.5, 0.55),
        ("prefill on D", 0.55, 0.9),
        ("decode", 0.9, 1.1),
    ]
    assert [r.request_id for r in timeline.join(timelines())] == ["r1", "r2", "r4"]  # r3 never finished


def test_the_dominant_stage_is_the_one_with_the_most_time():
    reqs = timeline.join(timelines(), ["r1", "r2"])
    name, share = timeline.dominant(reqs)
    # r1: 0.1 wait + 0.1 reservation + 0.25 queue + 0.9 compute + 0.1 KV + 0.5 decode;
    # r2: 0.05 wait + 0.35 prefill on D + 0.2 decode
    assert name == "prefill compute" and abs(share - 0.9 / 2.55) < 1e-9
    assert timeline.summary_line(reqs).startswith("timeline: dominant stage prefill compute (35% of staged time)")


def test_the_picture_has_one_bar_per_request(tmp_path):
    path = timeline.plot(timeline.join(timelines()), tmp_path / "t.png", title="hand-made")
    height, width, _ = matplotlib.image.imread(path).shape
    assert width > 1000 and height > 300
