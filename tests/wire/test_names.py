"""wire/names.py: the instance names both ends of the control plane accept."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from wire.kv_target import KVTarget
from wire.names import is_instance_name


@pytest.mark.parametrize("name", ["d0", "P", "9", "prefill-0", "decode_1.eu-west", "a" * 64, "0.-_"])
def test_names_starting_with_a_letter_or_digit_up_to_64_characters_are_instance_names(name):
    assert is_instance_name(name)


@pytest.mark.parametrize(
    "name",
    ["", ".", "..", "-d0", "_d0", ".d0", "a" * 65, "d 0", "d0/..", "d0\n", "dé", "d0:1", None, 7, b"d0"],
)
def test_empty_dotted_long_spaced_slashed_or_non_string_names_are_refused(name):
    assert not is_instance_name(name)


def test_a_wire_field_with_the_pattern_refuses_what_is_instance_name_refuses():
    assert KVTarget(peer="d0").peer == "d0"
    for bad in ["..", "d0/x", "a" * 65]:
        with pytest.raises(ValidationError):
            KVTarget(peer=bad)
