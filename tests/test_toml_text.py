"""The TOML writer behind caps files, batch plans and fitted profiles: whatever it writes,
`tomllib` must read back as the value written, or the file fails to load at boot."""

from __future__ import annotations

import math
import tomllib

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from dvfs.toml_text import toml_key, toml_value

scalars = (
    st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text()
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(values)
def test_every_value_reads_back_as_written(value: object) -> None:
    assert tomllib.loads(f"v = {toml_value(value)}")["v"] == value


@given(st.text(), st.integers())
def test_every_key_reads_back_as_written(key: str, number: int) -> None:
    assert tomllib.loads(f"{toml_key(key)} = {number}") == {key: number}


def test_numpy_numbers_and_non_finite_floats_are_toml_numbers() -> None:
    doc = tomllib.loads(
        "\n".join(
            f"{k} = {toml_value(v)}"
            for k, v in {
                "f": np.float64(1.5),
                "i": np.int64(7),
                "n": math.nan,
                "inf": -math.inf,
                "t": (1, 2),
            }.items()
        )
    )
    assert doc["f"] == 1.5 and doc["i"] == 7 and math.isnan(doc["n"]) and doc["inf"] == -math.inf
    assert doc["t"] == [1, 2]


@given(st.integers(min_value=2**63) | st.integers(max_value=-(2**63) - 1))
def test_an_integer_beyond_64_bits_is_refused_not_written(number: int) -> None:
    """TOML's integers are 64-bit, and a reader must refuse a larger one: `tomllib` reads any,
    so a file holding one read back here, and failed in the next reader. It is refused,
    naming the key, and the 64-bit bounds are written as they are."""
    import pytest

    from dvfs.toml_text import TomlValueError, toml_line

    with pytest.raises(TomlValueError, match=f"cannot write batch into a TOML file: {number} "):
        toml_line("batch", number)
    with pytest.raises(TomlValueError):
        toml_value({"a": [1, np.int64(2), number]})
    bounds = {"lo": -(2**63), "hi": 2**63 - 1}
    assert tomllib.loads(toml_line("t", bounds)) == {"t": bounds}
