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


# Optional on router -> server calls: the role epoch the caller believes the instance is in. A server
# whose epoch differs refuses the call (409 ``stale_epoch``); a call without it is taken as before.
ROLE_EPOCH_HEADER = "x-pdserve-role-epoch"
