"""What the twin reads from the text served: genre, language and n-gram repetition.

A trained drafter's acceptance depends on the kind of text (code drafts well, prose less) and on
its language (a drafter trained on English drafts other languages poorly); an n-gram drafter's
on how often the text repeats itself. The twin reads both from the prompts, not from the
corpus's name, so a corpus called "romansh" that holds English accepts like English.

Everything here is pure and cheap: a corpus is profiled once (memoised by its content), from
features a reader could check by hand. Each threshold sits near the geometric midpoint between
the built-in corpora's measured features on either side (listed by each constant), a factor of
at least 1.8 from each.
"""

from __future__ import annotations

import functools
import math
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

#: The tokenisation estimate: runs of word characters, and each other non-space character on
#: its own. Coarser than a BPE vocabulary, but an n-gram drafter copies whole words and symbols
#: either way, so the share of repeated n-grams comes out alike (INF).
TOKEN = re.compile(r"\w+|[^\w\s]")
WORD = re.compile(r"[^\W\d_]+")
#: The n-gram drafter's match length: prompt lookup decoding's reference implementation
#: matches up to the last 3 tokens (max_ngram_size = 3); SGLang's n-gram drafter is alike.
NGRAM = 3


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


#: Frequent English function words (a word list, not a model).
ENGLISH_WORDS = _words(
    "the and of to a is in that it you for with this are be was what how i my your on as "
    "have can do not or but if at by from an we they he she"
)
#: Frequent Rumantsch Grischun function words (articles, prepositions, pronouns, auxiliaries).
ROMANSH_WORDS = _words(
    "il la ils las da dal dals e ed è èn ina en cun sin che betg ha han quai era vegn pli "
    "nus jau ti el ella sco sia ses sias mia mes tge co nua cura er ussa uschia anc bler"
)
PERSONAL_WORDS = _words("i you my me your we our")
CODE_SYMBOLS = frozenset("{}[]();=<>_`|\\")

#: A language's function words must make up this share of the words (built-ins: English text
#: 0.18-0.37 English words, Romansh text 0.35 Romansh words; the other list at most 0.035).
LANGUAGE_MIN_SHARE = 0.08
#: ... and outnumber the other list's by this factor.
LANGUAGE_RATIO = 2.0
#: Code: lines indented by 2+ spaces or a tab (code 0.63, every other built-in 0.00) ...
CODE_MIN_INDENTED = 0.20
#: ... or code symbols among the non-space characters (code 0.098, others 0.001-0.013).
CODE_MIN_SYMBOLS = 0.035
#: Math: digits among the non-space characters (math 0.034; others 0.005-0.010, code 0.012).
MATH_MIN_DIGITS = 0.018
#: Conversation: first- and second-person words among the words (conversation 0.059, English
#: prose 0.017) ...
CONVERSATION_MIN_PERSONAL = 0.032
#: ... or prompts with earlier turns (conversation 0.55, English prose 0.00).
CONVERSATION_MIN_MULTI_TURN = 0.25

#: The acceptance classes the priors in `data/acceptance.toml` are given for.
CLASSES = ("code", "conversation", "english", "math", "romansh")


class _Message(Protocol):
    @property
    def content(self) -> str: ...


class _Prompt(Protocol):
    @property
    def messages(self) -> Sequence[_Message]: ...


class _Corpus(Protocol):
    @property
    def prompts(self) -> Sequence[_Prompt]: ...

    @property
    def content_hash(self) -> str: ...


@dataclass(frozen=True)
class TextFeatures:
    """Measured shares (0-1) over a set of prompts."""

    words: int
    english_words: float
    romansh_words: float
    latin_letters: float
    script: str
    indented_lines: float
    code_symbols: float
    digits: float
    personal_words: float
    multi_turn: float
    ngram_repetition: float


@dataclass(frozen=True)
class TextProfile:
    """What the twin inferred from a corpus's text, and the acceptance class it uses.

    `acceptance_class` is the row of the trained drafters' priors; `override` is set when the
    campaign's `acceptance_like` chose that row instead of the text.
    """

    genre: str
    language: str
    acceptance_class: str
    features: TextFeatures
    override: str | None = None

    @property
    def ngram_repetition(self) -> float:
        return self.features.ngram_repetition

    def overridden(self, acceptance_class: str) -> TextProfile:
        """The same text with its trained-drafter class set explicitly (`acceptance_like`)."""
        if acceptance_class not in CLASSES:
            raise ValueError(f"acceptance class {acceptance_class!r} is not one of {CLASSES}")
        return TextProfile(
            self.genre, self.language, acceptance_class, self.features, acceptance_class
        )

    def provenance(self) -> dict[str, object]:
        """Compact record for the cube: the inference and the numbers it rests on."""
        f = self.features
        return {
            "genre": self.genre,
            "language": self.language,
            "acceptance_class": self.acceptance_class,
            "acceptance_like": self.override,
            "ngram_repetition": round(f.ngram_repetition, 4),
            "features": {
                k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(f).items()
            },
        }


def tokens(text: str) -> list[str]:
    """The tokenisation estimate (`TOKEN`), case kept as an n-gram drafter matches it."""
    return TOKEN.findall(text)


def repetition_counts(toks: Sequence[str], n: int = NGRAM) -> tuple[int, int]:
    """(tokens an n-gram copy would predict, tokens it could try).

    A token is predicted when the n tokens before it, followed by it, occurred earlier in the
    same text: what an n-gram drafter copying from the context proposes and the target keeps.
    """
    seen: set[tuple[str, ...]] = set()
    hits = 0
    for i in range(n, len(toks)):
        gram = tuple(toks[i - n : i + 1])
        if gram in seen:
            hits += 1
        else:
            seen.add(gram)
    return hits, max(0, len(toks) - n)


def _script(ch: str) -> str:
    name = unicodedata.name(ch, "")
    return name.split(" ", 1)[0] if name else "UNKNOWN"


def measure(prompts: Iterable[Sequence[str]]) -> TextFeatures:
    """Features of prompts, each given as its messages' texts (earlier turns are context)."""
    words: Counter[str] = Counter()
    scripts: Counter[str] = Counter()
    chars = digits = symbols = lines = indented = 0
    prompt_count = multi = hits = tries = 0
    for messages in prompts:
        prompt_count += 1
        multi += len(messages) > 1
        text = "\n\n".join(messages)
        h, t = repetition_counts(tokens(text))
        hits, tries = hits + h, tries + t
        words.update(w.lower() for w in WORD.findall(text))
        for ch, count in Counter(text).items():  # each distinct character once
            if ch.isspace():
                continue
            chars += count
            if ch.isdigit():
                digits += count
            elif ch in CODE_SYMBOLS:
                symbols += count
            elif ch.isalpha():
                scripts[_script(ch)] += count
        for line in text.split("\n"):
            if line.strip():
                lines += 1
                indented += line.startswith(("  ", "\t"))
    total_words = sum(words.values())
    letters = sum(scripts.values())

    def share(part: float, whole: float) -> float:
        return part / whole if whole else 0.0

    return TextFeatures(
        words=total_words,
        english_words=share(sum(words[w] for w in ENGLISH_WORDS), total_words),
        romansh_words=share(sum(words[w] for w in ROMANSH_WORDS), total_words),
        latin_letters=share(scripts["LATIN"], letters),
        # the commonest script, a tie to the first name (not to the prompts' order)
        script=min(scripts.items(), key=lambda kv: (-kv[1], kv[0]))[0].lower()
        if scripts
        else "none",
        indented_lines=share(indented, lines),
        code_symbols=share(symbols, chars),
        digits=share(digits, chars),
        personal_words=share(sum(words[w] for w in PERSONAL_WORDS), total_words),
        multi_turn=share(multi, prompt_count),
        ngram_repetition=share(hits, tries),
    )


def language_of(f: TextFeatures) -> str:
    """english, romansh, or other (any other language or script: no word list for it)."""
    en, rm = f.english_words, f.romansh_words
    if en >= LANGUAGE_MIN_SHARE and en >= LANGUAGE_RATIO * rm:
        return "english"
    if f.latin_letters >= 0.5 and rm >= LANGUAGE_MIN_SHARE and rm >= LANGUAGE_RATIO * en:
        return "romansh"
    return "other"


def genre_of(f: TextFeatures) -> str:
    """code, math, conversation or prose, tested in that order."""
    if f.indented_lines >= CODE_MIN_INDENTED or f.code_symbols >= CODE_MIN_SYMBOLS:
        return "code"
    if f.digits >= MATH_MIN_DIGITS:
        return "math"
    if f.personal_words >= CONVERSATION_MIN_PERSONAL or f.multi_turn >= CONVERSATION_MIN_MULTI_TURN:
        return "conversation"
    return "prose"


def acceptance_class(genre: str, language: str) -> str:
    """The trained drafters' prior row for a genre and language.

    Code drafts alike whatever language its comments are in; any other text not in English
    takes the non-English row (`romansh`: the one published English/other-language ratio);
    English text takes its genre's row (prose: `english`).
    """
    if genre == "code":
        return "code"
    if language != "english":
        return "romansh"
    return {"math": "math", "conversation": "conversation"}.get(genre, "english")


def profile(prompts: Iterable[Sequence[str]]) -> TextProfile:
    """Measure and classify prompts, each given as its messages' texts."""
    f = measure(prompts)
    genre, language = genre_of(f), language_of(f)
    return TextProfile(genre, language, acceptance_class(genre, language), f)


#: Profiles by corpus content hash (bounded: a process sees a few corpora).
_BY_HASH: dict[str, TextProfile] = {}
CACHE_SIZE = 256


def profile_corpus(corpus: _Corpus) -> TextProfile:
    """A corpus's profile, computed once per content (its hash) in a process."""
    key = corpus.content_hash
    cached = _BY_HASH.get(key)
    if cached is None:
        cached = profile(tuple(m.content for m in p.messages) for p in corpus.prompts)
        if len(_BY_HASH) >= CACHE_SIZE:
            _BY_HASH.clear()
        _BY_HASH[key] = cached
    return cached


def builtin_profile(name: str) -> TextProfile:
    """The profile of the built-in corpus `name` (what `acceptance_like = name` refers to)."""
    from dvfs.corpora.registry import load_corpus

    return profile_corpus(load_corpus(name))


@functools.lru_cache(maxsize=1024)
def profile_prompts(prompts: tuple[_Prompt, ...]) -> TextProfile:
    """The profile of one round's prompts (engines given no corpus profile fall back to it)."""
    return profile(tuple(m.content for m in p.messages) for p in prompts)


def ngram_alpha(repetition: float, intercept: float, per_sqrt: float) -> float:
    """Per-draft acceptance of an n-gram drafter from the text's repetition rate r.

    alpha = intercept + per_sqrt x sqrt(r), clipped to [0, 0.99]: least squares over the
    built-in corpora whose published n-gram accept length reflects their own repetition
    (see `data/acceptance.toml`). Non-decreasing in r.
    """
    return min(0.99, max(0.0, intercept + per_sqrt * math.sqrt(max(0.0, repetition))))
