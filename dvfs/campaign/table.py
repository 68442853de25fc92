"""A TOML table under validation: typed getters, and errors that name the key and the file."""

from __future__ import annotations

import difflib
import math
from typing import Any

from dvfs.campaign.model import show
from dvfs.errors import CampaignError

#: The longest duration a campaign may set (`Table.seconds`): a week.
MAX_SECONDS = 7 * 24 * 3600.0


class Table:
    """A TOML table being validated: remembers its path and which keys were consumed."""

    def __init__(self, where: str, path: str, data: Any) -> None:
        if not isinstance(data, dict):
            raise CampaignError(f"{where}: [{path}] must be a table, got {show(data)}")
        self.where = where
        self.path = path
        self.data = data
        self.used: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def fail(self, name: str, message: str) -> CampaignError:
        misspelt = self._misspelt()
        if misspelt is not None:
            # `backnd = "nvml"` left backend at its default, and this error follows from that:
            # name the misspelling instead.
            return misspelt
        return CampaignError(f"{self.where}: {self.key(name)}: {message}")

    def _misspelt(self) -> CampaignError | None:
        """An unread key that looks like a misspelling of a key already asked for but absent,
        as a did-you-mean error; None if there is none."""
        targets = sorted(self.used - set(self.data))
        unread = [k for k in self.data if k not in self.used and isinstance(k, str)]
        for target in targets:
            # High cutoff: real keys such as stall_timeout_s and startup_timeout_s are 0.81 alike.
            hint = difflib.get_close_matches(target, unread, n=1, cutoff=0.85)
            if hint:
                kind = "table" if isinstance(self.data[hint[0]], dict) else "key"
                shown = f"[{self.key(hint[0])}]" if kind == "table" else repr(self.key(hint[0]))
                return CampaignError(
                    f"{self.where}: unknown {kind} {shown} (did you mean {target!r}?)"
                )
        return None

    def missing(self, name: str, what: str = "key") -> CampaignError:
        """A required key or table is absent: suggest a misspelt one that is present."""
        shown = f"[{self.key(name)}]" if what == "table" else self.key(name)
        unread = [k for k in self.data if k not in self.used and isinstance(k, str)]
        hint = difflib.get_close_matches(name, unread, n=1, cutoff=0.6)
        suggestion = f" (found {self.key(hint[0])!r}: did you mean {name!r}?)" if hint else ""
        return CampaignError(f"{self.where}: missing required {what} {shown}{suggestion}")

    def get(self, name: str, default: Any = None) -> Any:
        self.used.add(name)
        return self.data.get(name, default)

    def has(self, name: str) -> bool:
        return name in self.data

    def require(self, name: str) -> Any:
        if name not in self.data:
            raise self.missing(name)
        self.used.add(name)
        return self.data[name]

    def sub(self, name: str, required: bool = False) -> Table:
        if name not in self.data:
            if required:
                raise self.missing(name, "table")
            self.used.add(name)
            return Table(self.where, self.key(name), {})
        self.used.add(name)
        return Table(self.where, self.key(name), self.data[name])

    def finish(self) -> None:
        unknown = sorted(set(self.data) - self.used)
        if not unknown:
            return
        name = unknown[0]
        allowed = sorted(self.used)
        hint = difflib.get_close_matches(name, allowed, n=1)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise CampaignError(
            f"{self.where}: unknown key {self.key(name)!r}{suggestion}; "
            f"allowed in [{self.path or 'top level'}]: {', '.join(allowed)}"
        )

    # typed getters -----------------------------------------------------------------------
    def string(
        self, name: str, default: str | None = None, *, choices: tuple[str, ...] = ()
    ) -> Any:
        value = self.get(name, default)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.fail(name, f"expected a string, got {show(value)}")
        if choices and value not in choices:
            raise self.fail(name, f"{value!r} is not allowed; choose one of {', '.join(choices)}")
        return value

    def integer(self, name: str, default: int | None = None, *, minimum: int | None = None) -> Any:
        value = self.get(name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(name, f"expected an integer, got {show(value)}")
        if minimum is not None and value < minimum:
            raise self.fail(name, f"must be at least {minimum}, got {value}")
        return value

    def number(
        self,
        name: str,
        default: float | None = None,
        *,
        minimum: float | None = None,
        strictly_positive: bool = False,
    ) -> Any:
        value = self.get(name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(name, f"expected a number, got {show(value)}")
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an integer no float holds (tomllib reads any): no setting
            digits = len(str(abs(value)))
            raise self.fail(
                name,
                f"got an integer of {digits} digits, too large for a number; set a smaller one",
            ) from None
        if not finite:  # TOML allows nan and inf; no setting means either
            raise self.fail(name, f"expected a finite number, got {value}")
        if strictly_positive and value <= 0:
            raise self.fail(name, f"must be greater than 0, got {value}")
        if minimum is not None and value < minimum:
            raise self.fail(name, f"must be at least {minimum}, got {value}")
        return float(value)

    def seconds(
        self,
        name: str,
        default: float | None = None,
        *,
        minimum: float | None = None,
        strictly_positive: bool = False,
    ) -> Any:
        """A duration in seconds (`number`), at most `MAX_SECONDS`: a larger one is no
        setting (a typo, a value in ms or ns), and past the clocks' reach it ended in an
        internal error (the twin's idle baseline of 2**70 s: "int too large to convert")."""
        value = self.number(name, default, minimum=minimum, strictly_positive=strictly_positive)
        if value is not None and value > MAX_SECONDS:
            raise self.fail(
                name, f"must be at most {MAX_SECONDS:g} s (a week), got {self.get(name)} s"
            )
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.get(name, default)
        if not isinstance(value, bool):
            raise self.fail(name, f"expected true or false, got {show(value)}")
        return value

    def strings(self, name: str, default: tuple[str, ...] = ()) -> tuple[str, ...]:
        value = self.get(name, list(default))
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(name, f"expected a list of strings, got {show(value)}")
        return tuple(value)


def argv_list(table: Table, name: str) -> tuple[str, ...]:
    """A list of command-line arguments (numbers allowed, passed on as strings)."""
    value = table.get(name, [])
    if not isinstance(value, list) or not all(isinstance(v, str | int | float) for v in value):
        raise table.fail(name, f"expected a list of command-line arguments, got {show(value)}")
    return tuple(str(v) for v in value)
