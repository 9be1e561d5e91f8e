"""Offline prompt sets for `bench`, built from this Python's standard library and fixed random seeds.

* `edit`: copy-heavy code edits of real functions (add type hints, rename a variable, reformat, fix a
  named bug): the answer repeats most of the prompt, which is where prompt lookup pays.
* `adversarial`: lists of random words and numbers to produce or continue: neither drafter can guess.
* `long-2k`, `long-6k`: a module's source of about 2,000 or 6,000 tokens to summarise or edit, for
  costs that grow with the context.
"""

from __future__ import annotations

import ast
import random
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

SETS = ("edit", "adversarial", "long-2k", "long-6k")
_SKIP = {"test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "site-packages"}
_WHOLE = "Reply with the whole function in a Python code block and nothing else."


def stdlib_files(recursive: bool = False) -> list[Path]:
    """This Python's standard-library modules (tests and GUI packages left out), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = root.rglob("*.py") if recursive else root.glob("*.py")
    return [p for p in sorted(found) if not _SKIP & set(p.relative_to(root).parts)]


def parsed_stdlib(recursive: bool = False) -> Iterator[tuple[list[str], ast.Module]]:
    """(source lines, syntax tree) of each standard-library module that parses."""
    for path in stdlib_files(recursive):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        yield source.splitlines(), tree


def _functions(min_lines: int = 12, max_lines: int = 40) -> list[str]:
    """Sources of top-level stdlib functions of a moderate length, in a fixed order."""
    out = []
    for lines, tree in parsed_stdlib():
        for node in tree.body:
            if (
                isinstance(node, ast.FunctionDef)
                and min_lines <= node.end_lineno - node.lineno + 1 <= max_lines
            ):
                out.append(textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno])))
    return out


def _local_names(code: str) -> list[str]:
    tree = ast.parse(code)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return sorted(n for n in names if len(n) > 2)


def edit_prompts(n: int = 40) -> list[list[dict]]:
    prompts = []
    for code in _functions():
        task = len(prompts) % 4
        if task == 0:
            text = f"Add type hints to every parameter and the return value of this function. {_WHOLE}"
        elif task == 1:
            names = _local_names(code)
            if not names:
                continue
            text = f"Rename the variable `{names[0]}` to `{names[0]}_value` everywhere. {_WHOLE}"
        elif task == 2:
            text = f"Reformat this function: double quotes, a blank line after the docstring. {_WHOLE}"
        else:
            if " < " not in code:
                continue
            line = next(i for i, s in enumerate(code.splitlines(), 1) if " < " in s)
            code = code.replace(" < ", " <= ", 1)
            text = f"This function has a bug on line {line}: `<=` should be `<`. Fix it. {_WHOLE}"
        prompts.append([{"role": "user", "content": f"{text}\n\n```python\n{code}\n```"}])
        if len(prompts) == n:
            break
    return prompts


def adversarial_prompts(n: int = 20) -> list[list[dict]]:
    rng = random.Random(0)
    words = sorted({w for p in stdlib_files()[:40] for w in p.stem.split("_") if w.isalpha() and len(w) > 3})
    prompts = []
    for k in range(n):
        if k % 4 == 0:
            text = "Write 60 random seven-digit numbers, separated by commas, with no pattern between them."
        elif k % 4 == 1:
            text = (
                "Write 50 unrelated English words in random order, separated by spaces, never repeating one."
            )
        elif k % 4 == 2:
            seq = ", ".join(str(rng.randrange(10**6)) for _ in range(12))
            text = f"Continue this list of random numbers with 40 more random numbers: {seq},"
        else:
            picked = " ".join(rng.sample(words, min(12, len(words))))
            text = f"Write a random sequence of 50 made-up words that look nothing like these: {picked}"
        prompts.append([{"role": "user", "content": text}])
    return prompts


def long_prompts(tokens: int, n: int = 4) -> list[list[dict]]:
    """Module sources cut to about `tokens` tokens (code runs at roughly 3.5 characters a token)."""
    budget = int(tokens * 3.5)
    files = [p for p in stdlib_files() if p.stat().st_size > budget]
    prompts = []
    for k, path in enumerate(files[:: max(1, len(files) // n)][:n]):
        source = path.read_text(encoding="utf-8", errors="replace")[:budget]
        task = (
            "Summarise what this code does, function by function."
            if k % 2 == 0
            else "Rewrite the first function of this code with a docstring added, and nothing else changed."
        )
        prompts.append([{"role": "user", "content": f"{task}\n\n```python\n{source}\n```"}])
    return prompts


def bench_set(name: str) -> list[list[dict]]:
    if name == "edit":
        return edit_prompts()
    if name == "adversarial":
        return adversarial_prompts()
    return long_prompts(int(name.removeprefix("long-").removesuffix("k")) * 1000)
