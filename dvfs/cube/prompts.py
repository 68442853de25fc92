"""A cube's prompts read again: the campaign it records (`campaign_of`, its corpora's relative
paths taken from the campaign file's folder, never the working directory), the check that its
corpora are still the prompts its cells were measured on (`check_same_corpora`), and the mean
input tokens of the prompts a cube of an earlier dvfs drew from (`reread_prompt_tokens`), for
the roofline's context where the cube does not record it (`prompt_tokens`, since the sweep
records what each cell's rounds sent).

An edge of the analyses (the CLI and report call it, never an analysis): it reads campaign
and corpus files from disk and may load a tokenizer. The twin's cube fit reads its cubes'
prompts through it too.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from dvfs.errors import CampaignError, DvfsError

if TYPE_CHECKING:
    import xarray as xr

    from dvfs.campaign import Campaign
    from dvfs.corpora.model import Corpus


class RecordedCampaignError(DvfsError):
    """The campaign a cube records cannot be read again (none recorded, damaged, its folder
    gone): bad input, exit 2."""

    exit_code = 2


class PromptsChangedError(DvfsError):
    """The corpora read again are not the prompts the cube's cells were measured on (a corpus
    edited since, or counted by another revision of the tokenizer): the campaign and corpus
    files are valid, the cube and they no longer agree. An error (exit 1), as a resumed sweep
    refuses the same prompts changed under its journal."""

    exit_code = 1


def _recorded_corpora(ds: xr.Dataset) -> Any:
    """The cube's `corpora` attribute (each corpus's source and hashes) as JSON data; {} where
    it has none or it does not parse (a damaged cube: nothing recorded to go by)."""
    import json

    try:
        return json.loads(str(ds.attrs.get("corpora") or "{}"))
    except ValueError:
        return {}


def campaign_of(ds: xr.Dataset, where: Path) -> Campaign:
    """The campaign a cube was swept from (its `campaign_source` attribute), its corpora's
    relative paths taken from the campaign file's folder: the one the cube records
    (`campaign_dir`), else, in a cube of an earlier dvfs, the one its corpus sources name
    (`campaign_dir_of`), else the cube's."""
    import tomllib

    from dvfs.campaign import parse_campaign
    from dvfs.corpora.loaders import campaign_dir_of

    source = str(ds.attrs.get("campaign_source") or "")
    if not source.strip():
        raise RecordedCampaignError(f"{where} records no campaign (no campaign_source attribute)")
    folder = ds.attrs.get("campaign_dir")
    recorded_dir = folder if isinstance(folder, str) and folder else None
    try:
        data = tomllib.loads(source)
        base = (
            recorded_dir
            or campaign_dir_of(data.get("corpus"), _recorded_corpora(ds))
            or (where.parent if where.is_file() else where)
        )
        campaign = parse_campaign(
            data, where=f"{where}'s campaign", source=source, base_dir=str(base)
        )
    except (ValueError, CampaignError) as exc:
        raise RecordedCampaignError(f"{where}'s campaign cannot be read again: {exc}") from exc
    if recorded_dir is not None and not Path(recorded_dir).is_dir():
        paths = [dict(ref.spec).get("path") for ref in campaign.workload.corpora if ref.spec]
        relative = [
            p for p in paths if isinstance(p, str) and not Path(p).expanduser().is_absolute()
        ]
        if relative:
            raise RecordedCampaignError(
                f"{where}: its campaign file's folder {recorded_dir}, where the relative paths "
                f"of its corpora start ({', '.join(relative)}), no longer exists: put it back "
                "with its corpora to read them again"
            )
    return campaign


def check_same_corpora(
    ds: xr.Dataset,
    where: Path,
    corpora: dict[str, Corpus],
    input_tokens: tuple[int, int],
    *,
    use: str = "the fit would compare them with other prompts",
) -> None:
    """Refuse a corpus read again whose prompts are not those the cube's cells were measured
    on: its content hash differs from the one the cube records (the file was edited since), or,
    with the same content, its prompts fitted to the input lengths with their token counts
    (`pool_hash`: another revision of the tokenizer). Corpora the cube records no hash for
    (an older cube) are taken as they are. Refused: `PromptsChangedError`, exit 1, whose
    message says what reading other prompts would do (`use`)."""

    from dvfs.corpora.sampling import pool_hash
    from dvfs.records import corpus_hashes

    recorded = _recorded_corpora(ds)
    content, pools = corpus_hashes(recorded), corpus_hashes(recorded, "pool_hash")
    for name, corpus in corpora.items():
        was, now = content.get(name), corpus.content_hash
        if was is not None and was != now:
            raise PromptsChangedError(
                f"{where}: corpus {name!r} has changed since its cells were measured (content "
                f"hash {was} recorded, {now} now; read from {corpus.source}): {use}; put the "
                "corpus back as it was, or sweep the campaign again"
            )
        was_pool = pools.get(name)
        if was_pool is not None and was_pool != (now_pool := pool_hash(corpus, input_tokens)):
            raise PromptsChangedError(
                f"{where}: corpus {name!r} counts its prompts otherwise than when its cells "
                f"were measured (prompt pool hash {was_pool} recorded, {now_pool} now: another "
                f"revision of the tokenizer); {use}: restore the tokenizer it was swept with, or "
                "sweep the campaign again"
            )


def reread_prompt_tokens(cube: xr.Dataset, where: Path) -> float | str:
    """The mean input tokens of the prompts a cube's sweep drew from, read again from the
    corpora of the campaign it records (`where`: the cube file or sweep folder, whose folder
    stands in for the campaign's where the cube records none): each corpus's prompts fitted to
    the input range (as the server and the twin got them), averaged per corpus, then over the
    cube's corpora (each weighs alike in its cells). For a cube that does not record what its
    cells sent (`prompt_tokens`, an earlier dvfs's). Where the corpora cannot be read again as
    the sweep read them (moved, edited, another tokenizer, a cube that records no campaign, a
    corpus from the Hugging Face hub, which an analysis does not fetch again), why not, in
    words."""
    import json

    from dvfs.corpora.prepare import counted_corpora
    from dvfs.corpora.sampling import eligible_prompts
    from dvfs.errors import JournalError

    names = [str(n) for n in cube["corpus"].values]
    method = str(cube.attrs.get("token_count_method") or "")
    if "merged_from" in cube.attrs and not cube.attrs.get("campaign_source"):
        return "a merged cube keeps a campaign file only where all its cubes record the same one"
    try:
        lo, hi = json.loads(cube.attrs["campaign"])["workload"]["input_tokens"]
        input_tokens = (int(lo), int(hi))
        campaign = campaign_of(cube, where)
        specs = {ref.name: ref.spec for ref in campaign.workload.corpora}
        missing = [n for n in names if n not in specs]
        if missing:
            return f"corpus {missing[0]!r} of the cube is not in the campaign it records"
        hub = [n for n in names if "dataset" in dict(specs[n] or ())]
        if hub:
            return (
                f"corpus {hub[0]!r} is a Hugging Face dataset, which an analysis does not "
                "fetch again"
            )
        corpora, _ = counted_corpora(campaign, method)
        check_same_corpora(
            cube,
            where,
            corpora,
            input_tokens,
            use="the roofline would take another context from them",
        )
        means = []
        for name in names:
            lengths = [p.input_tokens for p in eligible_prompts(corpora[name], input_tokens)]
            if not lengths:
                return f"corpus {name!r} has no prompt within workload.input_tokens now"
            means.append(sum(lengths) / len(lengths))
    except JournalError:
        return f"the sweep counted their tokens with the {method}, not in the local cache now"
    except DvfsError as exc:
        return str(exc).removeprefix(f"{where}: ")
    except (KeyError, OSError, TypeError, ValueError) as exc:  # a damaged or edited cube
        return f"the cube's campaign record is damaged: {exc}"
    return sum(means) / len(means) if means else "the cube has no corpus"


def roofline_context(cube: xr.Dataset, where: Path, notes: list[str]) -> float | None:
    """The context `dvfs compare` and `dvfs report` give the roofline
    (`dvfs.analysis.roofline.rooflines`' `context_tokens`): None where the cube records what
    its cells' prompts were (the analysis reads that, each GPU model of a merged cube its
    own); else, a cube of an earlier dvfs, those its sweep drew from read again from its
    corpora (`reread_prompt_tokens`, `where`: the cube file or sweep folder given), or where
    they cannot be, the middle of its input range, said in `notes` in one line."""
    from dvfs.analysis.roofline import mean_context_tokens, recorded_prompt_tokens

    if recorded_prompt_tokens(cube) is not None:
        return None
    return mean_context_tokens(cube, prompt_tokens=reread_prompt_tokens(cube, where), notes=notes)
