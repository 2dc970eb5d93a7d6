"""Bounds on user input: the size of a grader object and the cost of grading one sample."""

# Bounds on user input. A grader is parsed where it arrives (the API's request threads, the trainer's config) and
# graded in a process of its own (trainer.grading.pool), so both its size and the cost of grading one sample are
# bounded: every check below is linear in its input, and the caps keep that input small.
MAX_GRADER_DEPTH = 8  # multi graders nested in one another: a multi is depth 1, a multi inside it depth 2, ...
MAX_GRADERS = 32  # graders in one grader object, multi graders and their leaves counted alike
MAX_NAME_CHARS = 128  # a grader's `name` and a multi's keys (they name metrics: `reward/<key>/mean`)
MAX_TEMPLATE_CHARS = 10_000  # each string field that may hold `{{...}}` references
MAX_FORMULA_CHARS = 1_000
MAX_FORMULA_DEPTH = 32
MAX_PATTERN_CHARS = 1_000  # a regex grader's pattern
# Regular expressions run on RE2 (linear time in the text; no backreferences or lookarounds). RE2 refuses a pattern
# whose compiled program is larger than about 2/3 of this memory budget ("pattern too large"), which also bounds the
# time to compile one (a few tens of milliseconds at most, with the GIL released).
RE2_MAX_MEM = 1 << 20
MAX_REGEX_INPUT_CHARS = 10_000  # a regex grader searches the first this many characters of its rendered input
# text_similarity compares texts of at most this many characters each (a C implementation, O(n·m/64) word operations:
# about 15 ms at the cap); a longer rendered input or reference scores 0.0 with an error flag.
MAX_SIMILARITY_CHARS = 20_000
