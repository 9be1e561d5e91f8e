"""Draw tau-curve.png from the two tau tables of this folder's README.md (the model card).

    python tau-curve.py        # needs matplotlib

The card is the record; this only plots it, so a new measurement goes into the card's tables and
then the figure is drawn again.
"""

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
BRANCHES = {10, 13, 15}  # side runs, not in the shipped drafter's lineage


def table(card: str, header: str) -> list[list[str]]:
    """The body rows of the Markdown table whose header line starts with `header`."""
    lines = card.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def millions(text: str) -> float:
    return float(text[:-1]) / (1000 if text.endswith("k") else 1)


def number(text: str) -> float | None:
    return float(text) if text else None


def main() -> None:
    card = (HERE / "README.md").read_text()
    offline = [(int(re.match(r"\d+", r[0])[0]), millions(r[1]), float(r[2]))
               for r in table(card, "| run, step | block positions | offline tau |")]
    real = [(int(re.match(r"\d+", r[0])[0]), r[0], millions(r[1]),
             millions(r[2]) if r[2] else None, *map(number, r[3:6]))
            for r in table(card, "| run (step) | block positions | distinct response tokens |")]

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.6), width_ratios=[1.35, 1])
    lineage = [(x, tau) for run, x, tau in offline if run not in BRANCHES]
    left.plot(*zip(*lineage), "-o", ms=3, color="tab:blue",
              label="offline tau, 16 held-out ShareGPT answers")
    side = [(x, tau) for run, x, tau in offline if run in BRANCHES]
    left.plot(*zip(*side), "o", mfc="none", color="tab:blue", label="offline tau, side branches")
    styles = [(4, "s", "tab:green", "HumanEval 164"), (5, "^", "tab:red", "ShareGPT old 100"),
              (6, "v", "tab:purple", "ShareGPT clean 84")]
    for column, marker, color, name in styles:
        for branch in (False, True):
            points = [(r[2], r[column]) for r in real
                      if r[column] is not None and (r[0] in BRANCHES) == branch]
            if points:
                left.plot(*zip(*points), marker, ms=8, color=color, mfc="none" if branch else color,
                          label=None if branch else f"real tau, {name}")
    for run, label, x, *_ in real:
        if run not in BRANCHES:
            left.axvline(x, color="0.85", lw=0.8, zorder=0)
            left.text(x, 1.02, label.split(" (")[0], fontsize=7, color="0.4", ha="center")
    left.set(title="tau against training (open marks: side branches)", ylim=(1.0, 1.7),
             xlabel="block positions trained on (millions)", ylabel="acceptance length tau (block 16, T=0)")
    left.legend(fontsize=7, loc="upper left")
    left.grid(alpha=0.3)

    for column, marker, color, name in styles:
        points = [(r[3], r[column], r[0]) for r in real
                  if r[3] is not None and r[column] is not None and r[0] not in BRANCHES]
        if points:
            right.plot([p[0] for p in points], [p[1] for p in points], "-" + marker, color=color,
                       label=name)
            for x, tau, run in points:
                right.annotate(str(run), (x, tau), textcoords="offset points", xytext=(0, 6),
                               fontsize=7, color="0.4", ha="center")
    right.set(title="real tau against data drawn (runs 2-12)", ylim=(1.0, 1.7),
              xlabel="distinct response tokens drawn by then (millions)", ylabel="real tau at end of run")
    right.legend(fontsize=7, loc="lower right")
    right.grid(alpha=0.3)
    fig.suptitle("SmolLM2-135M demo drafter (block 16, T=0; numbers = run; CPU training)")
    fig.tight_layout()
    fig.savefig(HERE / "tau-curve.png", dpi=100)


if __name__ == "__main__":
    main()
