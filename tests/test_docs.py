"""The documentation is the repository's own: every file it links exists, and nothing cites a
document the repository does not contain."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "cuda_on_cpu" / "README.md"]
SOURCES = ("metrale_attn", "cuda_on_cpu", "kernels_cu", "tests", "benchmarks", "docs")
SUFFIXES = {".py", ".md", ".cu", ".cuh", ".h", ".cpp", ".sh", ".toml"}
ABSENT = re.compile(r"DESIGN\.md|\bDESIGN\b|attn_splitk|\bthe seed\b|\bseed's|specification's|"
                    r"metrale-model-layers|sizes\.rs|kernels/(?:hopper|gb10|b200|b300)/")
"""Documents that were never part of this repository: the design brief, the policy's
original specification and the code base it came from."""


def test_the_readme_points_at_each_document_of_docs():
    readme = (ROOT / "README.md").read_text()
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{doc.name})" in readme, doc.name


def test_every_relative_link_of_the_readme_and_the_docs_names_a_file_that_exists():
    missing = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target and not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not missing


def test_nothing_cites_a_document_the_repository_does_not_contain():
    citing = []
    files = [ROOT / "README.md", ROOT / "pyproject.toml"]
    files += [p for folder in SOURCES for p in (ROOT / folder).rglob("*") if p.suffix in SUFFIXES]
    for path in sorted(set(files) - {pathlib.Path(__file__).resolve()}):
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if ABSENT.search(line):
                citing.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not citing
