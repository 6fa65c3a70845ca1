"""The README and docs/ hold: every `pd` command they show parses against the real CLI and its
recipe resolves, every page is in the site's nav, the README stays short and undated, its links
land, and the benchmark tables are the ones `benchmarks/tables.py` renders."""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.main import get_command
from typer.testing import CliRunner

from pdcli.cli import app
from pdcli.commands.plan import gpus_override, pareto_overrides
from pdcli.config import load_config

try:  # typer >= 0.2x carries its own copy of click; older ones use click itself
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover
    import click.exceptions as click_errors  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
DOC_FILES = [README, *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 250
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")

LAUNCHERS = {"srun"}
"""Commands that run `pd` (the rest of the line from the `pd` token on is the command)."""
SEPARATORS = {"&&", "||", ";", "&", "|"}
REDIRECTS = {">", ">>", "<", "2>"}
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*|\.\.\.|\[.*)$")
"""A token that stands for something (`RUN`, `RECIPE`, `...`, `[--step N]`): not a command to check."""
SKIPPED: dict[str, str] = {}
"""Commands shown in the docs that are not checked, each with why (exact text, as extracted).
A command with a placeholder token fails the test until it is made concrete or listed here."""


@dataclass(frozen=True)
class Command:
    where: str
    """`file:line` of the command's first line."""
    argv: tuple[str, ...]
    """The arguments after `pd`."""

    @property
    def text(self) -> str:
        return shlex.join(("pd", *self.argv))


def fenced_lines(path: Path) -> list[tuple[int, str]]:
    """(1-based line number, line) of every line inside a fenced code block, `\\` continuations
    joined onto their first line."""
    out: list[tuple[int, str]] = []
    inside, pending, start = False, "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            inside, pending = not inside, ""
            continue
        if not inside:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    return out


def split_commands(line: str) -> list[list[str]]:
    """The shell words of each command on `line` (`#` comments dropped, quotes removed; split at
    `&&`, `;`, `|`, `&`; a redirection and its target dropped)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words: list[list[str]] = [[]]
    tokens = iter(lexer)
    for token in tokens:
        if token in SEPARATORS:
            words.append([])
        elif token in REDIRECTS:
            next(tokens, None)
        else:
            words[-1].append(token)
    return [w for w in words if w]


def pd_argv(words: list[str]) -> list[str] | None:
    """The arguments of a `pd` command (`pd ...`, `.venv/bin/pd ...`, `srun ... pd ...`), or None."""
    if words[0] == "$":
        words = words[1:]
    if not words:
        return None
    if words[0] in ("pd", ".venv/bin/pd"):
        return words[1:]
    if words[0] in LAUNCHERS and "pd" in words:
        return words[words.index("pd") + 1:]
    return None


def doc_commands(paths: list[Path] = DOC_FILES) -> list[Command]:
    found = []
    for path in paths:
        for number, line in fenced_lines(path):
            stripped = line.strip()
            if not stripped.startswith(("pd ", ".venv/bin/pd ", "$ pd ", *(f"{w} " for w in LAUNCHERS))):
                continue
            for words in split_commands(stripped):
                argv = pd_argv(words)
                if argv is not None:
                    where = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
                    found.append(Command(f"{where}:{number}", tuple(argv)))
    return found


COMMANDS = doc_commands()
CHECKED = [c for c in COMMANDS if c.text not in SKIPPED]


def parse(argv: tuple[str, ...]) -> tuple[list[str], dict[str, Any]]:
    """Parse `pd ARGV` as the real app does (unknown options fail): the subcommand path and its
    parameters."""
    command: Any = get_command(app)
    ctx = command.make_context("pd", list(argv), resilient_parsing=False)
    names: list[str] = []
    while hasattr(command, "resolve_command"):  # a group: pd, pd config
        # click >= 8.2 keeps the subcommand's words in _protected_args (protected_args is deprecated)
        protected = ctx._protected_args if hasattr(ctx, "_protected_args") else ctx.protected_args
        rest = [*protected, *ctx.args]
        assert rest, f"pd {' '.join(names)} needs a subcommand"
        name, sub, rest = command.resolve_command(ctx, rest)
        assert name is not None and sub is not None
        names.append(name)
        command = sub
        ctx = command.make_context(name, rest, parent=ctx, resilient_parsing=False)
    return names, dict(ctx.params)


def config_of(names: list[str], params: dict[str, Any]) -> tuple[Path | None, list[str]] | None:
    """(recipe, overrides) as the subcommand loads them; None where it loads no recipe (a run
    directory, `pd plan diff`, `pd export`, `pd config models`)."""
    run_name = [f"run.name={params['run_name']}"] if params.get("run_name") else []
    if names in (["config", "show"], ["profile"], ["compile"], ["train"]):
        return params["recipe"], list(params["overrides"] or []) + run_name
    if names == ["report"]:
        run = params["run"]
        return (run, list(params["overrides"] or []) + run_name) if run.suffix in (".yaml", ".yml") else None
    if names == ["plan"]:
        args = list(params["args"] or [])
        if args[:1] == ["diff"]:
            return None
        recipe = Path(args.pop(0)) if args and args[0].endswith((".yaml", ".yml")) else None
        extra = pareto_overrides(args) if params["pareto"] else []
        items = args + run_name + extra
        if params["gpus"] is not None:
            items += gpus_override(load_config(recipe, items).config, params["gpus"])
        return recipe, items
    return None


def test_the_docs_show_commands() -> None:
    """The extraction finds the commands (a broken extractor would check nothing)."""
    assert len(COMMANDS) >= 60
    assert {c.argv[0] for c in COMMANDS} >= {"config", "profile", "plan", "compile", "train", "report", "export"}
    assert any(c.argv[:2] == ("plan", "diff") for c in COMMANDS)


def test_skipped_commands_are_still_shown() -> None:
    shown = {c.text for c in COMMANDS}
    assert not set(SKIPPED) - shown, "SKIPPED lists commands no page shows any more"


@pytest.mark.parametrize("command", CHECKED, ids=lambda c: c.where)
def test_doc_command_parses(command: Command) -> None:
    """Its subcommand, options and arguments parse as `pd` parses them: an unknown flag fails."""
    placeholders = [w for w in command.argv if PLACEHOLDER.match(w)]
    assert not placeholders, (
        f"{command.where}: `{command.text}` has placeholders {placeholders}: make it concrete or add it to SKIPPED")
    try:
        parse(command.argv)
    except click_errors.ClickException as e:
        pytest.fail(f"{command.where}: `{command.text}` does not parse: {e.format_message()}")


def resolving(command: Command) -> Any:
    """The README's commands resolve in the quick loop; the pages' in the slow tier (the loader
    takes about 0.1 s a config, and the pages show some seventy commands)."""
    return pytest.param(command, id=command.where, marks=() if command.where.startswith("README") else pytest.mark.slow)


@pytest.mark.parametrize("command", [resolving(c) for c in CHECKED])
def test_doc_command_resolves(command: Command) -> None:
    """Where it names a recipe, the recipe loads with its overrides through the project's loader
    (a UserError names the file and key); run directories and plan files are not needed."""
    loads = config_of(*parse(command.argv))
    if loads is not None:
        recipe, overrides = loads
        load_config(recipe, overrides)


def test_config_commands_run() -> None:
    """The quick ones run for real: every `pd config ...` the docs show exits 0."""
    runner = CliRunner()
    config_commands = [c for c in CHECKED if c.argv[0] == "config"]
    assert len(config_commands) >= 4
    for command in config_commands:
        result = runner.invoke(app, list(command.argv))
        assert result.exit_code == 0, f"{command.where}: `{command.text}` exited {result.exit_code}: {result.output}"
    shown = runner.invoke(app, ["config", "show", "recipes/quickstart.yaml", "schedule.name=1f1b", "optim.lr=0.1"])
    assert "name: 1f1b" in shown.output and "lr: 0.1" in shown.output
    assert "mlp" in runner.invoke(app, ["config", "models"]).output


def test_extraction_handles_continuations_comments_and_chains(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text `pd plan RUN`\n"
        "```bash\n"
        "pd train recipes/quickstart.yaml \\\n"
        "    'cluster.levels=[{devices: 4}]' --force   # a comment; pd not this\n"
        "pd compile recipes/quickstart.yaml && rsync -a runs/ x:   # on node 0\n"
        "$ pd plan diff a.json b.json > diff.md\n"
        "srun --nodes 2 pd train recipes/quickstart.yaml\n"
        ".venv/bin/python benchmarks/bench_planner.py   # runs pd\n"
        "```\n")
    assert [(c.where.rsplit(":", 1)[1], c.argv) for c in doc_commands([page])] == [
        ("3", ("train", "recipes/quickstart.yaml", "cluster.levels=[{devices: 4}]", "--force")),
        ("5", ("compile", "recipes/quickstart.yaml")),
        ("6", ("plan", "diff", "a.json", "b.json")),
        ("7", ("train", "recipes/quickstart.yaml")),
    ]


def test_parse_refuses_an_unknown_option() -> None:
    with pytest.raises(click_errors.NoSuchOption):
        parse(("train", "recipes/quickstart.yaml", "--no-such-flag"))


def test_resolution_refuses_an_unknown_key() -> None:
    from pdcli.errors import UserError

    recipe, overrides = config_of(*parse(("plan", "recipes/quickstart.yaml", "--pareto", "optim.lrr=0.1")))  # type: ignore[misc]
    assert recipe == Path("recipes/quickstart.yaml") and "schedule.name=auto" in overrides
    with pytest.raises(UserError, match="optim.lrr"):
        load_config(recipe, overrides)


# -- the site and the README ---------------------------------------------------------------------

def nav_pages(nav: Any) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in nav_pages(item)]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in nav_pages(value)]
    return []


def test_every_page_is_in_the_nav() -> None:
    site = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    assert site["strict"] is True
    listed = nav_pages(site["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(listed) == pages, "mkdocs.yml's nav and docs/*.md differ"


def test_readme_is_short_and_undated() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move text to docs/"
    dated = [f"{n}: {line}" for n, line in enumerate(lines, 1) if DATE.search(line)]
    assert not dated, "dated entries belong in docs/benchmark-history.md:\n" + "\n".join(dated)


def slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: Path) -> set[str]:
    body = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {slug(m[1]) for m in re.finditer(r"^#+\s+(.*?)\s*$", body, flags=re.M)}


def test_readme_links_land() -> None:
    """README is not part of the site, so its links are checked here: files exist, anchors too."""
    body = re.sub(r"^```.*?^```", "", README.read_text(), flags=re.S | re.M)
    links = re.findall(r"\]\(([^)\s]+)\)", body)
    assert links
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        path = REPO / target
        assert path.exists(), f"README.md links to {link}, which does not exist"
        if anchor:
            assert anchor in anchors(path), f"README.md links to {link}: {target} has no heading with that anchor"


def test_benchmark_tables_are_fresh() -> None:
    spec = importlib.util.spec_from_file_location("tables", REPO / "benchmarks" / "tables.py")
    assert spec is not None and spec.loader is not None
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    assert tables.main(["--check"]) == 0, "a generated table is stale: run `python benchmarks/tables.py`"


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists() and shutil.which("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[dev]')")
    # Not -q or -v: either keeps mkdocs 1.6's --strict from counting the warnings.
    done = subprocess.run([str(mkdocs if mkdocs.exists() else "mkdocs"), "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
