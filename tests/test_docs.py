"""The examples in README.md and docs/*.md run as shown, name only commands and flags that exist, and
docs/architecture.md's layout names every module.

Marking an example as tested: put the HTML comment `<!-- test: cheap -->` on its own line right
before a ```bash or ```python fence (blank lines between are allowed). GitHub does not render the comment.

    <!-- test: cheap -->
    ```bash
    torchcls train --data mnist-5k --epochs 1 --name digits
    torchcls evaluate runs/digits   # expect: top1
    ```

- The cheap blocks run in reading order (README.md first, then docs/*.md by name), each shell block
  as one `bash -e -o pipefail` script and each Python block as one `python -c` program, all in one
  fresh temporary directory, so a later block (or a doc page) uses the runs an earlier one wrote, as
  a reader following the README would: README's quickstart trains `runs/digits`, and the pages may
  use it. The project's .venv/bin is first on PATH and `.venv` is linked into that directory, so
  `source .venv/bin/activate`, `torchcls ...` and `.venv/bin/python ...` work as written. Each block
  must exit with code 0.
- The placeholders the docs use for the reader's own images exist there, tiny (PLACEHOLDERS):
  `path/to/images` is a plain class-folder tree (two classes of 32 px PNGs), `path/to/dataset` the
  same laid out as `train/` and `val/`.
- `# expect: TEXT` at the end of a line (or on its own line) in a cheap block: the block's
  combined stdout and stderr must contain TEXT.
- A cheap block's output must not contain a line that reads as an error on a successful run (ALARMING:
  a traceback, a library's "ERROR:" or "Failed to open ..." lines; torchcls.noise silences the known ones).
- Mark cheap only what runs in seconds to about a minute, so that all cheap blocks together stay
  under about four minutes on a 2-core CPU. Examples that need a GPU, several processes, a
  server or a long run stay unmarked; the command/flag check below still covers them.

Every `torchcls COMMAND [SUBCOMMAND]` in a code block or inline code span of the docs must be a
command of the CLI, and every `--flag` after it must appear in that command's `--help`; an inline
code span that starts with `--` (an option list) must name flags of some command. So the docs cannot
drift from the parser.

The "Layout" section of docs/architecture.md names every module under src/torchcls, each as its path
in backquotes (`training/build.py`, a package's `__init__.py` as `training/`), and names no file that
does not exist: a new module without a line there fails, as does a line left behind by a removed one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from conftest import make_image_folder

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
TORCHCLS = str(VENV_BIN / "torchcls")
MARKER = "<!-- test: cheap -->"
BLOCK_TIMEOUT_S = 600
# What a successful command must not print (each was printed by one before torchcls.noise, schedule.py or the CLI
# fixed it): tracebacks, kineto's GPU probe, cpp_extension's CUDA notice, ExecuTorch's cpuinfo probe, the
# _pytree deprecation at torchao's import, timm's one-step cosine warning.
ALARMING = ("Traceback (most recent call last)", "ERROR", "gpuGetDeviceCount", "No CUDA runtime is found",
            "Failed to open midr file", "is an Enum subclass", "will have no effect on the learning rate")

# flags of other programs that the docs show on their own (torchrun, pip, pytest, cmake)
OTHER_TOOLS_FLAGS = {"--standalone", "--nproc-per-node", "--nnodes", "--max-restarts", "--rdzv-backend",
                     "--rdzv-endpoint", "--rdzv-id", "--build", "--timeout"}


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    cheap: bool


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, with whether the cheap marker precedes them."""
    found, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(```+)\s*([\w-]*)", lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence.group(2))), len(lines))
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        found.append(Block(path, i + 1, fence.group(3), "\n".join(lines[i + 1:end]), before == MARKER))
        i = end + 1
    return found


def expectations(script: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"#\s*expect:\s*(.+)$", script, re.MULTILINE)]


SHELLS = ("bash", "sh", "shell")


def run_block(block: Block, workdir: Path) -> None:
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "TMPDIR": str(workdir / ".tmp"), "TORCHINDUCTOR_CACHE_DIR": str(workdir / ".inductor"),
           "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPATH", None)
    if block.lang == "python":  # the interpreter the README's venv gives, as `python` after activating it
        command = [str(VENV_BIN / "python"), "-c", block.text]
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", block.text]
    result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    output = result.stdout + result.stderr
    where = f"{block.path.relative_to(REPO)}:{block.line}"
    assert result.returncode == 0, f"{where}: exit code {result.returncode}\n{block.text}\n--- output ---\n{output[-4000:]}"
    for text in expectations(block.text):
        assert text in output, f"{where}: expected {text!r} in the output\n--- output ---\n{output[-4000:]}"
    alarming = [line for line in output.splitlines() if any(a in line for a in ALARMING)]
    assert not alarming, f"{where}: a successful run printed lines that read as errors:\n" + "\n".join(alarming)


def _cheap_files() -> list[Path]:
    return [p for p in doc_files() if any(b.cheap for b in blocks(p))]


@pytest.fixture(scope="module")
def docs_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory for every doc file's examples, in reading order (see the module docstring)."""
    workdir = tmp_path_factory.mktemp("docs")
    (workdir / ".tmp").mkdir()
    (workdir / ".venv").symlink_to(VENV_BIN.parent)
    make_placeholders(workdir)
    return workdir


PLACEHOLDERS = {"path/to/images": 12, "path/to/dataset/train": 8, "path/to/dataset/val": 4}  # images per class


def make_placeholders(workdir: Path) -> None:
    """The reader's own images that the docs' examples name, as small class-folder trees."""
    for folder, per_class in PLACEHOLDERS.items():
        make_image_folder(workdir / folder, per_class=per_class, size=32)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # ~4 minutes alone; a machine shared with other jobs can make it several times that
@pytest.mark.parametrize("path", _cheap_files(), ids=lambda p: p.name)
def test_cheap_examples_run(path: Path, docs_workdir: Path):
    for block in blocks(path):
        if block.cheap:
            assert block.lang in (*SHELLS, "python"), f"{path.name}:{block.line}: only shell and Python blocks run"
            run_block(block, docs_workdir)


def test_the_cheap_marker_is_found(tmp_path: Path):
    doc = tmp_path / "x.md"
    doc.write_text(f"{MARKER}\n\n```bash\necho hi  # expect: hi\n```\n\n```bash\nfalse\n```\n```python\nx\n```\n")
    found = blocks(doc)
    assert [(b.lang, b.cheap, b.line) for b in found] == [("bash", True, 3), ("bash", False, 7), ("python", False, 10)]
    assert expectations(found[0].text) == ["hi"]
    assert _cheap_files(), "no doc example is marked cheap: the docs are not tested"


# --- commands and flags shown in the docs exist ---

@cache
def help_text(command: tuple[str, ...]) -> str:
    result = subprocess.run([TORCHCLS, *command, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"torchcls {' '.join(command)} --help failed:\n{result.stderr[-2000:]}"
    return result.stdout


def subcommands(command: tuple[str, ...]) -> set[str]:
    """Commands listed under 'positional arguments' (argparse indents each by 4 spaces)."""
    text = help_text(command)
    section = text.split("positional arguments:", 1)[1].split("\noptions:", 1)[0] if "positional arguments:" in text else ""
    return {m.group(1) for m in re.finditer(r"^ {4}([a-z][a-z0-9-]*)\b", section, re.MULTILINE)}


def flags(command: tuple[str, ...]) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", help_text(command)))


def all_flags() -> set[str]:
    found = set()
    for name in subcommands(()):
        found |= flags((name,))
        for sub in subcommands((name,)):
            found |= flags((name, sub))
    return found


def code_segments(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every shell line (backslash continuations joined) and inline code span."""
    segments = []
    for block in blocks(path):
        if block.lang == "python":
            continue
        joined = re.sub(r"\\\n\s*", " ", block.text)
        segments += [(block.line, line) for line in joined.splitlines()]
    in_fence, paragraph = False, []
    for n, line in enumerate([*path.read_text().splitlines(), ""], 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        elif not in_fence and line.strip():
            paragraph.append((n, line))
        elif paragraph:
            # a paragraph about a benchmark script shows that script's own flags, not torchcls's
            if not any("benchmarks/" in text for _, text in paragraph):
                segments += [(k, span) for k, text in paragraph for span in re.findall(r"`([^`]+)`", text)]
            paragraph = []
    return segments


INVOCATION = re.compile(r"(?<![\w./-])(?:\S*/)?torchcls\s+((?:[a-z][a-z0-9-]*\s*){1,2})")


def check_segment(text: str) -> list[str]:
    """What in one line of docs is not in the parser."""
    text = text.split(" #", 1)[0] if not text.lstrip().startswith("#") else ""
    if re.match(r"\s*(from|import)\s", text):
        return []
    problems = []
    for m in INVOCATION.finditer(text):
        words = m.group(1).split()
        if words[0] not in subcommands(()):
            problems.append(f"unknown command 'torchcls {words[0]}'")
            continue
        command = (words[0],)
        if subcommands(command):
            if len(words) < 2 or words[1] not in subcommands(command):
                problems.append(f"unknown command 'torchcls {' '.join(words)}'")
                continue
            command = (words[0], words[1])
        rest = re.split(r"\s(?:\||;|&&|&|>|<)", text[m.end():], maxsplit=1)[0]
        problems += [f"'torchcls {' '.join(command)}' has no {flag}"
                     for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest) if flag not in flags(command)]
    if text.startswith("--") and not INVOCATION.search(text):
        problems += [f"no torchcls command has {flag}" for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text)
                     if flag not in all_flags() and flag not in OTHER_TOOLS_FLAGS]
    return problems


@pytest.mark.slow
def test_documented_commands_and_flags_exist():
    assert "--epochs" in all_flags()  # every command's and sub-command's --help runs
    problems = []
    for path in doc_files():
        for line, segment in code_segments(path):
            problems += [f"{path.relative_to(REPO)}:{line}: {p}  (in: {segment.strip()[:100]})"
                         for p in check_segment(segment)]
    assert not problems, "the docs name commands or flags the CLI does not have:\n" + "\n".join(problems)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_resolve():
    problems = []
    for path in doc_files():
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            file, _, fragment = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                problems.append(f"{path.relative_to(REPO)}: {target} does not exist")
            elif fragment and dest.suffix == ".md":
                anchors = {anchor(h) for h in re.findall(r"^#+\s+(.+)$", dest.read_text(), re.MULTILINE)}
                if fragment not in anchors:
                    problems.append(f"{path.relative_to(REPO)}: {target}: no heading #{fragment}")
    assert not problems, "broken links in the docs:\n" + "\n".join(problems)


def test_flag_checker_catches_drift():
    assert check_segment("torchcls train --data mnist-5k --epochs 1") == []
    assert check_segment("torchcls train --epoch 1") == ["'torchcls train' has no --epoch"]
    assert check_segment("torchcls trian --epochs 1") == ["unknown command 'torchcls trian'"]
    assert check_segment("torchcls bench compile --models a | grep --count x") == []
    assert check_segment("torchcls bench speed") == ["unknown command 'torchcls bench speed'"]
    assert check_segment("--data --root --no-such-flag") == ["no torchcls command has --no-such-flag"]
    assert check_segment("from torchcls import load_artifact") == []


# --- the layout in docs/architecture.md names every module ---

ARCHITECTURE = REPO / "docs" / "architecture.md"
PACKAGE = REPO / "src" / "torchcls"


def layout_names(text: str) -> set[str]:
    """The backquoted names in the "## Layout" section (up to the next second-level heading)."""
    section = re.split(r"^## Layout\s*$", text, maxsplit=1, flags=re.MULTILINE)
    assert len(section) == 2, f"{ARCHITECTURE.name} has no '## Layout' section"
    body = re.split(r"^## ", section[1], maxsplit=1, flags=re.MULTILINE)[0]
    return set(re.findall(r"`([^`\s]+)`", body))


def module_names(path: Path, package: Path = PACKAGE) -> set[str]:
    """The names a layout may give one module: its path under src/torchcls, or its dotted name."""
    rel = path.relative_to(package)
    dotted = ".".join(("torchcls", *rel.with_suffix("").parts))
    if rel.name == "__init__.py":
        folder = rel.parent.as_posix()
        dotted = dotted.removesuffix(".__init__")
        return {rel.as_posix(), dotted} | ({f"{folder}/"} if folder != "." else set())
    return {rel.as_posix(), dotted}


def layout_problems(names: set[str], package: Path) -> list[str]:
    modules = sorted(package.rglob("*.py"))
    missing = [p.relative_to(package).as_posix() for p in modules if not module_names(p, package) & names]
    stale = [n for n in sorted(names) if n.endswith((".py", "/")) and not (package / n).exists()]
    return ([f"no line for {m}" for m in missing]
            + [f"names {n}, which is not under src/torchcls" for n in stale])


def test_architecture_layout_names_every_module():
    problems = layout_problems(layout_names(ARCHITECTURE.read_text()), PACKAGE)
    assert not problems, f"{ARCHITECTURE.relative_to(REPO)} '## Layout' is out of date:\n" + "\n".join(problems)


def test_layout_check_catches_a_new_and_a_removed_module(tmp_path: Path):
    pkg = tmp_path / "torchcls"
    (pkg / "data").mkdir(parents=True)
    for name in ("__init__.py", "cli.py", "data/__init__.py", "data/scan.py"):
        (pkg / name).write_text("")
    text = "## Layout\n\n- `__init__.py`\n- `cli.py`\n- `data/`\n- `torchcls.data.scan`\n\n## Next\n`new.py`\n"
    assert layout_problems(layout_names(text), pkg) == []
    (pkg / "data" / "new.py").write_text("")
    (pkg / "cli.py").unlink()
    assert layout_problems(layout_names(text), pkg) == ["no line for data/new.py",
                                                        "names cli.py, which is not under src/torchcls"]
