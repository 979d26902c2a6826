"""docs/reference/*.md are generated from the code (scripts/reference.py) and must match it.

When ``test_reference_docs_are_current`` fails, regenerate with ``python scripts/reference.py``
and commit the result. No server is started: the generator only builds parsers and a bare
FastAPI app.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _load_script():
    spec = importlib.util.spec_from_file_location("reference_docs_script",
                                                  REPO_ROOT / "scripts" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reference = _load_script()


@pytest.fixture(scope="module")
def docs() -> dict[str, str]:
    return {path.name: text for path, text in reference.render().items()}


def test_reference_docs_are_current():
    problems = reference.stale()
    assert not problems, "\n".join(problems)


def test_check_reports_a_stale_and_a_missing_file(tmp_path):
    reference.write(tmp_path)
    assert reference.stale(tmp_path) == []
    flags = tmp_path / reference.DOCS_DIR / "flags.md"
    flags.write_text(flags.read_text().replace("--enable-morph", "--enable-something-else"))
    (tmp_path / reference.DOCS_DIR / "cli.md").unlink()
    assert reference.stale(tmp_path) == [
        "docs/reference/flags.md is stale; run python scripts/reference.py",
        "docs/reference/cli.md is missing; run python scripts/reference.py",
    ]


def test_output_is_deterministic_and_has_no_local_paths(docs):
    again = {path.name: text for path, text in reference.render().items()}
    assert again == docs
    for text in docs.values():
        assert str(REPO_ROOT) not in text and str(Path.home()) not in text
        assert text.endswith("\n") and not text.endswith("\n\n")


def test_flags_by_mechanism(docs):
    rows = {line.split(" | ")[0].strip("| `"): line for line in docs["flags.md"].splitlines()
            if line.startswith("| `--")}
    assert rows["--enable-morph"].startswith("| `--enable-morph` | (switch) | `false` |")
    assert "one of `accuracy`, `default`, `performance`" in rows["--morph-mode"]
    assert rows["--kunserve-link-port"].startswith("| `--kunserve-link-port` | `PORT` (int) |")
    assert "--enable-kunserve" in rows
    text = docs["flags.md"]
    assert text.index("## sglang-morph\n") < text.index("--enable-morph")
    assert text.index("## sglang-morph KunServe\n") < text.index("--enable-kunserve")


def test_routes_with_auth_body_and_answers(docs):
    text = docs["http-api.md"]
    sections = {part.split("\n", 1)[0]: part for part in text.split("### ")[1:]}
    status = sections["`GET /morph/status`"]
    assert "- **Auth:** normal:" in status and "- **Body:** none." in status
    swap = sections["`POST /morph/swap`"]
    assert "- **Auth:** admin-optional:" in swap
    assert '{"layers": [0, 3], "bits": 4}' in swap and "409 when a restore is refused" in swap
    assert "`GET /kunserve/status`" in sections
    for route in ("`POST /kunserve/drop`", "`POST /kunserve/restore`"):
        assert "- **Auth:** admin-optional:" in sections[route]
        assert '- **Body:** `{"group": [2, 3]}`, the ' in sections[route]
        assert ("none, or an empty JSON object, for the whole group on a launch of one group"
                in sections[route])


def test_commands_and_subcommands(docs):
    text = docs["cli.md"]
    for heading in ("## `python -m sglang_morph.morph.build_engines`",
                    "## `python -m sglang_morph.morph.profile_layers`",
                    "### `python -m sglang_morph.splitquant plan`",
                    "### `python -m sglang_morph.iserve select`",
                    "### `python -m sglang_morph.models path`"):
        assert heading + "\n" in text
    assert "--w4-group-size auto|128|64|32" in text
    assert max(len(line) for line in text.splitlines() if not line.startswith("    ")) <= 100


def test_endpoint_docstrings_must_state_body_and_answers():
    async def no_answers(request):
        """Does something.

        Body: a JSON object."""

    async def body_unstated(request):
        """Does something.

        Answers: 200."""

    async def body_without_request():
        """Does something.

        Body: a JSON object.

        Answers: 200."""

    for endpoint, message in ((no_answers, "no 'Answers:'"), (body_unstated, "needs a 'Body:'"),
                              (body_without_request, "reads no body")):
        with pytest.raises(reference.ReferenceDocError, match=message):
            reference.docstring_sections(endpoint)

    async def documented(request):
        """Does ``x``.

        Body: ``{"a": 1}``,
        wrapped.

        Answers: 200; 400."""

    assert reference.docstring_sections(documented) == {
        "summary": "Does `x`.", "Body:": '`{"a": 1}`, wrapped.', "Answers:": "200; 400."}
