"""Whether a schema's value is a finite JSON number, as Python's json module reads one.

An integer of more than 308 digits is a Python int, finite and exact: math.isfinite converts it
to a float first and raises OverflowError, which escaped the 400 check as a server error.
"""

from __future__ import annotations

import math
from typing import Any


def finite_number(v: Any) -> bool:
    """An int (of any size, not a bool) or a finite float."""
    if isinstance(v, bool):
        return False
    return isinstance(v, int) or (isinstance(v, float) and math.isfinite(v))
