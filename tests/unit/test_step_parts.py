"""benchmarks.step_parts: arms with overrides, and a bad arm is a clear exit 2."""
import pytest

from benchmarks.step_parts import main, parse_arm
from crucible.config import ConfigError


def test_an_arm_takes_config_overrides() -> None:
    assert parse_arm("mapl:pipeline.mapl_ns_steps=4;train.lr=0.001") == (
        "mapl", ["pipeline.mapl_ns_steps=4", "train.lr=0.001"])
    assert parse_arm("none") == ("none", [])
    with pytest.raises(ConfigError, match="not KEY=VALUE"):
        parse_arm("ssn:pipeline.factor")


def test_an_unknown_arm_or_key_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--preset", "smoke", "--arms", "bogus", "--repeats", "1"]) == 2
    assert "unknown arm 'bogus'" in capsys.readouterr().err
    assert main(["--preset", "smoke", "--arms", "mapl:pipeline.nope=1", "--repeats", "1"]) == 2
    assert "pipeline.nope" in capsys.readouterr().err
