"""Ids that become folder names or store keys: one rule (`crucible.ids.validate_id`)."""
import uuid

import pytest

from crucible.config import ConfigError
from crucible.ids import InvalidId, validate_id


@pytest.mark.parametrize("value", [str(uuid.UUID(int=1, version=4)), "run-0a1b2c3d4e5f", "A", "a.b_c-d",
                                   "x" * 128])
def test_uuids_and_slugs_are_accepted_as_given(value):
    assert validate_id(value, field="run_id") == value


@pytest.mark.parametrize("value", ["../../etc", "..", "a..b", "/etc/passwd", "/abs", "a/b",
                                   "a\\b", "", ".hidden", "-flag", "x" * 129, "a b", "a\x00b",
                                   None, 7])
def test_paths_and_unsafe_names_are_refused_naming_the_field(value):
    with pytest.raises(InvalidId) as caught:
        validate_id(value, field="run_id")
    message = str(caught.value)
    assert message.startswith("run_id=") and "is not a valid id" in message
    assert isinstance(caught.value, ConfigError)   # every command maps it to exit 2
