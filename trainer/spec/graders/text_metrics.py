"""The `evaluation_metric`s of text_similarity graders: which exist, which need the network, and which this machine
cannot compute (and why). The scoring functions are trainer.grading.similarity's (and fuzzy_match,
trainer.grading.graders.fuzzy_match)."""

from pathlib import Path

SIMILARITY_METRICS: tuple[str, ...] = (
    "fuzzy_match",
    "bleu",
    "gleu",
    "meteor",
    *(f"rouge_{n}" for n in range(1, 6)),
    "rouge_l",
)
"""text_similarity metrics scored in the grading process, available or not (`UNAVAILABLE`)."""
REMOTE_SIMILARITY_METRICS: tuple[str, ...] = ("cosine",)
"""text_similarity metrics that need the network (an embeddings endpoint): scored by `remote_graders`."""

# Debian's wordnet-base: WordNet 3.0's database files (index.*, data.*, *.exc, cntlist.rev).
WORDNET_DIR = Path("/usr/share/wordnet")
_POS = ("noun", "verb", "adj", "adv")
_WORDNET_FILES = [f"{kind}.{pos}" for kind in ("index", "data") for pos in _POS] + [f"{pos}.exc" for pos in _POS]


def wordnet_missing(root: Path = WORDNET_DIR) -> str | None:
    """Why METEOR cannot run here (WordNet's files are not in `root`), or None when they are all there."""
    missing = [name for name in _WORDNET_FILES if not (root / name).is_file()]
    if not missing:
        return None
    return (
        f"meteor matches synonyms from WordNet 3.0, which is not installed ({root}/{missing[0]} is missing): "
        "install Debian's wordnet-base package"
    )


UNAVAILABLE: dict[str, str] = {"meteor": reason} if (reason := wordnet_missing()) else {}
"""The metrics this machine cannot compute, and why."""
