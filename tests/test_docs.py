"""Every command the docs show still runs as written: the file or module it names exists, each
flag it passes is one its command line takes (read from its own --help), each name a `-c`
snippet imports or reaches through a module exists, and each `make` target is in the Makefile.

The commands are the indented lines of README.md, docs/, tests/README.md and
benchmarks/README.md that start a Python program (`.venv/bin/python`, `python`, `torchrun`)."""

import ast
import functools
import glob
import importlib
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [
    "README.md",
    "tests/README.md",
    "benchmarks/README.md",
    *sorted(glob.glob("docs/*.md", root_dir=ROOT)),
]
START = re.compile(r"^    (?:\w+=\S* )*(?:\.venv/bin/)?(?:python3?|torchrun)\b")


def commands(doc: str) -> list:
    """(line number, argv) of each command in the doc, a line ending in a backslash joined to the
    next."""
    lines, found, i = open(os.path.join(ROOT, doc)).read().split("\n"), [], 0
    while i < len(lines):
        if START.match(lines[i]):
            start, text = i + 1, lines[i]
            while text.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text.rstrip()[:-1] + " " + lines[i].strip()
            argv = shlex.split(text, comments=True)
            found.append(
                (start, [a for a in argv if not re.match(r"^\w+=", a) or a.startswith("-")])
            )
        i += 1
    return found


def program(argv: list):
    """(kind, target, its arguments): ("file", "generate.py", [...]), ("module",
    "formats.tokenizer", [...]) or ("code", "...", [])."""
    args = argv[1:]
    if argv[0].endswith("torchrun"):  # its own flags (each with a value) up to the script
        while args and args[0].startswith("--"):
            args = args[1:] if "=" in args[0] else args[2:]
        return "file", args[0], args[1:]
    if args[0] == "-m":
        return "module", args[1], args[2:]
    if args[0] == "-c":
        return "code", args[1], []
    return "file", args[0], args[1:]


@functools.cache
def help_text(kind: str, target: str) -> str:
    run = [sys.executable, target] if kind == "file" else [sys.executable, "-m", target]
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [*run, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"{target} --help failed:\n{proc.stderr[-2000:]}"
    return proc.stdout


def check_code(code: str) -> list:
    """The names a `-c` snippet imports, and the attributes it reads from them, that do not
    exist."""
    missing, modules = [], {}
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            for a in node.names:
                modules[a.asname or a.name] = importlib.import_module(a.name)
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                parent = importlib.import_module(node.module)
                if not hasattr(parent, a.name):
                    try:
                        importlib.import_module(f"{node.module}.{a.name}")
                    except ImportError:
                        missing.append(f"{node.module}.{a.name}")
                        continue
                modules[a.asname or a.name] = getattr(parent, a.name)
    for node in ast.walk(ast.parse(code)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
        ):
            if not hasattr(modules[node.value.id], node.attr):
                missing.append(f"{node.value.id}.{node.attr}")
    return missing


def flags(args: list) -> list:
    return [a.split("=")[0] for a in args if a.startswith("--") and len(a) > 2]


@pytest.mark.parametrize("doc", DOCS)
def test_every_command_in_the_docs_names_what_exists(doc):
    problems = []
    for line, argv in commands(doc):
        kind, target, args = program(argv)
        where = f"{doc}:{line}"
        if kind == "code":
            problems += [f"{where}: {name} does not exist" for name in check_code(target)]
            continue
        if kind == "file" and not os.path.exists(os.path.join(ROOT, target)):
            problems.append(f"{where}: no file {target}")
            continue
        source = (
            os.path.join(ROOT, target)
            if kind == "file"
            else os.path.join(ROOT, *target.split(".")) + ".py"
        )
        if not os.path.exists(source):
            problems.append(f"{where}: no module {target}")
        elif "argparse" in open(source).read():
            text = help_text(kind, target)
            problems += [f"{where}: {target} takes no {f}" for f in flags(args) if f not in text]
    assert not problems, "\n".join(problems)


def test_every_make_target_the_docs_name_is_in_the_makefile():
    targets = set(re.findall(r"^([\w-]+):", open(os.path.join(ROOT, "Makefile")).read(), re.M))
    text = "\n".join(open(os.path.join(ROOT, doc)).read() for doc in DOCS)
    named = set(re.findall(r"(?:^    |`)make (\w+)", text, re.M))  # as a command, not in prose
    assert named <= targets, f"the docs name make targets the Makefile lacks: {named - targets}"


def test_the_commands_are_found():
    """The extraction itself: the README's examples are read, flags and all."""
    found = [argv for _, argv in commands("README.md")]
    assert ["generate.py", "--chat", "--prompt", "What is the capital of France?"] in [
        a[1:] for a in found
    ]
    assert program(["torchrun", "--nproc_per_node", "3", "serve.py", "--port", "8000"]) == (
        "file",
        "serve.py",
        ["--port", "8000"],
    )
