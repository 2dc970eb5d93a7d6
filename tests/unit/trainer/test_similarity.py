"""trainer.grading.similarity: text_similarity's bleu, gleu, meteor and rouge_* metrics.

Expected values are the libraries' published ones (nltk's doctests for GLEU and METEOR, rouge-score's test cases)
or computed by hand from the metric's definition (the formula is in the test); none is the library called again.
"""

from __future__ import annotations

import math
import random
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from trainer.grading import similarity
from trainer.grading.graders import grade
from trainer.grading.similarity import METRICS, bleu, gleu, meteor, rouge_l
from trainer.spec.graders import MAX_SIMILARITY_CHARS, parse_grader, text_metrics

rouge_1, rouge_2, rouge_3, rouge_4, rouge_5 = (METRICS[f"rouge_{n}"] for n in range(1, 6))

# nltk's doctests (nltk.translate.gleu_score and meteor_score): a hypothesis and a reference from Papineni et al.
HYP1 = "It is a guide to action which ensures that the military always obeys the commands of the party"
HYP2 = "It is to insure the troops forever hearing the activity guidebook that party direct"
REF1 = "It is a guide to action that ensures that the military will forever heed Party commands"


class TestBleu:
    def test_identical_texts_score_one(self) -> None:
        assert bleu("the cat sat on the mat", "the cat sat on the mat") == 1.0

    def test_geometric_mean_of_the_four_precisions(self) -> None:
        # 1- to 4-gram precisions 5/6, 3/5, 2/4, 1/3; both 6 tokens long: no brevity penalty
        assert bleu("the cat sat on a mat", "the cat sat on the mat") == pytest.approx((1 / 12) ** (1 / 4), rel=1e-12)

    def test_is_case_sensitive(self) -> None:
        # "The" matches nothing: precisions 5/6, 4/5, 3/4, 2/3
        assert bleu("The cat sat on the mat", "the cat sat on the mat") == pytest.approx((1 / 3) ** (1 / 4), rel=1e-12)

    def test_a_zero_precision_is_smoothed_by_chen_and_cherrys_method_4(self) -> None:
        # 5 tokens against 6: precisions 5/5, 3/4, 1/3 and 0/2 4-grams, which method 4 makes
        # 1 / (2^1 · 5 / ln 5) matches out of 2; brevity penalty exp(1 − 6/5)
        p4 = math.log(5) / 10 / 2
        expected = math.exp(1 - 6 / 5) * (1 * 3 / 4 * 1 / 3 * p4) ** (1 / 4)
        assert bleu("the cat on the mat", "the cat sat on the mat") == pytest.approx(expected, rel=1e-12)

    def test_a_text_of_three_tokens_is_scored_on_1_to_3_grams(self) -> None:
        # auto_reweigh: precisions 2/3, 1/2 and 0/1 trigrams, smoothed to ln 3 / 10; longer than the reference
        expected = (2 / 3 * 1 / 2 * math.log(3) / 10) ** (1 / 3)
        assert bleu("the cat sat", "the cat") == pytest.approx(expected, rel=1e-12)

    def test_short_identical_answers_score_one(self) -> None:
        assert bleu("Paris", "Paris") == 1.0
        assert bleu("New York", "New York") == 1.0

    def test_no_common_word_scores_zero(self) -> None:
        # nltk's bleu.doctest
        assert bleu("John loves Mary", "The candidate has no alignment to any of the references") == 0.0


class TestGleu:
    def test_nltk_published_values(self) -> None:
        # nltk.translate.gleu_score.sentence_gleu's doctest: 0.0909..., 0.4393..., 0.1206...
        assert gleu("the the the the the the the", "the cat is on the mat") == pytest.approx(0.0909, abs=1e-4)
        assert gleu(HYP1, REF1) == pytest.approx(0.4393, abs=1e-4)
        assert gleu(HYP2, REF1) == pytest.approx(0.1206, abs=1e-4)

    def test_min_of_ngram_precision_and_recall(self) -> None:
        # 7 + 6 + 5 + 4 = 22 n-grams in the text, 6 + 5 + 4 + 3 = 18 in the reference, 2 in common ("the" twice)
        assert gleu("the the the the the the the", "the cat is on the mat") == 2 / 22

    def test_punctuation_is_a_token_of_its_own(self) -> None:
        # "the cat sat ." has 4 + 3 + 2 + 1 = 10 n-grams, "the cat sat" 6, all 6 in common: min(6/10, 6/6).
        # Split on spaces only, "sat." would match nothing and the score would be 3/6.
        assert gleu("the cat sat.", "the cat sat") == 6 / 10

    def test_is_case_sensitive(self) -> None:
        # 5 + 4 + 3 + 2 = 14 of the 18 n-grams of each side match
        assert gleu("The cat sat on the mat", "the cat sat on the mat") == 14 / 18


class TestMeteor:
    def test_nltk_published_values(self) -> None:
        # nltk.translate.meteor_score.single_meteor_score's doctest and nltk/test/meteor.doctest
        assert meteor(HYP1, REF1) == pytest.approx(0.6944, abs=5e-5)
        assert meteor("on the mat sat the cat", "The cat sat on the mat") == 0.5
        assert meteor("The cat was sat on the mat", "The cat sat on the mat") == pytest.approx(0.9654, abs=5e-5)
        assert meteor("creates or updates a virtual machine scale set", "create or update a vm set") == pytest.approx(
            0.7806, abs=5e-5
        )
        assert meteor("John loves Mary", "The candidate has no alignment to any of the references") == 0.0

    def test_a_wordnet_synonym_matches(self) -> None:
        # "car" and "auto" share WordNet's synset car.n.01: 4 of 4 words match in one chunk, so P = R = 1 and the
        # fragmentation penalty is 0.5·(1/4)³. Without synonyms 3 words would match: 0.75·(1 − 0.5·(1/3)³) = 0.736.
        assert meteor("the car is red", "the auto is red") == 1 - 0.5 * (1 / 4) ** 3

    def test_a_porter_stem_matches(self) -> None:
        # "running" and "runs" both stem to "run": the same score as identical 3-word texts would get from nltk
        assert meteor("dogs running fast", "dogs runs fast") == 1 - 0.5 * (1 / 3) ** 3

    def test_case_is_ignored(self) -> None:
        assert meteor("The Cat", "the cat") == 1.0

    def test_identical_texts_score_one_without_the_fragmentation_penalty(self) -> None:
        # nltk alone: 0.5 for "Paris" against itself (0.5·(1 chunk / 1 match)³ taken off)
        assert meteor("Paris", "Paris") == 1.0

    def test_wordnet_is_debians_wordnet_30_with_its_lexicographer_files(self) -> None:
        wordnet = similarity.wordnet()
        assert wordnet.get_version() == "3.0"
        assert wordnet.synset("dog.n.01").lexname() == "noun.animal"
        assert wordnet.synset("run.v.01").lexname() == "verb.motion"
        assert "auto" in wordnet.synset("car.n.01").lemma_names()


class TestRouge:
    def test_rouge_score_published_values(self) -> None:
        # rouge-score's rouge_scorer_test.py: prediction, target, F-measure
        assert rouge_1("testing", "testing one two") == pytest.approx(1 / 2)
        assert rouge_2("testing one", "testing one two") == pytest.approx(2 / 3)
        assert rouge_l("testing one", "testing one two") == pytest.approx(4 / 5)
        assert rouge_l("testing two", "testing one two") == pytest.approx(4 / 5)
        for metric in (rouge_1, rouge_2, rouge_l):
            assert metric("", "testing one two") == 0.0

    def test_rouge_1_is_the_f_measure_of_unigrams(self) -> None:
        # P = 2/3, R = 2/2: F = 2PR / (P + R) = 0.8
        assert rouge_1("the cat sat", "the cat") == pytest.approx(0.8, rel=1e-12)

    def test_rouge_3_to_5_count_longer_ngrams(self) -> None:
        # 6 tokens each, the first five in common: 3 of 4 trigrams, 2 of 3 4-grams, 1 of 2 5-grams
        text, reference = "a b c d e f", "a b c d e x"
        assert rouge_3(text, reference) == pytest.approx(3 / 4, rel=1e-12)
        assert rouge_4(text, reference) == pytest.approx(2 / 3, rel=1e-12)
        assert rouge_5(text, reference) == pytest.approx(1 / 2, rel=1e-12)

    def test_rouge_l_is_the_f_measure_of_a_longest_common_subsequence(self) -> None:
        # LCS "a c e" (3) of 5 and 4 tokens: P = 3/5, R = 3/4, F = 2·(9/20) / (27/20) = 2/3
        assert rouge_l("a b c d e", "a c x e") == pytest.approx(2 / 3, rel=1e-12)

    def test_rouge_l_equals_rouge_scores_own_lcs_table(self) -> None:
        # rouge_l takes the LCS from RapidFuzz; rouge-score's pure-Python table must give the same scores
        from rouge_score.rouge_scorer import RougeScorer  # type: ignore[import-untyped]

        scorer = RougeScorer(["rougeL"])
        rng = random.Random(0)
        for _ in range(200):
            text = " ".join(rng.choice("abcdef") for _ in range(rng.randint(1, 30)))
            reference = " ".join(rng.choice("abcdef") for _ in range(rng.randint(1, 30)))
            assert rouge_l(text, reference) == scorer.score(reference, text)["rougeL"].fmeasure

    def test_lowercases_and_drops_punctuation(self) -> None:
        assert rouge_1("The CAT, sat!", "the cat sat") == 1.0
        assert rouge_l("The CAT, sat!", "the cat sat") == 1.0

    def test_no_stemming(self) -> None:
        # "cats" and "cat" differ: P = R = 1/2
        assert rouge_1("cats sat", "cat sat") == pytest.approx(0.5)

    def test_identical_texts_shorter_than_n_score_one(self) -> None:
        # rouge-score alone: 0.0 (neither text has a trigram)
        assert rouge_3("New York", "New York") == 1.0
        assert rouge_5("Paris", "Paris") == 1.0
        assert rouge_3("New York", "New Jersey") == 0.0


class TestEveryMetric:
    @pytest.mark.parametrize("metric", sorted(METRICS))
    def test_empty_and_identical_texts(self, metric: str) -> None:
        score = METRICS[metric]
        assert score("", "") == 1.0
        assert score("   \n", "") == 1.0
        assert score("", "a reference") == 0.0
        assert score("an answer", "") == 0.0
        assert score("Paris", "Paris") == 1.0
        assert score("the same long text, with punctuation.", "the same long text, with punctuation.") == 1.0

    @pytest.mark.parametrize("metric", sorted(METRICS))
    def test_scores_lie_in_zero_one(self, metric: str) -> None:
        rng = random.Random(metric)
        words = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", ".", ",", "!", "big", "large", "car", "auto"]
        for _ in range(50):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(0, 12)))
            reference = " ".join(rng.choice(words) for _ in range(rng.randint(0, 12)))
            assert 0.0 <= METRICS[metric](text, reference) <= 1.0

    def test_every_openai_metric_but_the_remote_ones_is_here(self) -> None:
        # OpenAI's evaluation_metric values, less fuzzy_match (trainer.grading.graders) and cosine (an embeddings
        # endpoint)
        expected = {"bleu", "gleu", "meteor", "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l"}
        assert set(METRICS) == expected
        assert text_metrics.UNAVAILABLE == {}


class TestWordNetMissing:
    def test_debians_wordnet_base_is_installed_here(self) -> None:
        assert text_metrics.wordnet_missing() is None

    def test_a_folder_without_wordnet_says_which_package_to_install(self, tmp_path: Path) -> None:
        reason = text_metrics.wordnet_missing(tmp_path)
        assert reason == (
            f"meteor matches synonyms from WordNet 3.0, which is not installed ({tmp_path}/index.noun is missing): "
            "install Debian's wordnet-base package"
        )


def text_similarity(metric: str) -> dict[str, Any]:
    return {
        "type": "text_similarity",
        "name": "sim",
        "input": "{{sample.output_text}}",
        "reference": "{{item.answer}}",
        "evaluation_metric": metric,
    }


class TestThroughTheGrader:
    @pytest.mark.parametrize(
        ("metric", "output", "answer", "expected"),
        [
            ("bleu", "the cat sat on a mat", "the cat sat on the mat", (1 / 12) ** (1 / 4)),
            ("gleu", "the the the the the the the", "the cat is on the mat", 2 / 22),
            ("meteor", "the car is red", "the auto is red", 1 - 0.5 * (1 / 4) ** 3),
            ("rouge_1", "the cat sat", "the cat", 0.8),
            ("rouge_2", "testing one", "testing one two", 2 / 3),
            ("rouge_3", "a b c d e f", "a b c d e x", 3 / 4),
            ("rouge_4", "a b c d e f", "a b c d e x", 2 / 3),
            ("rouge_5", "a b c d e f", "a b c d e x", 1 / 2),
            ("rouge_l", "a b c d e", "a c x e", 2 / 3),
        ],
    )
    def test_grade_scores_the_rendered_texts(self, metric: str, output: str, answer: str, expected: float) -> None:
        result = grade(parse_grader(text_similarity(metric)), output_text=output, item={"answer": answer})
        assert result.score == pytest.approx(expected, rel=1e-12)
        assert result.sub_scores == {"sim": result.score} and result.errors == ()

    @pytest.mark.parametrize("metric", sorted(METRICS))
    def test_a_text_over_the_cap_scores_zero_with_an_error_flag(self, metric: str) -> None:
        cap = similarity.MAX_CHARS.get(metric, MAX_SIMILARITY_CHARS)
        grader = parse_grader(text_similarity(metric))
        at_cap = ("word " * cap)[:cap]
        assert grade(grader, output_text=at_cap, item={"answer": at_cap}).score == 1.0
        result = grade(grader, output_text=at_cap + "s", item={"answer": at_cap})
        assert result.score == 0.0
        [error] = result.errors
        assert error.kind == "other"
        assert error == (
            f"grader 'sim': the rendered input is {cap + 1} characters long; {metric} compares texts of "
            f"at most {cap}; scored 0.0"
        )


def worst_cases(cap: int) -> dict[str, tuple[str, str]]:
    """Texts of `cap` characters that cost each metric most: the most tokens (one-letter words), punctuation, and
    for METEOR the word with the most WordNet senses ("cut", 70) against a text with nothing in common."""
    rng = random.Random(0)

    def one_letter_words() -> str:
        return " ".join(rng.choice(string.ascii_lowercase) for _ in range(cap // 2 + 1))[:cap]

    def punctuation() -> str:
        return "".join(rng.choice("a.!, ") for _ in range(cap))

    return {
        "one-letter words": (one_letter_words(), one_letter_words()),
        "punctuation": (punctuation(), punctuation()),
        "70 senses a word": (("cut " * cap)[:cap], ("zz " * cap)[:cap]),
    }


class TestTimeAtTheCap:
    @pytest.mark.alone
    @pytest.mark.parametrize("metric", sorted(METRICS))
    def test_texts_at_the_cap_score_well_within_the_sample_time_limit(self, metric: str) -> None:
        # Measured on an idle 2-core machine: at most 0.3 s, METEOR 1 s; the grading process kills a sample after
        # 10 s. The bound is generous for a shared machine.
        similarity.prepare(metric)
        cap = similarity.MAX_CHARS.get(metric, MAX_SIMILARITY_CHARS)
        for case, (text, reference) in worst_cases(cap).items():
            start = time.perf_counter()
            score = METRICS[metric](text, reference)
            seconds = time.perf_counter() - start
            assert 0.0 <= score <= 1.0
            assert seconds < 4.0, (case, seconds)


def test_importing_the_graders_imports_neither_nltk_nor_rouge_score() -> None:
    # The API imports trainer.grading.graders: nltk and rouge-score take about a second each to import, on first use
    # only.
    code = (
        "import sys, trainer.grading.graders; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'nltk', 'rouge_score', 'numpy', 'absl', 'torch'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
