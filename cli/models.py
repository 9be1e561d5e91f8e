"""`dflash-mlx models`."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from dflash_mlx.loading import local_copies, registry

from .options import Json, Output, reader_gone, user_errors

TITLE = "target / drafter pairs (dflash-mlx chat --model NAME)"


def models(as_json: Json = False):
    """Known target/drafter pairs, and what is already on this machine."""
    with user_errors():
        rows = _rows()
    with reader_gone():
        _show(rows, as_json)


def _rows() -> list[dict]:
    return [
        dict(
            name=p.name,
            target=p.target,
            draft=p.draft,
            block_size=p.block_size,
            family=p.family,
            disk=p.disk,
            notes=p.notes,
            local=local_copies(p),
        )
        for p in registry()
    ]


def _show(rows: list[dict], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    console = Output()  # (80 columns when piped: one block per pair)
    for r in rows:
        r["local"] = ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in r["local"].items()) or "-"
    if console.width < 160:  # a seven-column table wraps into slivers: one block per pair instead
        console.print(TITLE, style="bold")
        for r in rows:
            console.print(f"\n{r['name']}", style="bold", markup=False, highlight=False)
            for label, key in (
                ("target", "target"),
                ("drafter", "draft"),
                ("family", "family"),
                ("disk", "disk"),
                ("notes", "notes"),
                ("here", "local"),
            ):
                console.print(f"  {label:<8}{r[key]}", markup=False, highlight=False, soft_wrap=True)
        return
    t = Table(title=TITLE)
    for col in ("name", "target", "drafter", "family", "disk", "notes", "on this machine"):
        # Names and ids must stay whole to be copied: the name never wraps, ids fold rather than get cut.
        t.add_column(
            col, no_wrap=col == "name", overflow="fold" if col in ("target", "drafter") else "ellipsis"
        )
    for r in rows:
        t.add_row(r["name"], r["target"], r["draft"], r["family"], r["disk"], r["notes"], r["local"])
    console.print(t)
