"""Credentials that no journal, cube, report, log or preview may hold, and how dvfs hides them.

dvfs records how it reached and started SGLang (engine.sglang.url, server_command and
extra_args, the servers' resolved arguments) for reproducibility, and a cube is made to be
shared. A few of those values are credentials: the user and password of a URL
(`http://user:token@host:30000`, which httpx sends as basic auth), a query parameter naming a
secret (`?token=...`), the value of a flag naming one (`--api-key`, `--admin-api-key`,
`--ssl-keyfile-password`, `--hf-token`), and a `NAME=VALUE` argument whose NAME names one, as
a wrapper passes it (`env HF_TOKEN=...`, `docker run -e HF_TOKEN=...`). Each is replaced by
`NOT_RECORDED`, everything around it kept as written; as the environment's secrets are
(`dvfs.records.session.is_server_env`). A leaf module: it imports nothing from dvfs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import SplitResult, unquote, urlsplit, urlunsplit

#: What a record says in place of a credential (and of an env value it does not keep).
NOT_RECORDED = "(not recorded)"
#: Words of an environment variable's (or a query parameter's) name that make its value a
#: secret: HF_TOKEN, AWS_SECRET_ACCESS_KEY, DB_PASSWORD, api_key.
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "KEY", "CREDENTIAL")
#: A flag's last word, or last two, that make its value a secret. Narrower than SECRET_WORDS:
#: SGLang's `--max-total-tokens`, `--bucket-time-to-first-token`, `--speculative-token-map`
#: and `--ssl-keyfile` (a path) are not.
FLAG_SECRET_LAST = frozenset(
    {"SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL", "CREDENTIALS", "APIKEY"}
)
FLAG_SECRET_LAST_TWO = frozenset(
    {
        "API_KEY",
        "ACCESS_KEY",
        "SECRET_KEY",
        "PRIVATE_KEY",
        "API_TOKEN",
        "AUTH_TOKEN",
        "ACCESS_TOKEN",
        "BEARER_TOKEN",
        "REFRESH_TOKEN",
        "HF_TOKEN",
    }
)

#: SGLang's flags that take a secret, each with the shortest abbreviation its argparse reads as
#: it (the shortest prefix no other option of 0.5.9's or 0.5.23's tables starts with): SGLang
#: takes `--ap KEY` as `--api-key KEY`, so such a prefix hides its value too.
SGLANG_SECRET_FLAGS = {
    "--api-key": "--ap",
    "--admin-api-key": "--ad",
    "--ssl-keyfile-password": "--ssl-keyfile-",
}


def sglang_secret_flag(name: str) -> str | None:
    """The SGLang secret flag (`SGLANG_SECRET_FLAGS`) argparse reads `name` as, or None."""
    for flag, shortest in SGLANG_SECRET_FLAGS.items():
        if len(name) >= len(shortest) and flag.startswith(name):
            return flag
    return None


_HIDDEN = re.escape(NOT_RECORDED)
#: NAME=VALUE, the value bare or quoted (a repr such as SGLang's `ServerArgs(api_key='...')`).
_NAME_VALUE = re.compile(
    rf"(?<![\w.-])([A-Za-z_][A-Za-z0-9_]*)=(?!{_HIDDEN}|None\b)('[^']*'|\"[^\"]*\"|[^\s'\",)]+)"
)
#: --flag VALUE or --flag=VALUE, the value bare or quoted (a shell line's `--api-key 'KEY'`).
_FLAG_VALUE = re.compile(
    rf"(?<![\w-])(--?[A-Za-z][\w-]*)(=|\s+)(?!['\"]?{_HIDDEN})('[^']*'|\"[^\"]*\"|[^\s'\"]+)"
)
#: A URL in a text; what a record hid in it (`NOT_RECORDED`, a space inside) is part of it, so
#: that a text hidden once reads the same hidden again (a journal's, compared with a new run's).
_URL = re.compile(rf"\b[A-Za-z][A-Za-z0-9+.-]*://(?:{_HIDDEN}|[^\s'\"<>])+")
#: A URL's parts as RFC 3986 (appendix B) splits any string, for one urlsplit refuses.
_URL_PARTS = re.compile(r"(?:([^:/?#]+):)?(?://([^/?#]*))?([^?#]*)(?:\?([^#]*))?(?:#(.*))?", re.S)


def secret_name(name: str) -> bool:
    """Whether an environment variable or query parameter called `name` holds a secret."""
    upper = name.upper()
    return any(word in upper for word in SECRET_WORDS)


def secret_flag(flag: str) -> bool:
    """Whether command-line flag `flag` (`--api-key`, or its argparse dest `api_key`) takes a
    secret as its value."""
    if flag.startswith("--") and sglang_secret_flag(flag) is not None:
        return True  # an abbreviation SGLang's argparse takes for one (`--ap KEY`)
    words = [w for w in re.split(r"[-_]+", flag.strip("-").upper()) if w]
    if not words:
        return False
    return (
        words[-1] in FLAG_SECRET_LAST
        or "_".join(words[-2:]) in FLAG_SECRET_LAST_TWO
        or words in (["TOKEN"], ["KEY"])
    )


def redact_url(url: str) -> str:
    """`url` without its user and password, and with the value of each query parameter that
    names a secret hidden; as written where it holds neither."""
    try:
        parts = urlsplit(url)
    except ValueError:
        # A host urlsplit refuses ("[::1", "[zz]"): its user, password and query are hidden
        # all the same, the parts split as RFC 3986 splits any string.
        match = _URL_PARTS.fullmatch(url)
        assert match is not None  # every group is optional: any string matches
        parts = SplitResult(*(group or "" for group in match.groups()))
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{NOT_RECORDED}@{netloc.rpartition('@')[2]}"
    query = "&".join(
        f"{key}={NOT_RECORDED}" if sep and secret_name(unquote(key)) else f"{key}{sep}{value}"
        for key, sep, value in (piece.partition("=") for piece in parts.query.split("&"))
    )
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def secret_assignment(name: str) -> bool:
    """Whether NAME=VALUE assigns a secret: an environment variable's name (upper case) as
    `secret_name` reads it, any other name (a dest, `api_key='...'`) as `secret_flag` does,
    so that `tokenizer_path=...` stays."""
    return secret_name(name) if name.isupper() else secret_flag(name)


def _hidden_value(match: re.Match[str]) -> str:
    name, value = match.group(1), match.group(2)
    if not secret_assignment(name):
        return match.group(0)
    quote = value[0] if value[0] in "'\"" else ""
    return f"{name}={quote}{NOT_RECORDED}{quote}"


def redact_text(text: str) -> str:
    """One argument, a command line as one string (`bash -c "..."`) or a log's lines: URLs'
    credentials, `NAME=VALUE` assigning a secret (`secret_assignment`), and `--secret-flag
    VALUE` (or `=VALUE`) hidden."""
    text = _URL.sub(lambda m: redact_url(m.group(0)), text)
    text = _NAME_VALUE.sub(_hidden_value, text)
    return _FLAG_VALUE.sub(_hidden_flag_value, text)


def _hidden_flag_value(match: re.Match[str]) -> str:
    flag, sep, value = match.groups()
    quote = value[0] if value[0] in "'\"" else ""
    if secret_flag(flag):
        return f"{flag}{sep}{quote}{NOT_RECORDED}{quote}"
    if quote:  # another flag's quoted value may hold one (`sh -c "... --api-key KEY"`)
        return f"{flag}{sep}{quote}{redact_text(value[1:-1])}{quote}"
    return match.group(0)


def redact_argv(argv: Iterable[str]) -> list[str]:
    """A command's arguments with every credential hidden (`redact_text` on each, and the
    argument after a secret flag given alone, `--api-key KEY`); one out for each in."""
    out: list[str] = []
    hide_next = False
    for token in argv:
        token = str(token)
        if hide_next and not token.startswith("-"):
            out.append(NOT_RECORDED)
            hide_next = False
            continue
        hide_next = token.startswith("-") and "=" not in token and secret_flag(token)
        out.append(_redact_token(token))
    return out


def _redact_token(token: str) -> str:
    """One argument: a secret's whole value hidden where the argument is `--flag=VALUE` or
    `NAME=VALUE` (commas and all; not a shell line, `HF_TOKEN=... python ...`), else
    `redact_text`."""
    name, eq, value = token.partition("=")
    if eq and name.startswith("-"):
        if secret_flag(name):
            return f"{name}={NOT_RECORDED}"
        inner = _redact_token(value)  # docker's --env=HF_TOKEN=..., --url=http://user:pw@...
        if inner != value:
            return f"{name}={inner}"
    elif (
        eq
        and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name)
        and not re.search(r"\s", value)
        and secret_assignment(name)
    ):
        return f"{name}={NOT_RECORDED}"
    return redact_text(token)


def redact_args(args: Any) -> Any:
    """A server's resolved arguments (/server_info) with each secret one's value hidden
    (`api_key`, `admin_api_key`, `ssl_keyfile_password`; one unset stays None) and URLs'
    credentials hidden in the rest; an argv (an earlier journal's) as `redact_argv` hides it;
    anything else as it is."""
    if isinstance(args, list) and all(isinstance(a, str) for a in args):
        return redact_argv(args)
    if not isinstance(args, Mapping):
        return args
    out: dict[str, Any] = {}
    for key, value in args.items():
        if secret_flag(str(key)) and value not in (None, ""):
            out[key] = NOT_RECORDED
        elif isinstance(value, str) and "://" in value:
            out[key] = redact_text(value)
        else:
            out[key] = value
    return out
