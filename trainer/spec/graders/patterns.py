"""Regular expressions of regex graders: RE2, whose matching time is linear in the text whatever the pattern (no
backtracking). A pattern is checked here where the grader arrives; grading compiles its own
(trainer.grading.graders.text)."""

import re2

from trainer.spec.graders.limits import RE2_MAX_MEM


def _re2_options() -> re2.Options:
    options = re2.Options()
    options.max_mem = RE2_MAX_MEM
    options.log_errors = False  # a refused pattern is the user's error, reported to them, not logged by RE2
    return options


RE2_OPTIONS = _re2_options()


def check_pattern(pattern: str) -> None:
    """ValueError saying why RE2 refuses `pattern` (RE2 syntax: no backreferences, no lookarounds)."""
    try:
        re2.compile(pattern, RE2_OPTIONS)
    except re2.error as exc:
        detail = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise ValueError(
            f"invalid regular expression: {detail} (patterns use RE2 syntax: no backreferences like \\1, no "
            "lookarounds like (?=...) or (?<=...), no atomic groups or possessive repeats)"
        ) from None
    finally:
        # re2.compile keeps the last 128 patterns it compiled; a check has no use for them, and each may hold up to
        # RE2_MAX_MEM, so the process that validates (the API) keeps none. Grading keeps its own
        # (trainer.grading.graders.text).
        re2.purge()


# OpenAI's regex flags map onto RE2's inline flags, the same letters.
REGEX_FLAGS = ("i", "m", "s")
