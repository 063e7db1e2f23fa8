"""Every ``python -m MODULE ...`` command a user may copy, against the module it runs, statically
(< 2 s: no command is started, no entry point imported).

The commands are those of README.md, docs/*.md, results/**/README.md and the module docstrings of
experiments/ and vitmm/: the lines of fenced code blocks and docstrings (backslash continuations
joined) and inline ``code`` spans. For each:

* MODULE exists (``importlib.util.find_spec``: the packages' ``__init__`` files are docstrings only);
  for a study package run through ``experiments.common.dispatch`` (``python -m experiments.bench
  NAME``), ``MODULE.NAME`` exists;
* every ``--flag`` is one the module's parser defines, read from its source with ``ast``: the
  ``add_argument`` calls (per sub-command for ``add_subparsers``), absl's ``DEFINE_*`` (``--noX`` for
  booleans), the ``extra=`` flags of ``experiments.lessons.common.parse_args``, following the calls
  to an imported module's ``main``/``parse_args`` (``__main__`` -> ``study.main()``), plus ``-h``/
  ``--help`` and ``--verbose`` where ``experiments.common.entry.quiet`` takes it;
* for a ``config_flags`` module (``vitmm.train``, ``vitmm.demo``): a literal ``--config`` file
  exists, and every ``--config.KEY=...`` override names a key that config has
  (``config_args.unknown_override``, as the trainer reports it).

Commands of other tools are skipped by name (``EXTERNAL``), as are placeholders (``python -m
experiments.lessons.NAME``).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import pathlib
import re
import shlex

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Modules of other tools whose commands the docs show: their flags are theirs to check.
EXTERNAL = {
    "lmms_eval": "lmms-eval's own CLI (in .venv-eval), not vitmm's",
    "pip": "pip's CLI",
    "venv": "the standard library's venv",
    "pytest": "pytest's CLI",
    "compileall": "the standard library's compileall",
}
# absl's flags that every absl.app program accepts.
ABSL_BUILTIN = {"--help", "--helpshort", "--helpfull", "--helpxml", "--flagfile", "--undefok", "-h"}
PYTHON_M = re.compile(r"\bpython(?:3(?:\.\d+)?)?\s+-m\s+")
SPAN = re.compile(r"(`+)([^`]+?)\1")
MODULE_NAME = re.compile(r"^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*$")


def sources() -> list[tuple[pathlib.Path, str, bool]]:
    """``(path, text, is_markdown)`` of every file whose commands users copy."""
    out = [(p, p.read_text(), True) for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
                                               *sorted((ROOT / "results").rglob("README.md"))]]
    for p in sorted([*(ROOT / "experiments").rglob("*.py"), *(ROOT / "vitmm").rglob("*.py")]):
        doc = ast.get_docstring(ast.parse(p.read_text()), clean=False)
        if doc and PYTHON_M.search(doc):
            out.append((p, doc, False))
    return out


def logical_lines(text: str):
    """``(line number, line, in a code block)``: fenced, or indented by four spaces after a blank line
    (Markdown's indented block); a line ending in a backslash joined to the next."""
    fenced = indented = False
    pending, start, previous = "", 0, ""
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if line.strip():
            indented = line.startswith("    ") and (indented or not previous.strip())
        previous = line
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line, fenced or indented
        pending = ""
    if pending:
        yield start, pending, fenced


def commands_in(text: str, markdown: bool) -> list[tuple[int, str]]:
    """``(line, "python -m ...")`` of every command: in a ``code`` span (which may wrap lines), the
    span; on a line of a code block or a docstring, the rest of the line (in Markdown's prose, only
    where the line starts with the command)."""
    lines = list(logical_lines(text))
    prose = [(n, line) for n, line, code in lines if not (markdown and code)]
    blob, starts = "", []
    for n, line in prose:
        starts.append((len(blob), n))
        blob += line + "\n"
    found, covered = [], []
    for m in SPAN.finditer(blob):
        if "\n\n" in m.group(2):
            continue
        covered.append((m.start(), m.end()))
        for c in PYTHON_M.finditer(m.group(2)):
            number = max(n for offset, n in starts if offset <= m.start())
            found.append((number, " ".join(m.group(2)[c.start():].split())))
    for (offset, _), (n, line) in zip(starts, prose, strict=True):
        for c in PYTHON_M.finditer(line):
            inside = any(a <= offset + c.start() < b for a, b in covered)
            if not inside and (not markdown or re.fullmatch(r"\s*(\$\s*)?(\w+=\S*\s+)*", line[:c.start()])):
                found.append((n, line[c.start():]))
    if markdown:
        found += [(n, line[c.start():]) for n, line, code in lines if code for c in PYTHON_M.finditer(line)]
    return sorted(found)


def words(command: str) -> list[str]:
    """The command's words after ``-m``, up to a shell operator or comment."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|<>()")
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # an unclosed quote: a span cut short
        tokens = command.split()
    tokens = tokens[tokens.index("-m") + 1:]
    for i, t in enumerate(tokens):
        if t and set(t) <= set(";&|<>()"):
            return tokens[:i]
    return tokens


# ------------------------------------------------------------------------------------ the parsers
@functools.cache
def module_file(name: str) -> pathlib.Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    path = pathlib.Path(spec.origin)
    return path.with_name("__main__.py") if path.name == "__init__.py" else path  # (a package: may be absent)


def _imports(tree: ast.Module) -> dict[str, str]:
    """Local name -> the dotted module (or ``module.function``) it names, for project imports."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("vitmm", "experiments"):
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ("vitmm", "experiments"):
                    names[a.asname or a.name.split(".")[0]] = a.name
    return names


def _flag_strings(call: ast.Call) -> list[str]:
    return [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
            and a.value.startswith("-")]


def _looped_flags(tree: ast.Module, is_add) -> set[str]:
    """``for key, value in PRESETS["default"].items(): add(f"--{key}", ...)``: the keys of that dict
    literal (``dict(k=...)`` or ``{"k": ...}``) of the module, as flags."""
    tables = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict)
              for t in n.targets if isinstance(t, ast.Name)}
    found = set()
    for loop in (n for n in ast.walk(tree) if isinstance(n, ast.For)):
        it = loop.iter.func.value if isinstance(loop.iter, ast.Call) and isinstance(loop.iter.func, ast.Attribute) \
            else loop.iter
        if not (isinstance(it, ast.Subscript) and isinstance(it.value, ast.Name) and it.value.id in tables):
            continue
        table = tables[it.value.id]
        entry = next((v for k, v in zip(table.keys, table.values, strict=True)
                      if isinstance(k, ast.Constant) and k.value == getattr(it.slice, "value", None)), None)
        keys = ([kw.arg for kw in entry.keywords] if isinstance(entry, ast.Call) else
                [k.value for k in entry.keys if isinstance(k, ast.Constant)] if isinstance(entry, ast.Dict) else [])
        if any(is_add(c) and c.args and isinstance(c.args[0], ast.JoinedStr) for c in ast.walk(loop)
               if isinstance(c, ast.Call)):
            found.update(f"--{k}" for k in keys if k)
    return found


@functools.cache
def parser_of(path: pathlib.Path) -> dict:
    """``{"flags": {sub-command or "": set}, "config": bool, "dispatch": bool}`` of one source file and
    of the project modules whose ``main``/``parse_args`` it calls."""
    tree = ast.parse(path.read_text())
    flags: dict[str, set] = {"": set()}
    config = dispatch = verbose = False
    subs, aliases = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.Attribute) and value.attr == "add_argument":
                aliases.add(node.targets[0].id)
            if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                    and value.func.attr == "add_parser" and value.args and isinstance(value.args[0], ast.Constant)):
                subs[node.targets[0].id] = value.args[0].value
                flags.setdefault(value.args[0].value, set())
    imports = _imports(tree)
    flags[""] |= _looped_flags(tree, lambda c: (isinstance(c.func, ast.Attribute) and c.func.attr == "add_argument")
                               or (isinstance(c.func, ast.Name) and c.func.id in aliases))
    followed = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        attr = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else None
        if attr == "add_argument" or (isinstance(func, ast.Name) and func.id in aliases):
            flags[subs.get(owner, "")].update(_flag_strings(node))
        elif attr.startswith("DEFINE_") and node.args and isinstance(node.args[0], ast.Constant):
            name = node.args[0].value
            flags[""].add(f"--{name}")
            if attr in ("DEFINE_bool", "DEFINE_boolean"):
                flags[""].add(f"--no{name}")
            if attr in ("DEFINE_config_file", "DEFINE_config_dict"):
                config = True
        if owner == "dispatch" and attr == "main":
            dispatch = True
        if owner == "entry" and attr == "quiet":
            verbose = True
        for kw in node.keywords:  # experiments.lessons.common.parse_args(..., extra=(("repeats", int), ...))
            if kw.arg == "extra" and isinstance(kw.value, ast.Tuple):
                flags[""].update(f"--{e.elts[0].value}" for e in kw.value.elts
                                 if isinstance(e, ast.Tuple) and isinstance(e.elts[0], ast.Constant))
        if attr in ("main", "parse_args"):
            target = imports.get(owner) if owner else imports.get(attr)
            if target:
                followed.append(target)
    for target in followed:
        file = module_file(target) if module_file(target) else module_file(target.rsplit(".", 1)[0])
        if file and file != path and not parser_of(file)["dispatch"]:
            other = parser_of(file)
            for sub, names in other["flags"].items():
                flags.setdefault(sub, set()).update(names)
            config |= other["config"]
            verbose |= "--verbose" in other["flags"][""]
    if verbose:
        flags[""].add("--verbose")
    return {"flags": flags, "config": config, "dispatch": dispatch}


@functools.cache
def _config_problem(argv: tuple, default: str | None) -> str | None:
    from vitmm import config_args

    return config_args.unknown_override(list(argv), default=default)


@functools.cache
def _config_load_error(spec: str) -> str | None:
    """Why ``--config FILE:ARGS`` does not load (a bad arg), or None (also when ARGS is a placeholder)."""
    from vitmm import config_args

    path, _, arg = spec.partition(":")
    if not re.fullmatch(r"[a-z0-9_=,./+-]*", arg):
        return None
    try:
        config_args.load(ROOT / path, arg or None)
    except Exception as err:  # noqa: BLE001 - whatever the config file raises
        return f"--config {spec} does not load: {type(err).__name__}: {err}"
    return None


def problems(module: str, args: list[str]) -> list[str]:
    """What is wrong with ``python -m MODULE ARGS`` (empty when nothing)."""
    path = module_file(module)
    if path is None:
        return [f"no module {module}"]
    if not path.is_file():
        return [f"{module} is a package without __main__.py"]
    parser = parser_of(path)
    if parser["dispatch"]:
        if not args or args[0].startswith("-"):
            return [f"unknown flag {a.split('=')[0]}" for a in args
                    if a.startswith("-") and a not in ("-h", "--help", "--verbose")]
        if args[0].isupper():  # python -m experiments.lessons NAME
            return []
        name = f"{module}.{args[0]}"
        if module_file(name) is None:
            return [f"no module {name} (for `python -m {module} {args[0]}`)"]
        return [p for p in problems(name, args[1:]) if p != "unknown flag --verbose"]
    names = {k: v for k, v in parser["flags"].items()}
    accepted = set(names[""]) | ({"-h", "--help"} if not parser["config"] else ABSL_BUILTIN)
    positionals = [a for a in args if not a.startswith("-")]
    subs = [s for s in names if s]
    if subs:
        chosen = positionals[0] if positionals and positionals[0] in subs else None
        accepted |= names[chosen] if chosen else set().union(*(names[s] for s in subs))
    out = []
    for a in args:
        a = a.strip("[]")
        if not a.startswith("-") or a == "--" or "…" in a or "..." in a.split("=")[0]:
            continue
        flag = a.split("=", 1)[0]
        if parser["config"] and flag.startswith("--config."):
            continue
        if flag not in accepted:
            out.append(f"unknown flag {flag}")
    if parser["config"]:
        argv = [a.strip("[]") for a in args]
        spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
        if spec is None and "--config" in argv and argv.index("--config") + 1 < len(argv):
            spec = argv[argv.index("--config") + 1]
        file = (spec or "").partition(":")[0]
        if re.fullmatch(r"configs/[a-z0-9_/]+\.py", file):
            if not (ROOT / file).is_file():
                out.append(f"no config file {file}")
            else:
                if (load := _config_load_error(spec)):
                    out.append(load)
                default = "configs/frontend_demo.py" if module == "vitmm.demo" else None
                overrides = [a if "=" in a else None for a in argv if a.startswith("--config.")]
                literal = [a for a in overrides if a and re.fullmatch(r"--config\.[a-z0-9_.]+=.*", a)]
                message = _config_problem(tuple(["--config", spec, *literal]), default) if literal else None
                if message:
                    out.append(message)
    return out


def documented() -> list[tuple[str, str, list[str]]]:
    """``(where, module, args)`` of every documented command of vitmm's (``EXTERNAL`` and placeholders
    left out)."""
    out = []
    for path, text, markdown in sources():
        for number, command in commands_in(text, markdown):
            tokens = words(command)
            if not tokens:
                continue
            module, args = tokens[0].rstrip(",:`"), tokens[1:]
            if module.split(".")[0] in EXTERNAL or not MODULE_NAME.match(module) or module == "experiments.x":
                continue  # another tool's; or a placeholder (MODULE, experiments.lessons.NAME, experiments.…)
            out.append((f"{path.relative_to(ROOT)}:{number}", module, args))
    return out


def test_every_documented_command_runs_a_module_with_flags_it_takes():
    found = documented()
    assert len(found) >= 200 and len({m for _, m, _ in found}) >= 30, len(found)
    broken = [f"{where}: python -m {module} {' '.join(args)}\n    -> {'; '.join(p)}"
              for where, module, args in found if (p := problems(module, args))]
    assert not broken, f"{len(broken)} documented commands would fail:\n" + "\n".join(broken)


def test_the_checks_catch_what_they_are_for():
    """The extraction (spans, blocks, continuations) and each check, on made-up lines."""
    md = ("Run `python -m vitmm.chat --workdir W --question q` or\n```\npython -m vitmm.train \\\n"
          "  --config configs/clip_scenes.py --workdir w --bogus  # a comment --no\n```\n"
          "prose python -m vitmm.serve --nope is not a command\n")
    (_, a), (_, b) = commands_in(md, markdown=True)
    assert words(a) == ["vitmm.chat", "--workdir", "W", "--question", "q"]
    assert words(b)[-2:] == ["w", "--bogus"]
    assert problems("vitmm.train", words(b)[1:]) == ["unknown flag --bogus"]
    assert problems("vitmm.chat", ["--workdir", "w", "--question", "q", "--image", "x.png"]) == []
    assert problems("vitmm.nope", []) == ["no module vitmm.nope"]
    assert problems("vitmm.data", ["check", "--wds", "x"]) == []
    assert problems("vitmm.data", ["check", "--num", "3"]) == ["unknown flag --num"]  # examples', not check's
    assert problems("experiments.bench", ["memory", "--help"]) == []
    assert problems("experiments.bench", ["nosuch"]) == ["no module experiments.bench.nosuch (for "
                                                         "`python -m experiments.bench nosuch`)"]
    assert problems("experiments.lessons.channels", ["--repeats", "2", "--smoke"]) == []
    assert problems("experiments.token_budget", ["--smoke", "--config", "x"]) == []  # sweep's and study's
    assert problems("vitmm.train", ["--config", "configs/nosuch.py", "--workdir", "w"]) == ["no config file "
                                                                                             "configs/nosuch.py"]
    assert problems("vitmm.train", ["--config", "configs/clip_scenes.py", "--workdir", "w",
                                    "--config.optim.lr=0.1", "--nodry_run"]) == []
    assert "does not load" in problems("vitmm.train", ["--config", "configs/vlm_scenes.py:conector=pool",
                                                       "--workdir", "w"])[0]
    assert "unknown config key 'optim.lrr'" in problems(
        "vitmm.train", ["--config", "configs/clip_scenes.py", "--workdir", "w", "--config.optim.lrr=0.1"])[0]
