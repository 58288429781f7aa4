"""SparseLoCo against DiLoCo on the `small` preset: nearly the same loss for >100x fewer bytes."""
import pytest

from crucible.config import apply_overrides
from crucible.presets import get_preset
from crucible.train import train


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sparseloco_matches_diloco_on_small_with_100x_fewer_bytes(tmp_path):
    runs = {method: train(apply_overrides(get_preset("small"), [f"sparseloco.method={method}"]),
                          out_dir=tmp_path / method)
            for method in ("sparseloco", "diloco")}
    sparse, dense = runs["sparseloco"], runs["diloco"]
    assert sparse["final_val_loss"] < 0.6 * sparse["initial_val_loss"]
    assert abs(sparse["final_val_loss"] - dense["final_val_loss"]) / dense["final_val_loss"] < 0.05
    assert dense["bytes"]["upload"] > 100 * sparse["bytes"]["upload"]
