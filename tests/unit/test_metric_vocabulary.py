"""The metric vocabulary (trainer/spec/metrics.py) and the dashboard's use of it: the names are defined once, the API
can serve them without torch, and the dashboard's modules name metrics only through the generated ``vocabulary.js``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.routes import dashboard
from trainer.spec import metrics as M

JS_DIR = dashboard.STATIC_DIR / "js"
VOCABULARY_JS = JS_DIR / "vocabulary.js"  # served by a route, never a file
NAMED_IMPORT = re.compile(r"import\s*\{([^}]*)\}\s*from\s*\"([^\"]+)\"")
NAMESPACE_IMPORT = re.compile(r"import\s*\*\s*as\s+\w+\s+from\s*\"([^\"]+)\"")
QUOTED = re.compile(r"([\"'`])([a-z_]+(?:/[a-z_]+)*)\1")


def dashboard_modules() -> list[Path]:
    return sorted(JS_DIR.rglob("*.js"))


def spelled_metric_names(source: str) -> list[str]:
    """String literals in JavaScript source that are a metric name, or look like one of the vocabulary's (a name whose
    first segment is a vocabulary prefix: `loss/anything`), whether the trainer defines them or not."""
    prefixes = {name.split("/")[0] for name in M.METRICS if "/" in name}
    return [
        literal
        for _, literal in QUOTED.findall(source)
        if M.is_known(literal) or ("/" in literal and literal.split("/")[0] in prefixes)
    ]


def generated_exports() -> set[str]:
    body, _ = dashboard.vocabulary_module()
    return set(re.findall(r"^export const (\w+) =", body, flags=re.MULTILINE))


class TestVocabulary:
    def test_every_metric_and_family_has_exactly_one_constant(self) -> None:
        vocab = M.vocabulary()
        constants = [m["constant"] for m in vocab["metrics"]] + [f["constant"] for f in vocab["families"]]
        assert len(constants) == len(set(constants)) == len(M.METRICS) + len(M.FAMILIES)
        for entry in vocab["metrics"]:
            assert getattr(M, entry["constant"]) == entry["name"]
        aliases = [k for k, v in vars(M).items() if k.isupper() and isinstance(v, str) and v in M.METRICS]
        assert sorted(aliases) == sorted(m["constant"] for m in vocab["metrics"])

    def test_vocabulary_is_json_and_its_family_regexes_work_in_python(self) -> None:
        vocab = M.vocabulary()
        assert json.loads(json.dumps(vocab)) == vocab
        family = next(f for f in vocab["families"] if f["constant"] == "REWARD_OF_GRADER")
        assert family["pattern"] == "reward/{grader}/mean" and family["parameter"] == "grader"
        assert re.match(family["regex"], "reward/my/grader/mean").group(1) == "my/grader"  # type: ignore[union-attr]

    def test_timing_metrics_are_the_wall_clock_ones(self) -> None:
        assert {
            M.TOKENS_PER_S_GENERATION,
            M.TOKENS_PER_S_TRAINING,
            M.STEP_SECONDS,
            M.GENERATION_SECONDS,
            M.TOOL_LATENCY_MEAN,
        } == M.TIMING_METRICS

    def test_a_family_member_is_known_with_its_parameter_and_no_defined_name_is_of_a_family(self) -> None:
        assert M.reward_of("exact") == "reward/exact/mean"
        assert M.reward_of("a/b", validation=True) == "val/reward/a/b/mean"
        assert M.REWARD_OF_GRADER.parameter_of("reward/a/b/mean") == "a/b"
        assert M.REWARD_OF_GRADER.parameter_of("val/reward/a/mean") is None
        assert M.VAL_REWARD_OF_GRADER.parameter_of("val/reward/a/mean") == "a"
        assert M.is_known("reward/exact/mean") and M.is_known("val/reward/exact/mean")
        for name in M.METRICS:
            assert [f.pattern for f in M.FAMILIES if f.parameter_of(name) is not None] == [], name

    def test_names_the_trainer_never_emits_are_unknown(self) -> None:
        for name in ("loss/train", "loss/val", "reward/mean/extra", "reward//mean", "tokens/s/training", ""):
            assert not M.is_known(name), name

    def test_validation_of_a_metric_without_a_validation_series_names_the_defined_ones(self) -> None:
        assert M.validation(M.PREFERENCE_ACCURACY) == M.VAL_PREFERENCE_ACCURACY == "val/preference/accuracy"
        assert M.validation(M.TOKEN_ACCURACY) == M.VAL_TOKEN_ACCURACY
        with pytest.raises(ValueError, match=r"'grad_norm' has no validation series .*val/loss, "):
            M.validation(M.GRAD_NORM)

    def test_the_module_imports_nothing_outside_the_standard_library(self) -> None:
        # The API process serves the vocabulary; importing torch there is what the redesign removes.
        code = (
            "import sys, trainer.spec.metrics; "
            "heavy = [m for m in ('torch', 'numpy', 'transformers', 'pydantic') if m in sys.modules]; "
            "print(heavy)"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "[]"


class TestVocabularyModule:
    @pytest.fixture
    def client(self) -> TestClient:
        app = FastAPI()
        dashboard.install(app)
        return TestClient(app)

    def test_served_as_a_javascript_module_with_the_dashboards_security_headers(self, client: TestClient) -> None:
        r = client.get("/dashboard/js/vocabulary.js")
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/javascript; charset=utf-8"
        assert r.headers["content-security-policy"] == dashboard.SECURITY_HEADERS["content-security-policy"]
        assert r.headers["cache-control"] == "no-cache"
        assert 'export const LOSS_TOTAL = "loss/total";\n' in r.text
        assert 'export const VAL_LOSS = "val/loss";\n' in r.text
        assert not VOCABULARY_JS.exists(), "a static vocabulary.js would be a stale copy; the route serves it"

    def test_an_unchanged_module_revalidates_with_304(self, client: TestClient) -> None:
        etag = client.get("/dashboard/js/vocabulary.js").headers["etag"]
        again = client.get("/dashboard/js/vocabulary.js", headers={"if-none-match": etag})
        assert (again.status_code, again.content) == (304, b"")
        other = client.get("/dashboard/js/vocabulary.js", headers={"if-none-match": '"stale"'})
        assert other.status_code == 200

    def test_exports_every_constant_and_the_whole_vocabulary(self) -> None:
        body, _ = dashboard.vocabulary_module()
        vocab = M.vocabulary()
        assert generated_exports() == {"VOCABULARY"} | {e["constant"] for e in vocab["metrics"] + vocab["families"]}
        declared = re.search(r"^export const VOCABULARY = (.*?);$", body, flags=re.MULTILINE | re.DOTALL)
        assert declared is not None and json.loads(declared.group(1)) == vocab


class TestDashboardNamesOnlyVocabularyMetrics:
    def test_every_name_imported_from_the_vocabulary_is_exported_by_it(self) -> None:
        """What the browser checks when it links the modules, without a browser: an unknown name fails the page."""
        exported = generated_exports()
        imported: dict[str, set[str]] = {}
        for path in dashboard_modules():
            source = path.read_text()
            for names, target in NAMED_IMPORT.findall(source):
                if (path.parent / target).resolve() == VOCABULARY_JS:
                    imported[path.name] = {n.strip() for n in names.split(",") if n.strip()}
            # `import * as V` would turn an unknown name into `undefined`, a chart that silently stays empty.
            namespace = [t for t in NAMESPACE_IMPORT.findall(source) if (path.parent / t).resolve() == VOCABULARY_JS]
            assert namespace == [], f"{path.name}: import the metric names by name"
        for module, names in imported.items():
            assert names <= exported, (
                f"{module} imports {sorted(names - exported)}, which trainer/spec/metrics.py lacks"
            )
        assert {"metrics.js", "job.js", "jobs.js", "compare.js"} <= imported.keys()
        assert {"LOSS_TOTAL", "VAL_LOSS", "REWARD_OF_GRADER"} <= imported["metrics.js"]

    def test_no_module_spells_a_metric_name_itself(self) -> None:
        """A metric named in a string literal is a copy that can drift (as `loss/train` did): the modules take names
        from the vocabulary's exports."""
        offenders = {
            str(path.relative_to(JS_DIR)): spelled
            for path in dashboard_modules()
            if (spelled := spelled_metric_names(path.read_text()))
        }
        assert offenders == {}

    @pytest.mark.parametrize(
        ("source", "spelled"),
        [
            ('const key = "loss/train";', ["loss/train"]),
            ("m['reward/mean']", ["reward/mean"]),
            ("`grad_norm`", ["grad_norm"]),
            ('{ key: "reward/acc/mean" }', ["reward/acc/mean"]),
            ('api("/files"); h("a", { class: "badge" }); type = "application/json"; x = "val"', []),
        ],
    )
    def test_the_literal_check_finds_copied_and_invented_names_only(self, source: str, spelled: list[str]) -> None:
        assert spelled_metric_names(source) == spelled
