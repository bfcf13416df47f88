"""Names both ends of the control plane check.

An instance's name (config, health reports, peers, admin paths) starts with a
letter or digit, so it is never empty, "." or "..", and it goes into URL paths
and file names as it is.
"""

from __future__ import annotations

import re

INSTANCE_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


def is_instance_name(name: object) -> bool:
    return isinstance(name, str) and re.fullmatch(INSTANCE_NAME, name) is not None
