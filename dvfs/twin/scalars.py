"""Scalars as 0-d arrays, for the twin's ufunc calls on small arrays.

NumPy converts a Python (or NumPy) scalar operand of a ufunc on every call, about a third of
the call's cost on the few hundred elements a round's passes or a sampler's instants hold. A
read-only 0-d array of the dtype the scalar would have taken there (float64 beside float64,
int64 beside int64) holding the same number goes through the same inner loop without that
conversion: the same bits, sooner. The twin's models make theirs once (`zero_d`).
"""

from __future__ import annotations

import numpy as np


def zero_d(*values: float, dtype: type = np.float64) -> tuple[np.ndarray, ...]:
    """`values` as read-only 0-d arrays of `dtype`."""
    arrays: tuple[np.ndarray, ...] = tuple(np.array(v, dtype=dtype) for v in values)
    for a in arrays:
        a.flags.writeable = False
    return arrays
