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


FEATURE_CHECKLIST = ROOT / "docs" / "adding-a-kernel-feature.md"


def _checklist_files() -> list[str]:
    """The files of the checklist's numbered list (``1. `metrale_attn/config.py`: ...``)."""
    return re.findall(r"^\d+\. `([^`]+)`", FEATURE_CHECKLIST.read_text(), re.MULTILINE)


COUNTS = {"three": 3, "four": 4, "five": 5, "six": 6, "seven": 7}


def test_the_feature_checklist_names_as_many_files_as_its_title_says_and_each_exists():
    """The title's count ("a five-file checklist") and the sentences that repeat it are the
    numbered list's length."""
    text, files = FEATURE_CHECKLIST.read_text(), _checklist_files()
    title = re.match(r"# .*: an? (\w+)-file checklist\n", text)
    assert title and COUNTS[title.group(1)] == len(files), files
    assert f"by editing {title.group(1)} files" in text and f"the {title.group(1)} files:" in text
    assert [f for f in files if not (ROOT / f).is_file()] == []


def test_every_line_the_feature_checklist_quotes_stands_in_the_file_it_names():
    """A quoted block opens with a comment naming its file; each of its lines but `...` is a
    line of that file (indentation aside), so the worked example cannot drift from the code."""
    files, stale = _checklist_files(), []
    blocks = re.findall(r"^```\w*\n(.*?)^```", FEATURE_CHECKLIST.read_text(), re.MULTILINE | re.DOTALL)
    quoted = [b.splitlines() for b in blocks if re.match(r"(#|//) \S+\.\w+$", b.splitlines()[0])]
    assert set(files) <= {lines[0].split()[1] for lines in quoted}  # every file of the checklist is quoted
    for lines in quoted:
        have = {line.strip() for line in (ROOT / lines[0].split()[1]).read_text().splitlines()}
        stale += [f"{lines[0]}: {line.strip()}" for line in lines[1:] if line.strip() not in ("", "...", *have)]
    assert stale == []


def test_a_features_kernel_code_stands_in_one_kernel_file_the_checklists_core():
    """The checklist's rule on the kernel side: each feature's define (PD_WINDOW, ...) appears in
    one kernel file, the one the checklist names (and, for a feature the simt kernels serve too,
    their one core), and the window's parameter there and in the kernel's parameter list
    (mma_kernel.cuh) only."""
    from metrale_attn.config import FEATURES, feature_define
    from metrale_attn.features import SIMT_FEATURES

    core = next(f for f in _checklist_files() if f.startswith("kernels_cu/"))
    sources = [p for p in sorted((ROOT / "kernels_cu").rglob("*")) if p.suffix in (".cu", ".cuh")]
    simt_core = "kernels_cu/simt/simt_core.cuh"
    for word, files in [(feature_define(name), sorted({core, simt_core} if name in SIMT_FEATURES else {core}))
                        for name in FEATURES] + [
            ("window_left", sorted([core, "kernels_cu/mma_kernel.cuh"]))]:
        holding = [str(p.relative_to(ROOT)) for p in sources if re.search(rf"\b{word}\b", p.read_text())]
        assert holding == files, word
