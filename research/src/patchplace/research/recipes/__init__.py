"""Each paper's recipe at scale as cited data, held against the shipped configs.

One YAML file a method (``<method>.yaml`` beside this module): for every shipped at-scale config
(``pipelines/configs/imagenet_*.yaml``, ``speech_commands_*.yaml``) the value the paper states for each field, where it
states it, and — where the shipped value differs on purpose — the shipped value and why (a *departure*). Where the paper
is silent the authors' released config or code is the source, and the entry says so.

Every value's ``source`` is a list of citations a reader (or ``--verify-sources``) can check and so find wrong:

- ``{code: <alias>, file: <path>, key: <key>}``: the file at the commit of ``sources.<alias>`` (``{repo: owner/name,
  commit: <40 hex>}``) and the key in it: a dotted YAML path (``data.batch_size``, ``optimization.ema[0]``), a
  command-line flag (``--blr``), or the identifier / text the value is read at (``init_opt``, ``lambd /= len(embs)``);
- ``{paper: <alias>, table|section|figure|appendix|equation|algorithm: <cell>}`` (``sources.<alias>``: ``{paper:
  <title>, arxiv: <id>}``), with an optional ``quote``;
- ``{project: <why>}``: a value no source states (where the data lives, a field the recipe leaves unused).

An entry's free ``note`` says how the cited text gives the value; ``choice`` quotes an ambiguous source and the reading
the value takes of it.

    python -m patchplace.research.recipes            # check every config against its paper; exit 1 on a mismatch
    python -m patchplace.research.recipes --write-docs   # regenerate the "Recipe at scale" tables in docs/methods/
    python -m patchplace.research.recipes --verify-sources DIR   # every code citation against git mirrors in DIR

``tests/test_recipes_at_scale.py`` runs the same check and asserts the docs tables are current.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patchplace.pipelines.config import (
    _leaves,
    _within,
    build,
    given_values,
    parse_yaml,
    shipped_configs,
)
from patchplace.pipelines.help import HelpFormatter

HERE = Path(__file__).parent
STAGES = ("pretrain", "finetune", "linprobe", "lowlabel")  # lowlabel: a probe config of its own (the 1% one)
# set by the user or the launcher, not by a recipe: the placeholders and the run's own bookkeeping (and the method,
# checked against the file the recipe is listed in)
EXEMPT = frozenset({"method", "data.train", "data.val", "run.output", "run.log_every", "run.checkpoint_every"})
# a row of docs/methods/README.md's index: its objective file (the first linked) ... its page
INDEX_ROW = re.compile(r"^\|[^|\n]*\|[^|\n]*\| \[`(\w+)\.py`\][^\n]*\| \[(\w+)\.md\]", re.M)
BEGIN, END = "<!-- recipe-at-scale:begin (generated: python -m patchplace.research.recipes --write-docs) -->", \
    "<!-- recipe-at-scale:end -->"
NO_FIELD = "-"  # a recipe value no config field can express (always a departure)
LOCATORS = ("table", "section", "figure", "appendix", "equation", "algorithm")
COMMIT = re.compile(r"[0-9a-f]{40}")
REPO = re.compile(r"[\w.-]+/[\w.-]+")
ARXIV = re.compile(r"\d{4}\.\d{4,5}")


@dataclass(frozen=True)
class Cite:
    """One citation: ``kind`` code (``repo`` at ``commit``, ``file``, ``key``), paper (``arxiv``, ``where``: the
    (locator, cell) pairs) or project (``why``); ``ref`` is the alias in the recipe file's ``sources``."""

    kind: str
    ref: str | None = None
    repo: str | None = None
    commit: str | None = None
    file: str | None = None
    key: str | None = None
    title: str | None = None
    arxiv: str | None = None
    where: tuple[tuple[str, str], ...] = ()
    quote: str | None = None
    why: str | None = None

    def problems(self) -> list[str]:
        """What makes this citation uncheckable: a repository without a 40-hex commit, a file or key; a paper
        without an arXiv id or a table / section / figure / appendix / equation / algorithm; a bare project line."""
        if self.kind == "code":
            return [f"{self.ref}: {what}" for what, ok in (
                (f"repo {self.repo!r} is not owner/name", bool(self.repo and REPO.fullmatch(self.repo))),
                (f"commit {self.commit!r} is not 40 hex digits", bool(self.commit and COMMIT.fullmatch(self.commit))),
                ("no file", bool(self.file)), (f"{self.file}: no key", bool(self.key))) if not ok]
        if self.kind == "paper":
            return [f"{self.ref}: {what}" for what, ok in (
                (f"arxiv {self.arxiv!r} is not an arXiv id", bool(self.arxiv and ARXIV.fullmatch(self.arxiv))),
                (f"names none of {', '.join(LOCATORS)}", bool(self.where))) if not ok]
        return [] if self.why and self.why.strip() else ["a project citation needs why:"]

    def text(self, short: bool = False) -> str:
        if self.kind == "code":
            commit = (self.commit or "")[:12] if short else self.commit
            return f"{self.repo}@{commit} {self.file}: {self.key}"
        if self.kind == "paper":
            cells = ", ".join(f"{k} {v}" for k, v in self.where)
            return f"arXiv {self.arxiv} {cells}" + (f" ('{self.quote}')" if self.quote else "")
        return f"project: {self.why}"


def cite(raw: dict[str, Any], sources: dict[str, dict[str, Any]]) -> Cite:
    """A citation of a recipe file resolved through its ``sources`` (an unknown alias: ``ValueError``)."""
    where = tuple((k, str(raw[k])) for k in LOCATORS if k in raw)
    unknown = set(raw) - {"code", "paper", "project", "file", "key", "quote", *LOCATORS}
    if unknown or sum(k in raw for k in ("code", "paper", "project")) != 1:
        raise ValueError(f"a citation is one of {{code:, file:, key:}}, {{paper:, <locator>:}}, {{project:}}: {raw}")
    if "project" in raw:
        return Cite("project", why=raw["project"])
    ref = raw.get("code", raw.get("paper"))
    if ref not in sources:
        raise ValueError(f"citation {raw}: {ref!r} is not in the file's sources")
    src = sources[ref]
    if "code" in raw:
        return Cite("code", ref, repo=src.get("repo"), commit=str(src.get("commit") or ""),
                    file=raw.get("file"), key=None if raw.get("key") is None else str(raw["key"]))
    return Cite("paper", ref, title=src.get("paper"), arxiv=str(src.get("arxiv") or ""), where=where,
                quote=raw.get("quote"))


@dataclass(frozen=True)
class Entry:
    """One recipe value: ``field`` (dotted, or ``-``), the paper's value, its citations, a departure if any, a free
    ``note`` and, for an ambiguous source, the ``choice`` made reading it."""

    field: str
    paper: Any
    source: tuple[Cite, ...]
    config: Any = None
    departure: str | None = None
    what: str | None = None
    note: str | None = None
    choice: str | None = None

    @property
    def label(self) -> str:
        return self.what if self.field == NO_FIELD else self.field

    def source_text(self, short: bool = False) -> str:
        text = "; ".join(c.text(short) for c in self.source)
        text += f" — {self.note}" if self.note else ""
        return text + (f" — choice: {self.choice}" if self.choice else "")


def entry(raw: dict[str, Any], sources: dict[str, dict[str, Any]]) -> Entry:
    cites = raw.get("source")
    if not isinstance(cites, list):
        raise ValueError(f"{raw.get('field')}: source must be a list of citations, got {cites!r}")
    return Entry(**{**raw, "source": tuple(cite(c, sources) for c in cites)})


@dataclass(frozen=True)
class Recipe:
    method: str
    paper: str
    file: str
    stage: str
    reproduces: str
    entries: tuple[Entry, ...]


def load_recipes(folder: Path = HERE) -> list[Recipe]:
    """Every recipe of every ``<method>.yaml`` in ``folder``."""
    out = []
    for path in sorted(folder.glob("*.yaml")):
        data = parse_yaml(path.read_text())
        sources = data.get("sources") or {}
        for file, recipe in data["recipes"].items():
            if recipe["stage"] not in STAGES:
                raise ValueError(f"{path.name}: {file}: stage must be one of {STAGES}, got {recipe['stage']!r}")
            try:
                entries = tuple(entry(e, sources) for e in recipe["fields"])
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path.name}: {file}: {exc}") from None
            out.append(Recipe(data["method"], data["paper"], file, recipe["stage"], recipe.get("reproduces", ""),
                              entries))
    return out


def config_class(stage: str) -> type:
    """The pipeline config a stage's file is read as."""
    if stage == "pretrain":
        from patchplace.pipelines.pretrain import PretrainConfig
        return PretrainConfig
    if stage == "finetune":
        from patchplace.pipelines.finetune import FinetuneConfig
        return FinetuneConfig
    from patchplace.pipelines.evaluate import EvaluateConfig
    return EvaluateConfig


def shipped(recipe: Recipe, configs: Path | None = None) -> tuple[Any, dict[str, Any]]:
    """(the config as the pipeline builds it, {dotted key: value} the file sets)."""
    path = (configs or shipped_configs()) / recipe.file
    cls = config_class(recipe.stage)
    file, _ = given_values(cls, str(path), [])
    return build(cls, file), _leaves(parse_yaml(path.read_text()) or {})


def value_at(config: Any, field: str) -> Any:
    """The value in force at dotted ``field``: objective fields through the method's config (its defaults where the
    file is silent), ``model.overrides.X`` through the preset's backbone config."""
    head, _, rest = field.partition(".")
    if head == "objective":  # (a PretrainConfig: built, not validated, so the section holds the given fields)
        return getattr(config.objective_config(), rest)
    if field.startswith("model.overrides."):
        from patchplace.models.registry import PRESETS
        name = field.removeprefix("model.overrides.")
        return config.model.overrides.get(name, getattr(PRESETS[config.model.preset], name))
    node = config
    for part in field.split("."):
        node = getattr(node, part)
    return node


def plain(value: Any) -> Any:
    """Tuples as lists, recursively (YAML gives lists, the dataclasses tuples)."""
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def same(a: Any, b: Any) -> bool:
    a, b = plain(a), plain(b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


def problems(recipe: Recipe, configs: Path | None = None) -> list[str]:
    """What does not hold between ``recipe`` and its shipped config: a value that differs without a departure, a
    departure whose shipped value is not what it says, or a field the file sets with no cited entry."""
    config, set_fields = shipped(recipe, configs)
    out = []
    if recipe.stage == "pretrain" and config.method != recipe.method:
        out.append(f"{recipe.file}: method {config.method!r}, but it is listed under {recipe.method}.yaml")
    for e in recipe.entries:
        if e.field == NO_FIELD:  # behaviour no field sets: the same as the paper's, or a departure saying why not
            if not e.what:
                out.append(f"{recipe.file}: an entry without a field needs what: ({e.source_text()})")
            continue
        try:
            value = value_at(config, e.field)
        except (AttributeError, KeyError) as exc:
            out.append(f"{recipe.file}: {e.field}: no such field ({exc})")
            continue
        if e.departure is None and not same(value, e.paper):
            out.append(f"{recipe.file}: {e.field} = {plain(value)!r}, the paper's is {plain(e.paper)!r} "
                       f"({e.source_text()}) and no departure is listed")
        elif e.departure is not None and not same(value, e.config):
            out.append(f"{recipe.file}: {e.field} = {plain(value)!r}, the departure says {plain(e.config)!r}")
    cited = [e.field for e in recipe.entries]  # an entry covers its field and what lies under it (model.overrides)
    out += [f"{recipe.file}: {key} is set with no cited entry in {recipe.method}.yaml"
            for key in sorted(set(set_fields) - EXEMPT) if not any(_within(key, f) for f in cited)]
    return out + citation_problems(recipe)


def citation_problems(recipe: Recipe) -> list[str]:
    """Every entry of ``recipe`` cites something, and every citation can be checked (``Cite.problems``)."""
    out = []
    for e in recipe.entries:
        if not e.source:
            out.append(f"{recipe.file}: {e.label}: no citation")
        out += [f"{recipe.file}: {e.label}: {p}" for c in e.source for p in c.problems()]
    return out


Reader = Callable[[str, str, str], "str | None"]  # (repo, commit, file) -> the file's text there, or None


def yaml_path(data: Any, key: str) -> bool:
    """Whether dotted ``key`` (``a.b[0].c``) names a value in parsed YAML ``data``."""
    node = data
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", key):
        if part.startswith("["):
            index = int(part[1:-1])
            if not isinstance(node, list) or index >= len(node):
                return False
            node = node[index]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return False
    return True


def key_found(text: str, file: str, key: str) -> bool:
    """Whether ``key`` is where a citation says: a YAML path of a .yaml file (a list of YAML files: any), else its
    text, a flag as the argparse / shell spelling (``'--x'`` or ``--x``), quotes stripped."""
    if file.endswith((".yaml", ".yml")) and not key.startswith("'"):
        try:
            return yaml_path(parse_yaml(text), key)
        except Exception:  # a file the project's strict YAML refuses (a key given twice): read its text
            pass
    needle = key.strip("'\"")
    return needle in text


def verify(recipes: list[Recipe], read: Reader) -> list[str]:
    """Every code citation against the cited repository: the file exists at the commit and the key is in it."""
    out, seen = [], set()
    for r in recipes:
        for e in r.entries:
            for c in e.source:
                if c.kind != "code" or (c.repo, c.commit, c.file, c.key) in seen:
                    continue
                seen.add((c.repo, c.commit, c.file, c.key))
                text = read(c.repo, c.commit, c.file)
                if text is None:
                    out.append(f"{r.file}: {e.label}: {c.repo}@{c.commit}: no file {c.file}")
                elif not key_found(text, c.file, c.key):
                    out.append(f"{r.file}: {e.label}: {c.repo}@{c.commit} {c.file}: no {c.key!r}")
    return out


def mirror_reader(folder: Path) -> Reader:
    """Files of git mirrors laid out as ``folder/<owner>+<name>/repo`` (bare git directories)."""
    def read(repo: str, commit: str, file: str) -> str | None:
        git = folder / repo.replace("/", "+") / "repo"
        run = subprocess.run(["git", "--git-dir", str(git), "show", f"{commit}:{file}"], capture_output=True)
        return run.stdout.decode(errors="replace") if run.returncode == 0 else None
    return read


def cell(value: Any) -> str:
    text = "null" if value is None else str(plain(value)).replace("'", "")
    return text.replace("|", "\\|")


def table(recipes: list[Recipe]) -> str:
    """The markdown "Recipe at scale" section for one docs page's recipes."""
    lines = []
    for r in recipes:
        lines += [f"**`pipelines/configs/{r.file}`** ({r.stage}; {r.paper}) — reproduces: {r.reproduces}", "",
                  "| field | paper | config | source | departure |", "| --- | --- | --- | --- | --- |"]
        for e in r.entries:
            shown = cell(e.config if e.departure is not None else e.paper)
            if e.field == NO_FIELD:
                shown = "(not a field)" if e.departure else "(built in: the same)"
            lines.append(f"| `{e.label}` | {cell(e.paper)} | {shown} | "
                         f"{e.source_text(short=True).replace('|', '/')} | {(e.departure or '').replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def doc_pages(docs: Path) -> dict[str, str]:
    """{method: the docs/methods/<page>.md that holds its table}: the page the methods index
    (docs/methods/README.md) gives the objective file that registers the method, so no method is named here."""
    from patchplace.objectives import list_methods

    page_of: dict[str, str] = {}
    for file, page in INDEX_ROW.findall((docs / "methods" / "README.md").read_text()):
        page_of.setdefault(file, page)  # the file's first row (ijepa.py: StoP's page holds I-JEPA's table too)
    pages = {}
    for spec in list_methods():
        file = spec.objective_cls.__module__.rpartition(".")[2]
        if file not in page_of:
            raise ValueError(f"docs/methods/README.md has no row for {file}.py (method {spec.name}): add its page")
        pages[spec.name] = page_of[file]
    return pages


def doc_section(recipes: list[Recipe], page: str, pages: dict[str, str]) -> str:
    """The generated section of docs/methods/<page>.md: the recipes of the methods ``pages`` puts there."""
    mine = [r for r in recipes if pages[r.method] == page]
    intro = ("Generated from `research/src/patchplace/research/recipes/*.yaml` (the paper's value, where it is "
             "stated, and every departure of the shipped config with its reason); `tests/test_recipes_at_scale.py` "
             "holds each shipped config to it field by field.\n\n")
    return f"{BEGIN}\n{intro}{table(mine)}{END}"


def render_page(text: str, section: str) -> str:
    """``text`` with its generated section replaced, or appended under a "Recipe at scale" heading."""
    if BEGIN in text:
        start, end = text.index(BEGIN), text.index(END) + len(END)
        return text[:start] + section + text[end:]
    return text.rstrip("\n") + "\n\n## Recipe at scale\n\n" + section + "\n"


def write_docs(docs: Path, recipes: list[Recipe]) -> list[Path]:
    written, pages = [], doc_pages(docs)
    for page in sorted({pages[r.method] for r in recipes}):
        path = docs / "methods" / f"{page}.md"
        new = render_page(path.read_text(), doc_section(recipes, page, pages))
        if new != path.read_text():
            path.write_text(new)
            written.append(path)
    return written


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (``--help``, a usage error: exit 2): parsed before any pipeline config, so before torch."""
    parser = argparse.ArgumentParser(prog="python -m patchplace.research.recipes", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--write-docs", action="store_true",
                        help='regenerate the "Recipe at scale" tables in docs/methods/ instead of checking')
    parser.add_argument("--verify-sources", metavar="DIR", type=Path,
                        help="check every code citation (file at the commit, key in it) against git mirrors "
                             "DIR/<owner>+<name>/repo instead of the configs")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    recipes = load_recipes()
    if args.verify_sources:
        found = verify(recipes, mirror_reader(args.verify_sources))
        summary = f"{len(found)} citation(s) not found" if found else "every code citation found"
        print("\n".join([*found, f"{len(recipes)} recipes: {summary}"]))
        return 1 if found else 0
    if args.write_docs:
        root = Path(__file__).resolve().parents[5]
        for path in write_docs(root / "docs", recipes):
            print(f"wrote {path.relative_to(root)}")
        return 0
    found = [p for r in recipes for p in problems(r)]
    for line in found:
        print(line)
    print(f"{len(recipes)} recipes, {sum(len(r.entries) for r in recipes)} cited values: "
          f"{'ok' if not found else f'{len(found)} problem(s)'}")
    return 1 if found else 0
