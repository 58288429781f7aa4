"""The trainer through a real S3 endpoint (moto's standalone server over HTTP)."""
import torch

from crucible.train import train
from tests.unit.helpers import tiny


def test_local_and_s3_stores_give_identical_training(tmp_path, s3_endpoint, s3_bucket):
    cfg = tiny(**{"faults.p": 0.5, "faults.duration": 2, "train.checkpoint_every": 2})
    local = train(cfg, out_dir=tmp_path / "local")
    s3cfg = tiny(**{"faults.p": 0.5, "faults.duration": 2, "train.checkpoint_every": 2,
                    "store.url": f"s3://{s3_bucket}/runs", "store.endpoint_url": s3_endpoint})
    remote = train(s3cfg, out_dir=tmp_path / "s3")
    assert remote["store_url"].startswith("s3://")
    for key in ("final_val_loss", "evals", "bytes", "contributions", "faults", "inner_steps"):
        assert remote[key] == local[key], key
    from crucible.store import open_store
    store = open_store(remote["store_url"], endpoint_url=s3_endpoint)
    keys = store.list(remote["run_key"])
    assert any(k.endswith("manifest.json") for k in keys)
    assert any("/checkpoints/step-" in k for k in keys)
    assert torch.tensor(remote["final_val_loss"]).isfinite()
