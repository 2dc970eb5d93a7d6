"""text_similarity's evaluation metrics beyond fuzzy_match (which is trainer.grading.graders.fuzzy_match); the
metrics' names, and which are unavailable here, are trainer.spec.graders.text_metrics's.

`METRICS` maps an OpenAI `evaluation_metric` name to `score(text, reference) -> float in [0, 1]` (`text` is the
rendered `input`, the model's answer; `reference` the rendered `reference`); `MAX_CHARS` gives a metric a lower cap on
the length of each rendered text than `trainer.spec.graders.MAX_SIMILARITY_CHARS`; a metric this machine cannot
compute (`trainer.spec.graders.text_metrics.UNAVAILABLE`) is left out of `METRICS`.

OpenAI's graders guide says only "Computes the BLEU score between input and reference" (GLEU, METEOR, ROUGE alike).
The libraries are the ones its python-grader image ships, nltk and Google's rouge-score, called as Microsoft's
Azure AI evaluation SDK calls them in its BLEU, GLEU, METEOR and ROUGE evaluators (the closest published
implementation), except for BLEU's `auto_reweigh` and the tokens (both below), where a user would expect otherwise:

- `bleu`: nltk's `sentence_bleu` (Papineni et al. 2002), uniform weights over 1- to 4-grams, Chen & Cherry's (2014)
  smoothing method 4 (as Azure's), and `auto_reweigh`: a text of k < 4 tokens is scored on 1- to k-grams, so that
  identical texts score 1.0 whatever their length (without it "New York" against itself scores 0.22).
  Case-sensitive.
- `gleu`: nltk's `sentence_gleu` (Google-BLEU, Wu et al. 2016): min(n-gram precision, n-gram recall) over 1- to
  4-grams. Case-sensitive.
- `meteor`: nltk's `single_meteor_score` (Banerjee & Lavie 2005) with its defaults: alpha 0.9, beta 3, gamma 0.5,
  lowercased, matching exact words, then Porter stems, then WordNet 3.0 synonyms. WordNet is Debian's `wordnet-base`
  package (/usr/share/wordnet); without it `meteor` is unavailable rather than scored without synonyms.
- `rouge_1` … `rouge_5`, `rouge_l`: rouge-score's `RougeScorer` (Lin 2004; `rouge1` … `rouge5`, `rougeL`), its
  F-measure, with its own tokenizer (lowercased; every run of characters other than a-z and 0-9 separates tokens
  and is dropped, so non-ASCII letters are dropped too) and no stemming (its default and Azure's). rouge_l's
  longest common subsequence is RapidFuzz's (rouge_l()), the same number computed in C.

Tokens for BLEU, GLEU and METEOR are nltk's `wordpunct_tokenize`: each run of word characters (letters of any
script, digits, underscore) and each run of other non-space characters is a token ("didn't." gives "didn", "'", "t",
"."). It is one regular expression, linear in the text. nltk's `word_tokenize` (Treebank-style tokens, which Azure
uses) needs Punkt's English model, a download rather than a package, and costs about 0.5 ms per sentence: 3 s for
20,000 characters of short sentences.

Texts with the same tokens (as the metric tokenizes them, lowercased for METEOR and ROUGE) score 1.0, and two texts
without tokens (empty, blank, or, for ROUGE, only punctuation) are the same. The libraries score some identical texts
lower: METEOR's fragmentation penalty, 0.5·(chunks/matches)³, takes half of a one-word answer's score ("Paris"
against "Paris": 0.5) and 1 − 0.5/n³ of an n-word one; ROUGE-n of a text shorter than n tokens is 0.0 ("New York"
against itself: rouge_3 0.0). A text without tokens against one with tokens scores 0.0.
"""

from __future__ import annotations

import io
import threading
import warnings
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from trainer.spec.graders.text_metrics import UNAVAILABLE, WORDNET_DIR

# The lexicographer files, numbered 00-44, as the lexnames(5WN) manual page that wordnet-base ships lists them. nltk's
# WordNet reader reads them from a `lexnames` file, which WordNet's own library has compiled in and Debian no longer
# ships. The last column is the syntactic category: 1 noun, 2 verb, 3 adjective, 4 adverb.
_LEXNAMES = (  # noqa: SIM905 (45 names: a list literal would take 45 lines)
    "adj.all adj.pert adv.all noun.Tops noun.act noun.animal noun.artifact noun.attribute noun.body noun.cognition "
    "noun.communication noun.event noun.feeling noun.food noun.group noun.location noun.motive noun.object "
    "noun.person noun.phenomenon noun.plant noun.possession noun.process noun.quantity noun.relation noun.shape "
    "noun.state noun.substance noun.time verb.body verb.change verb.cognition verb.communication verb.competition "
    "verb.consumption verb.contact verb.creation verb.emotion verb.motion verb.perception verb.possession "
    "verb.social verb.stative verb.weather adj.ppl"
).split()
_CATEGORIES = {"noun": 1, "verb": 2, "adj": 3, "adv": 4}
_LEXNAMES_FILE = "".join(
    f"{number:02d}\t{name}\t{_CATEGORIES[name.split('.')[0]]}\n" for number, name in enumerate(_LEXNAMES)
)


# nltk takes about a second to import and rouge-score as long (it imports nltk and numpy): both are imported on first
# use, so that importing trainer.grading.graders (the API process does) stays fast.


@cache
def _tokenize() -> Callable[[str], list[str]]:
    from nltk.tokenize import wordpunct_tokenize  # type: ignore[import-untyped]

    tokenize: Callable[[str], list[str]] = wordpunct_tokenize
    return tokenize


_wordnet_lock = threading.Lock()
_wordnet: Any = None


def wordnet() -> Any:
    """nltk's WordNetCorpusReader over WORDNET_DIR, loaded once per process (about 2 s: it indexes every lemma)."""
    global _wordnet
    with _wordnet_lock:
        if _wordnet is None:
            _wordnet = _load_wordnet(WORDNET_DIR)
        return _wordnet


def _load_wordnet(root: Path) -> Any:
    import nltk  # type: ignore[import-untyped]
    from nltk.corpus.reader.wordnet import WordNetCorpusReader  # type: ignore[import-untyped]

    class DebianWordNet(WordNetCorpusReader):  # type: ignore[misc]
        def open(self, file: str) -> io.TextIOBase:
            if file == "lexnames":
                return io.StringIO(_LEXNAMES_FILE)
            if file.startswith("data."):
                # Kept open for the process's life, nltk seeking to each synset's byte offset: nltk's own reader.
                return super().open(file)
            # An index or exception file is read once, line by line, at load: from memory rather than through
            # nltk's seekable stream reader, which takes twice as long.
            return io.StringIO((root / file).read_text(encoding="utf-8"))

        def map_wn(self, version: str = "wordnet") -> None:
            # nltk maps a WordNet other than its own downloaded copy onto that copy, for the Open Multilingual
            # Wordnet; this one is WordNet 3.0 itself, and only English is looked up.
            return None

    # nltk opens corpora only under the folders of its data path (its path sandbox): this registers ours.
    if str(root) not in nltk.data.path:
        nltk.data.path.append(str(root))
    with warnings.catch_warnings():
        # "The multilingual functions are not available": no Open Multilingual Wordnet is loaded, on purpose.
        warnings.simplefilter("ignore", UserWarning)
        return DebianWordNet(str(root), None)


def _score(text_tokens: list[str], reference_tokens: list[str], score: Callable[[], float]) -> float:
    """1.0 for the same tokens, 0.0 when only one text has tokens, else score() clipped to [0, 1]."""
    if text_tokens == reference_tokens:
        return 1.0
    if not text_tokens or not reference_tokens:
        return 0.0
    return min(1.0, max(0.0, float(score())))


def bleu(text: str, reference: str) -> float:
    """Sentence BLEU of `text` against `reference` (module docstring: tokens, smoothing, short texts)."""
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu  # type: ignore[import-untyped]

    hypothesis, ref = _tokenize()(text), _tokenize()(reference)
    smoothing = SmoothingFunction().method4
    return _score(
        hypothesis, ref, lambda: sentence_bleu([ref], hypothesis, smoothing_function=smoothing, auto_reweigh=True)
    )


def gleu(text: str, reference: str) -> float:
    """Sentence GLEU of `text` against `reference`: min(precision, recall) of their 1- to 4-grams."""
    from nltk.translate.gleu_score import sentence_gleu  # type: ignore[import-untyped]

    hypothesis, ref = _tokenize()(text), _tokenize()(reference)
    return _score(hypothesis, ref, lambda: sentence_gleu([ref], hypothesis))


def meteor(text: str, reference: str) -> float:
    """METEOR of `text` against `reference`, with WordNet 3.0 synonyms (module docstring)."""
    from nltk.translate.meteor_score import single_meteor_score  # type: ignore[import-untyped]

    hypothesis, ref = _tokenize()(text), _tokenize()(reference)
    # single_meteor_score lowercases every token (its `preprocess`): texts that differ only in case are the same.
    return _score(
        [token.lower() for token in hypothesis],
        [token.lower() for token in ref],
        lambda: single_meteor_score(ref, hypothesis, wordnet=wordnet()),
    )


@cache
def _rouge_scorer(rouge_type: str) -> Any:
    from rouge_score.rouge_scorer import RougeScorer  # type: ignore[import-untyped]

    return RougeScorer([rouge_type])


@cache
def _rouge_tokenize() -> Callable[[str], list[str]]:
    from rouge_score.tokenizers import DefaultTokenizer  # type: ignore[import-untyped]

    tokenize: Callable[[str], list[str]] = DefaultTokenizer(use_stemmer=False).tokenize
    return tokenize


def rouge(rouge_type: str) -> Callable[[str, str], float]:
    """The F-measure of rouge-score's `rouge_type` ("rouge1" … "rouge5") of `text` against `reference`."""

    def score(text: str, reference: str) -> float:
        tokenize = _rouge_tokenize()
        return _score(
            tokenize(text),
            tokenize(reference),
            lambda: _rouge_scorer(rouge_type).score(reference, text)[rouge_type].fmeasure,
        )

    score.__name__ = score.__qualname__ = rouge_type
    return score


def rouge_l(text: str, reference: str) -> float:
    """rouge-score's rougeL F-measure of `text` against `reference`: with L the length of a longest common subsequence
    of their tokens, P = L / len(text tokens), R = L / len(reference tokens), F = 2PR / (P + R).

    rouge-score fills an L table in Python, O(n·m) in time and memory (10 s and 100 MB for two texts of 20,000
    characters, 100 s for 10,000 one-letter words); RapidFuzz's LCSseq computes the same L in C, bit-parallel
    (O(n·m/64)), and rouge-score's tokenizer and F-measure do the rest, so the score is rouge-score's to the bit.
    """
    from rapidfuzz.distance import LCSseq
    from rouge_score.scoring import fmeasure  # type: ignore[import-untyped]

    tokenize = _rouge_tokenize()
    prediction, target = tokenize(text), tokenize(reference)

    def score() -> float:
        lcs = LCSseq.similarity(target, prediction)
        return float(fmeasure(lcs / len(prediction), lcs / len(target)))

    return _score(prediction, target, score)


METRICS: dict[str, Callable[[str, str], float]] = {
    "bleu": bleu,
    "gleu": gleu,
    **({} if "meteor" in UNAVAILABLE else {"meteor": meteor}),
    **{f"rouge_{n}": rouge(f"rouge{n}") for n in range(1, 6)},
    "rouge_l": rouge_l,
}
# At 20,000 characters a side each metric takes 0.05-0.3 s (rouge-score's own rougeL took 10-100 s: rouge_l()), except
# METEOR, which looks up every unmatched word's WordNet synonyms: 1-2 s for 20,000 characters of "cut cut cut ..."
# (70 senses each) against a text with no word in common. Half that length bounds it by about a second.
MAX_CHARS: dict[str, int] = {"meteor": 10_000}


def prepare(metric: str) -> None:
    """Import what `metric` needs and, for meteor, load WordNet: about a second, two to five for meteor, once per
    process; a grading process may call this before it starts timing its first sample."""
    if metric == "meteor":
        wordnet()
    METRICS[metric]("a text", "another text")  # not the same tokens: the library is called
