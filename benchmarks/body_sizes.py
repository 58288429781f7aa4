"""Bytes of the largest batches a client sends, against the API's per-endpoint body limits
(`api.middleware.BODY_LIMITS`): 10,000 items (the item limit of a batch), serialised compactly
(httpx), as `json.dumps` writes them, and indented. Metrics carry every field at its widest
value the schema allows; events are the widest kinds the trainer emits (`rejoin` with its reset
list, `contribution_rejected` with a long reason) with every integer at its widest. Prints one
JSON object.

    python -m benchmarks.body_sizes
"""
from __future__ import annotations

import json

from api.middleware import BODY_LIMITS
from api.schemas import MAX_BATCH_ITEMS, MAX_INT, MAX_SMALL

_REASON = ("contribution norm 1.234e+04 is 250.0x the round median 4.936e+01 (limit 10x): "
           "rejected")
_ITEMS = {
    "metrics, widest": ("metrics", {"name": "train_loss", "global_step": MAX_INT,
                                    "tokens": MAX_INT, "replica": MAX_SMALL,
                                    "value": -2.2250738585072014e-308}),
    "events, contribution_rejected": ("events", {
        "id": f"contribution_rejected:{MAX_INT}:{MAX_SMALL}:{MAX_SMALL}:0",
        "kind": "contribution_rejected", "global_step": MAX_INT, "replica": MAX_SMALL,
        "stage": MAX_SMALL, "detail": {"reason": _REASON}}),
    "events, rejoin": ("events", {
        "id": f"rejoin:{MAX_INT}:{MAX_SMALL}:{MAX_SMALL}:0", "kind": "rejoin",
        "global_step": MAX_INT, "replica": MAX_SMALL, "stage": MAX_SMALL,
        "detail": {"reset": ["adamw_moments", "adamw_step", "error_feedback",
                             "stiefel_momentum"], "down_steps": MAX_SMALL}}),
}


def main() -> None:
    result = {}
    for label, (endpoint, item) in _ITEMS.items():
        body = {"items": [item] * MAX_BATCH_ITEMS}
        result[label] = {
            "compact": len(json.dumps(body, separators=(",", ":")).encode()),
            "json_dumps": len(json.dumps(body).encode()),
            "indent_2": len(json.dumps(body, indent=2).encode()),
            "limit": BODY_LIMITS[endpoint],
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
