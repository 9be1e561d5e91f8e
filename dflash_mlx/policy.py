"""Which proposer to use each cycle, and how many of its tokens to verify.

A cycle that verifies k proposals commits 1 + (accepted proposals) tokens and costs a target pass over
k + 1 positions plus the proposer's own pass. With a_j the chance that proposal j is accepted given that
1 .. j-1 were, it commits on average E_k = 1 + sum_{i<=k} prod_{j<=i} a_j tokens; the policy picks the
source and k with the most tokens per second, E_k / (T_target(k + 1, context) + T_draft(k, context)),
where a plain step (k = 0) gives exactly 1 / T_target(1, context).

The times come from a `CostModel` measured on this machine for this pair (see `costs_for`); the a_j are
learnt online from what the target accepted, per source and position, with old cycles counting less
and less. A DFlash drafter's own probability for each proposal predicts its acceptance better than its
position does, so once the block is drafted its width is cut back where those odds no longer pay.
An option that loses is parked and probed now and then, less often while it keeps losing, so that it
comes back when the text changes. What a cycle of each source really takes (timed by the engine, with
its Python, a draft pass that cannot overlap the cycle before and a consumer reading the tokens) is
learnt too, per source and context (each power of two), as a pace: wall time over the model's price,
by which that source's prices are scaled. A cost measured at a busy moment, what the price leaves
out, or a cost extrapolated past the contexts measured (passes there are not measured again: that
would cost the first answer to get there seconds) then no longer decides; plain steps are probed too
where the choice is close and they were not timed, so that an overpriced plain step does not keep
losing to drafts that are slower in fact. What a policy learnt is handed to the next answer for the
same pair, and kept on disk for the next process (`policy_for`, `keep_learnt`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import operator
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .batching import batchable, merge
from .cache import SpeculativeCache
from .drafters import (
    LOOKUP_BUCKETS,
    LOOKUP_MAX,
    LOOKUP_NGRAMS,
    PHRASES,
    DFlashDrafter,
    draft_block,
    from_logits,
    lookup_bucket,
)
from .errors import UserError
from .files import atomic_file, one_at_a_time
from .models.dflash import DraftCache
from .pairing import context_length, prepare
from .platform import backend, blas, cache_home
from .trees import TREE_MAX, Tree, build, graft

PLAIN, LOOKUP, DFLASH = "plain", "lookup", "dflash"
TREE = "tree"  # a cycle that verified a tree of the drafter's guesses, lookup's too (its choice was DFLASH)

# Each cycle of a source weighs its older evidence by DECAY, on top of prior odds PRIOR_HITS / PRIOR_TRIALS.
# A parked option is probed after PROBE_FIRST cycles, then after twice as many each time it still loses;
# a probe first discounts the old evidence to PROBE_KEEP, so that a few successes bring it back.
# An answer starts from what the last ones learnt, but may not be like them (an edit, then a chat):
# an option parked for longer is probed within PROBE_ANSWER cycles of it.
DECAY = 0.97
PRIOR_HITS, PRIOR_TRIALS = 1.0, 2.0
CONFIDENCE_BINS = 10
PROBE_FIRST, PROBE_MAX, PROBE_KEEP, PROBE_ANSWER = 16, 1024, 0.25, 64
# Cycles are timed in runs of up to PACE_RUN of the same source (a plain step starts the next before its
# own token is read, so on some backends one step's time holds part of the next's). Only how sources
# compare decides, and a busy machine slows them all: so plain steps are the reference, and a lookup
# or DFlash run's pace is its ratio (wall time / price) over that of the plain run nearest it in time
# (PACE_PAIR cycles at most apart), the median of its last PACE_RUNS such pairs, so a run of one source
# timed at a busy moment does not outweigh the other's, timed at a quiet one, however long the other
# stays parked. The first run in each context range is left out (kernels compiled on first use).
# Where the best option is expected to beat plain steps by less than PACE_CLOSE, they are probed: a run
# of PACE_RUN (two where none was timed in that range yet), at once where their pace is not known yet.
PACE_RUN, PACE_RUNS, PACE_CLOSE, PACE_PAIR = 4, 9, 2.0, 64
# A batch speculates or steps plain in turns of BATCH_RUN steps, by the median of each way's last
# BATCH_RUNS turns: plain unless speculating gave more than BATCH_MARGIN more, the other way tried
# again every BATCH_PROBE turns (see BatchPace).
BATCH_RUN, BATCH_RUNS, BATCH_PROBE, BATCH_MARGIN = 8, 3, 6, 0.05
# Lookup's odds are learnt per position from every answer, but how far a match holds past its first
# token is the text's own: a copy under way in an edit holds to its end, a document's names quoted in
# its summary break a token or two later, and a miss at one position says nothing of those past it.
# So an answer also compares the tokens its matches held past their first with what their odds
# promised there, by the odds' class (each match's weighing YIELD_DECAY less per match of its class
# since; YIELD_PRIOR promised and held to start with), and scales the odds past the first position
# by that yield, at most 1 (a match that holds longer than promised teaches every position it reached
# at once).
YIELD_PRIOR, YIELD_DECAY = 4.0, 0.8
WIDTHS = (1, 2, 4, 8, 16, 32)  # the target pass widths priced, and so the only ones verified


@dataclass(frozen=True)
class Choice:
    source: str  # PLAIN, LOOKUP or DFLASH
    k: int  # proposals to verify (0 for a plain step)


@dataclass
class CostModel:
    """Seconds of a target pass over w positions and of a draft pass proposing k tokens, measured at a
    few context lengths; between and beyond them a cost is interpolated linearly in the context (each
    verified position attends over the whole context, so costs grow about linearly with it)."""

    contexts: list[int]
    widths: list[int]  # target pass widths measured, 1 first
    target: list[list[float]]  # [context][width]
    proposals: list[int]  # draft pass proposal counts measured ([] without a drafter)
    draft: list[list[float]]  # [context][proposals]
    # [context]: a plain step after a plain step, launched before that one's token is read (ahead), or
    # built while that one runs and launched once its token is read (built): see speculative.py.
    ahead: list[float]
    built: list[float]
    # {batch size: [context][width]}: a target pass over that many sequences of `width` positions each
    # (measured where sequences are batched, `with_batches`)
    batches: dict[int, list[list[float]]] = field(default_factory=dict)

    def __post_init__(self):
        self.batches = {int(b): rows for b, rows in self.batches.items()}  # (JSON's keys are strings)
        ok = (
            self.contexts
            and len(self.ahead) == len(self.built) == len(self.contexts)
            and all(t > 0 for t in self.ahead + self.built)
            and _increasing(self.contexts)
            and self.widths[:1] == [1]
            and _increasing(self.widths)
            and _increasing(self.proposals)
            and len(self.target) == len(self.contexts)
            and all(len(row) == len(self.widths) for row in self.target)
            and len(self.draft) == (len(self.contexts) if self.proposals else 0)
            and all(len(row) == len(self.proposals) for row in self.draft)
            and all(t > 0 for row in self.target + self.draft for t in row)
            and all(
                len(rows) == len(self.contexts) and all(len(r) == len(self.widths) for r in rows)
                for rows in self.batches.values()
            )
        )
        if not ok:
            raise ValueError("not a cost model: measure it again")
        # (table, context) -> that table's costs by x at that context (`_at`): a cycle prices every
        # option at one context, so each table's column there is worked out once (not saved)
        self._columns: dict = {}

    def target_time(self, width: int, context: int) -> float:
        return self._at(self.widths, self.target, width, context)

    def batch_time(self, batch: int, width: int, context: int) -> float:
        """A target pass over `batch` sequences of `width` positions: interpolated between the batch
        sizes measured (one sequence's own table included), extended linearly past the largest."""
        sizes = sorted({1, *self.batches})
        times = [
            self.target_time(width, context)
            if b == 1
            else self._at(self.widths, self.batches[b], width, context)
            for b in sizes
        ]
        if len(sizes) == 1:  # nothing measured: as one sequence of all their positions
            return self.target_time(batch * width, context)
        return _interpolate(sizes, list(itertools.accumulate(times, max)), batch)

    def step_time(self, context: int, after: str | None = None) -> float:
        """A plain step's seconds; `after` "ahead" or "built" for one following a plain step."""
        times = {None: [row[0] for row in self.target], "ahead": self.ahead, "built": self.built}[after]
        return _interpolate(self.contexts, times, context)

    def counts(self, most: int) -> list[int]:
        """The proposal counts 1..most whose verify pass has a width measured here: the policy verifies
        only those, so a pass is one of a few shapes, whose kernels (where a GPU compiles them on first
        use) are compiled at load (`warm_up`), never mid-answer."""
        return [w - 1 for w in self.widths if 1 < w <= most + 1]

    def draft_time(self, k: int, context: int) -> float:
        return self._at(self.proposals, self.draft, k, context) if self.proposals else 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def _at(self, xs: list[int], rows: list[list[float]], x: float, context: int) -> float:
        """A cost at `context` for x positions: each measured x's cost taken to that context, made never
        to fall as x grows (extended past the contexts measured, noise could make it), then interpolated."""
        kept = self._columns.get((id(rows), context))
        if kept is None or kept[0] is not rows:
            if len(self._columns) >= 1024:
                self._columns.clear()
            column = [_interpolate(self.contexts, [row[i] for row in rows], context) for i in range(len(xs))]
            kept = self._columns[(id(rows), context)] = (rows, list(itertools.accumulate(column, max)))
        return _interpolate(xs, kept[1], x)


def _increasing(xs: list) -> bool:
    return all(a < b for a, b in zip(xs, xs[1:]))


def _interpolate(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), extended linearly past both ends (never below the least y)."""
    if len(xs) == 1:
        return ys[0]
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(min(ys), y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class _Odds:
    """Decayed counts of accepted / tried proposals at each position, with a prior."""

    def __init__(self, positions: int):
        self.hits = [0.0] * (positions + 1)
        self.trials = [0.0] * (positions + 1)
        self.changes = 0  # how often they changed (what was worked out from them holds until then)

    def rates(self, n: int) -> list[float]:
        """Odds at positions 1..n. A position's prior is the odds of the one before it, so positions that
        were never reached look no better than those that were."""
        out, prior = [], PRIOR_HITS / PRIOR_TRIALS
        for j in range(1, n + 1):
            j_ = min(j, len(self.hits) - 1)
            prior = (self.hits[j_] + PRIOR_TRIALS * prior) / (self.trials[j_] + PRIOR_TRIALS)
            out.append(prior)
        return out

    def discount(self, factor: float) -> None:
        self.changes += 1
        for j in range(1, len(self.hits)):
            self.hits[j] *= factor
            self.trials[j] *= factor

    def observe(self, k: int, accepted: int) -> None:
        self.discount(DECAY)
        for j in range(1, min(accepted + 1, k) + 1):  # 1..n accepted, n + 1 rejected (if proposed)
            j_ = min(j, len(self.hits) - 1)
            self.trials[j_] += 1
            self.hits[j_] += j <= accepted


def _scaled(rates: list[float], scale: float) -> list[float]:
    """Odds by position with the second scaled, and with it the chance of reaching each one past it."""
    return [rates[0], rates[1] * scale, *rates[2:]] if len(rates) > 1 and scale != 1.0 else rates


def expected_tokens(rates: list[float]) -> list[float]:
    """E_k for k = 0 .. len(rates): tokens a cycle commits on average with k proposals verified."""
    out, alive = [1.0], 1.0
    for a in rates:
        alive *= a
        out.append(out[-1] + alive)
    return out


class FixedPolicy:
    """Every cycle the same: DFlash with block_size - 1 proposals (plain steps at block size 1), or a tree
    in a pass of `tree` from a drafter block of block_size."""

    tree = None  # (None: chains)

    def __init__(self, block_size: int, drafting: bool, tree: int | None = None):
        self.k = block_size - 1 if drafting else 0
        self.tree = tree

    def choose(self, context: int, lookup: tuple[list[int], int]) -> Choice:
        return Choice(DFLASH, self.k) if self.k else Choice(PLAIN, 0)

    def plain_next(self, context: int, index) -> bool:
        return not self.k

    def narrow(self, choice: Choice, confidence: mx.array, context: int) -> tuple[int, list[float]]:
        return choice.k, []

    def shape(
        self, choice: Choice, ids: mx.array, values: mx.array, context: int, most: int, found: tuple
    ) -> tuple[int, list[float], Tree | None]:
        """The tree best by the drafter's own probabilities that fills a pass of `tree`, lookup's match
        (`found`) first, up to half of it (see AdaptivePolicy.shape)."""
        if not self.tree:
            return choice.k, [], None
        tree, scores = build(ids.tolist(), values.tolist(), self.tree - 1)
        chain = found[0][: self.tree // 2]
        if chain:
            tree = graft(tree, scores, chain, [1.0] * len(chain))[0]
        return self.tree - 1, [], tree.first(self.tree - 1)

    def padded(self, width: int) -> int:
        return width

    def observe(self, choice: Choice, k: int, accepted: int, confidence, ngram: int, match=None) -> None:
        pass

    def wrote(self, tokens: list[int]) -> None:
        pass

    def observe_tree(self, tree: Tree, values: list, path: list[int], ngram: int) -> None:
        pass

    def timed(self, choice: Choice, verified: int, context: int, after: str | None, seconds: float) -> None:
        pass


class AdaptivePolicy:
    """The per-cycle choice among a plain step, lookup with k proposals and DFlash with k proposals."""

    def __init__(
        self,
        costs: CostModel,
        max_dflash: int,
        lookup: bool,
        max_lookup: int = LOOKUP_MAX,
        draft_window: int | None = None,
        trees: bool = False,
    ):
        self.costs = costs
        self.draft_window = draft_window
        self.trees = trees  # whether a drafted block may be verified as a tree (`shape`)
        self.max = {DFLASH: max_dflash, LOOKUP: max_lookup if lookup else 0}
        self.dflash = _Odds(max_dflash)
        self.lookup = {n: _Odds(max_lookup) for n in range(1, LOOKUP_BUCKETS + 1)}  # by `lookup_bucket`
        # the chance a match follows where one may
        self.follows = {n: _Odds(1) for n in (*LOOKUP_NGRAMS, PHRASES)}
        self.waited_for: list[int] = []  # the suffix lengths plain_next waited for a match at
        self.bins = _Odds(CONFIDENCE_BINS)  # acceptance by the drafter's confidence (bins 1..10)
        self.idle = {DFLASH: 0, LOOKUP: 0, PLAIN: 0}  # cycles an available option was not chosen
        self.wait = {DFLASH: PROBE_FIRST, LOOKUP: PROBE_FIRST, PLAIN: PROBE_FIRST}
        self.pace: dict[tuple, list] = {}  # (lookup or dflash, context bucket) -> the last pairs' ratios
        self.run: tuple = (None, 0.0, 0.0, 0)  # the run being timed: (source, bucket), seconds, price, cycles
        self.cycles = 0  # cycles timed
        self.warm: set[tuple] = set()  # (source, bucket) whose first run was left out, in this process
        self.ran: dict[tuple, list] = {}  # (source, bucket) -> its last run: [ratio, cycles then, paired]
        self.probing = 0  # plain steps left in a probe
        self.matches: list[tuple] = []  # lookup's matches still being followed: (tokens, bucket, held)
        # by `lookup_bucket`: match tokens held past the first, and promised there (YIELD_PRIOR)
        self.yielded = {n: (0.0, 0.0) for n in self.lookup}
        self.after_plain = False  # whether the last cycle chosen was a plain step
        self.plain_probed: set[int] = set()  # the context buckets where plain steps were probed
        self.key: tuple | None = None  # where what it learns is kept (`policy_for`, `keep_learnt`)
        # What `choose` and `plain_next` work out, kept while what it came from holds: a run of plain
        # steps prices the same options at each context twice (host time per cycle counts on a GPU)
        self._bests: dict = {}  # (odds, their changes, positions, context, drafted) -> `_best`
        self._paces_at: dict = {}  # context bucket -> `_paces`, until a timed run ends

    def learn_from(self, other: AdaptivePolicy) -> None:
        """Start from what `other` learnt (odds, parked options, paces): a copy of it, in the same process
        (the kernels it compiled are compiled)."""
        self.restore(other.learnt())
        self.warm = set(other.warm)

    def learnt(self) -> dict:
        """What it learnt (odds, parked options, paces), as JSON takes it."""
        odds = lambda o: [o.hits, o.trials]  # noqa: E731
        return {
            "dflash": odds(self.dflash),
            "lookup": {str(n): odds(o) for n, o in self.lookup.items()},
            "follows": {str(n): odds(o) for n, o in self.follows.items()},
            "bins": odds(self.bins),
            "idle": self.idle,
            "wait": self.wait,
            "pace": [[source, bucket, runs] for (source, bucket), runs in self.pace.items()],
            "plain_probed": sorted(self.plain_probed),
        }

    def restore(self, state: dict) -> None:
        """Start from `learnt()`'s record; one that is not this policy's (its odds cover other positions,
        a field is missing) raises ValueError, KeyError or TypeError and changes nothing."""

        def odds(mine: _Odds, kept: list) -> _Odds:
            hits, trials = ([float(x) for x in xs] for xs in kept)
            if not len(hits) == len(trials) == len(mine.hits):
                raise ValueError("learnt for other positions")
            new = _Odds(len(hits) - 1)
            new.hits, new.trials = hits, trials
            return new

        restored = {
            "dflash": odds(self.dflash, state["dflash"]),
            "bins": odds(self.bins, state["bins"]),
            "lookup": {n: odds(o, state["lookup"][str(n)]) for n, o in self.lookup.items()},
            "follows": {n: odds(o, state["follows"][str(n)]) for n, o in self.follows.items()},
            "idle": {k: int(state["idle"][k]) for k in self.idle},
            "wait": {k: int(state["wait"][k]) for k in self.wait},
            "pace": {(str(s), int(b)): [float(x) for x in runs] for s, b, runs in state["pace"]},
            "plain_probed": {int(b) for b in state["plain_probed"]},
        }
        for name, value in restored.items():
            setattr(self, name, value)
        self._bests, self._paces_at = {}, {}

    def _draft_time(self, k: int, context: int) -> float:
        """A draft pass's seconds: under a draft window, as at a context of the window (and a step more)."""
        if self.draft_window is not None:
            context = min(context, self.draft_window + DraftCache.STEP)
        return self.costs.draft_time(k, context)

    def draft_times(self, context: int) -> list[float]:
        """A draft pass's seconds by proposals, 0 first (none: no pass)."""
        return [0.0] + [self._draft_time(k, context) for k in range(1, self.max[DFLASH] + 1)]

    def _best(
        self,
        odds: _Odds,
        n: int,
        context: int,
        drafted: bool,
        pace: float = 1.0,
        extra: float = 0.0,
        scale: float = 1.0,
    ) -> tuple[float, int]:
        """-> (tokens per second, k) of the best k >= 1 for the acceptance odds at `odds`' positions
        1..n (the second scaled by `scale`: `_scaled`), a draft pass's time counted where `drafted`,
        the cycle's price scaled by `pace` and `extra` seconds added (see `_switch`)."""
        key = (id(odds), odds.changes, n, context, drafted, pace, extra, scale)
        if key not in self._bests:
            if len(self._bests) >= 256:
                self._bests.clear()
            e = expected_tokens(_scaled(odds.rates(n), scale))
            best = (0.0, 0)
            for k in self.costs.counts(n):
                t = self.costs.target_time(k + 1, context)
                t += self._draft_time(k, context) if drafted else 0.0
                best = max(best, (e[k] / (t * pace + extra), -k))
            self._bests[key] = best[0], -best[1]
        return self._bests[key]

    def _yield(self, n: int) -> float:
        """What lookup's odds for a match of `match`'s n are scaled by in this answer (see YIELD_PRIOR)."""
        taken, promised = self.yielded[lookup_bucket(n)]
        return min(1.0, (taken + YIELD_PRIOR) / (promised + YIELD_PRIOR))

    def _lookup_rates(self, n: int, k: int) -> list[float]:
        """Lookup's odds at positions 1..k for a match of `match`'s n, as this answer prices them."""
        return _scaled(self.lookup[lookup_bucket(n)].rates(k), self._yield(n))

    def _switch(self, context: int) -> float:
        """What leaving a run of plain steps for one cycle costs besides the cycle: the next plain step
        starts late (once that cycle's tokens are read) instead of ahead, the difference the costs
        measure between the two (`CostModel.step_time`)."""
        late = self.costs.step_time(context) - self.costs.step_time(context, "ahead")
        return max(late, 0.0)

    def expectations(self, lookup: tuple[list[int], int]) -> tuple[list[float], list[float]]:
        """Tokens a cycle commits on average by proposals verified (index k, k = 0 first), with lookup's
        proposals (as many as it has) and with the drafter's."""
        tokens, n = lookup
        k = min(len(tokens), self.max[LOOKUP])
        by_lookup = expected_tokens(self._lookup_rates(n, k)) if k else [1.0]
        by_dflash = expected_tokens(self.dflash.rates(self.max[DFLASH])) if self.max[DFLASH] else [1.0]
        return by_lookup, by_dflash

    def upcoming(self, index) -> tuple[list[float], list[float]]:
        """`expectations` of the cycle after the next token, which is not known yet: lookup's by the
        learnt chance that a match follows at each suffix length it may follow at (as `plain_next`
        weighs them, by the odds unscaled); `index` None: no lookup."""
        by_lookup, rest = [1.0] * (self.max[LOOKUP] + 1), 1.0
        if index is not None and self.max[LOOKUP]:
            for n in index.possible() + ([PHRASES] if index.phrases else []):
                chance = rest * self.follows[n].rates(1)[0]
                rest -= chance
                found = expected_tokens(self.lookup[lookup_bucket(n)].rates(self.max[LOOKUP]))
                by_lookup = [e + chance * (f - 1.0) for e, f in zip(by_lookup, found)]
        return by_lookup, self.expectations(([], 0))[1]

    def choose(self, context: int, lookup: tuple[list[int], int]) -> Choice:
        """A plain step is priced as one of a run of them (each started before the last one's token is
        read): choosing plain leads to more plain steps while it pays, and pricing the first of them
        alone would keep the policy drafting at a loss once it drafts. After a plain step, another
        option also pays for leaving the run (`_switch`)."""
        choice = self._choose(context, lookup)
        self.after_plain = choice.source == PLAIN
        return choice

    def _choose(self, context: int, lookup: tuple[list[int], int]) -> Choice:
        tokens, n = lookup
        # Where plain_next waited for a match: did one follow, at which suffix length? (`match` finds
        # the longest suffix that occurred before: its n, the agreement, is at least that suffix, and
        # where it is longer, the longest suffix length occurred before too.)
        suffix = min(n, max(LOOKUP_NGRAMS))
        for m in self.waited_for:
            if suffix > m:
                break
            self.follows[m].observe(1, suffix == m)
            if suffix == m:
                break
        self.waited_for = []
        pace = self._paces(context)
        step = self.costs.step_time(context, "ahead")
        switch = self._switch(context) if self.after_plain else 0.0
        options = [(1.0 / step, Choice(PLAIN, 0))]
        if self.max[LOOKUP] and tokens:
            odds, most = self.lookup[lookup_bucket(n)], min(len(tokens), self.max[LOOKUP])
            rate, k = self._best(odds, most, context, False, pace[LOOKUP], switch, self._yield(n))
            options.append((rate, Choice(LOOKUP, k)))
        if self.max[DFLASH]:
            rate, k = self._best(self.dflash, self.max[DFLASH], context, True, pace[DFLASH], switch)
            options.append((rate, Choice(DFLASH, k)))
        rate, choice = max(options, key=lambda o: o[0])
        if self.probing:
            self.probing -= 1
            return options[0][1]
        if choice.source != PLAIN and rate < PACE_CLOSE * options[0][0]:  # (see PACE_CLOSE)
            self.idle[PLAIN] += 1
            bucket = context.bit_length()
            if self.idle[PLAIN] >= self.wait[PLAIN] or bucket not in self.plain_probed:  # (unknown: at once)
                self.plain_probed.add(bucket)
                self.idle[PLAIN], self.wait[PLAIN] = 0, min(2 * self.wait[PLAIN], PROBE_MAX)
                timed = (PLAIN, bucket) in self.warm  # (else its first run is left out)
                self.probing = (1 if timed else 2) * PACE_RUN - 1
                return options[0][1]
        elif choice.source == PLAIN:  # it pays again: a later close call probes it soon
            self.idle[PLAIN], self.wait[PLAIN] = 0, PROBE_FIRST
        return self.probed(choice, [option for _, option in options[1:]], n)

    def probed(self, choice: Choice, offered: list[Choice], n: int) -> Choice:
        """The choice made, or where it is a plain step, a parked option of those `offered` that is due a
        probe (its old evidence discounted first); counts the cycles each was passed over. `n`: the
        lookup match's n (`NgramIndex.match`)."""
        for option in offered:
            source = option.source
            if source == choice.source:
                self.idle[source] = 0
            elif choice.source == PLAIN and self.idle[source] >= self.wait[source]:
                self.idle[source], self.wait[source] = 0, min(2 * self.wait[source], PROBE_MAX)
                for odds in (self.dflash,) if source == DFLASH else (self.lookup[lookup_bucket(n)],):
                    odds.discount(PROBE_KEEP)
                return option
            else:
                self.idle[source] += 1
        return choice

    def plain_next(self, context: int, index) -> bool:
        """Whether to start the next cycle's plain step before this cycle's token is read, which makes
        it cheaper still than a step built in advance (`CostModel`). Not when the drafter is due a probe
        or would beat it, nor when lookup, which needs that token, is worth waiting for: at each suffix
        length a match may follow at, the learnt chance that one does times what it would gain (by the
        odds unscaled by the answer's yield: a match that follows may agree further than the suffix it
        was waited for at, a class of its own, and waits priced down stopped letting those in)."""
        if self.probing:
            return True
        pace = self._paces(context)
        ahead = 1.0 / self.costs.step_time(context, "ahead")
        switch = self._switch(context)
        if self.max[DFLASH]:
            if self.idle[DFLASH] >= self.wait[DFLASH]:
                return False
            if self._best(self.dflash, self.max[DFLASH], context, True, pace[DFLASH], switch)[0] > ahead:
                return False
        lengths = []
        if self.max[LOOKUP]:  # (then the phrase table, whose odds of following this policy learns)
            lengths = index.possible() + ([PHRASES] if index.phrases else [])
        if lengths and self.idle[LOOKUP] >= self.wait[LOOKUP]:
            return False
        step = 1.0 / self.costs.step_time(context, "built")
        waiting, rest = 0.0, 1.0
        for n in lengths:
            chance = rest * self.follows[n].rates(1)[0]
            odds = self.lookup[lookup_bucket(n)]
            lookup = self._best(odds, self.max[LOOKUP], context, False, pace[LOOKUP], switch)[0]
            waiting, rest = waiting + chance * max(lookup, step), rest - chance
        if waiting + rest * step > ahead:
            self.waited_for = lengths
            return False
        return True

    def timed(self, choice: Choice, verified: int, context: int, after: str | None, seconds: float) -> None:
        """A cycle of this choice took `seconds` of wall time, as the engine timed it (`verified`: the
        proposals it verified; `after`: how a plain step was started, as in `CostModel.step_time`)."""
        price = self.price(choice, verified, context, after)
        key = (choice.source, context.bit_length())
        last, spent, priced, cycles = self.run
        if last != key or cycles == PACE_RUN:
            if last is not None:
                self._ran(last, spent / priced)
            spent, priced, cycles = 0.0, 0.0, 0
        self.cycles += 1
        self.run = (key, spent + seconds, priced + price, cycles + 1)

    def _ran(self, key: tuple, ratio: float) -> None:
        """A run of (source, bucket) `key` ended, its wall time over its price `ratio`: pair it with the
        last run of the other side in its range (plain steps; for plain steps, lookup and DFlash) that
        ended at most PACE_PAIR cycles ago, a lookup or DFlash run with one plain run after it at most."""
        if key not in self.warm:
            self.warm.add(key)  # (the first run: left out)
            return
        source, bucket = key
        self.ran[key] = [ratio, self.cycles, False]

        def recent(other: str) -> list | None:
            last = self.ran.get((other, bucket))
            return last if last is not None and self.cycles - last[1] <= PACE_PAIR else None

        def paced(other: str, pace: float) -> None:
            self.pace[(other, bucket)] = [*self.pace.get((other, bucket), [])[1 - PACE_RUNS :], pace]
            self._paces_at = {}

        if source != PLAIN:
            if (plain := recent(PLAIN)) is not None:
                paced(source, ratio / plain[0])
            return
        for other in (LOOKUP, DFLASH):
            last = recent(other)
            if last is not None and not last[2]:
                last[2] = True
                paced(other, last[0] / ratio)

    def price(self, choice: Choice, verified: int, context: int, after: str | None) -> float:
        """What the cost model says a cycle of this choice takes (see `timed`)."""
        if choice.source == PLAIN:
            return self.costs.step_time(context, after)
        price = self.costs.target_time(verified + 1, context)
        if choice.source == DFLASH:
            price += self._draft_time(choice.k, context)
        return price

    def _paces(self, context: int) -> dict[str, float]:
        """Lookup's and DFlash's pace at this context, relative to plain steps' (see PACE_PAIR): from
        its pairs in this context range, else in the nearest range that has some (costs past the
        contexts measured are extrapolated, so their error changes little from one range to the next:
        a first answer at a longer context starts from it), else 1."""
        bucket, paces = context.bit_length(), {}
        if bucket in self._paces_at:
            return self._paces_at[bucket]
        for source in (LOOKUP, DFLASH):
            timed = [b for (s, b), runs in self.pace.items() if s == source and runs]
            near = min(timed, key=lambda b: (abs(b - bucket), b), default=None)
            paces[source] = 1.0 if near is None else statistics.median(self.pace[(source, near)])
        self._paces_at[bucket] = paces
        return paces

    def _bin(self, c: float) -> int:
        return 1 + min(int(c * CONFIDENCE_BINS), CONFIDENCE_BINS - 1)

    def narrow(self, choice: Choice, confidence: mx.array, context: int) -> tuple[int, list[float]]:
        """How many of a drafted block's proposals to verify, now that their confidences are known
        (-> that number, and the confidences as floats). A confidence bin with little evidence leans on
        the position's own odds."""
        confidence = confidence.tolist()
        rates = [self._odds(c, p) for c, p in zip(confidence, self.dflash.rates(len(confidence)))]
        return self._widest_paying(expected_tokens(rates), choice, context), confidence

    def _odds(self, confidence: float, prior: float) -> float:
        """The chance a proposal of this confidence is accepted, its position's odds as the prior."""
        b = self._bin(confidence)
        return (self.bins.hits[b] + PRIOR_TRIALS * prior) / (self.bins.trials[b] + PRIOR_TRIALS)

    def _widest_paying(self, e: list[float], choice: Choice, context: int) -> int:
        """The number of proposals (index into e, the tokens expected by proposals verified) that gives
        the most tokens per second, the fewest where they tie."""
        drafted = self._draft_time(choice.k, context)
        return max(
            [0, *self.costs.counts(len(e) - 1)],
            key=lambda k: (e[k] / (self.costs.target_time(k + 1, context) + drafted), -k),
        )

    def shape(
        self, choice: Choice, ids: mx.array, values: mx.array, context: int, most: int, found: tuple
    ) -> tuple[int, list[float], Tree | None]:
        """A drafted block's shape, now that the drafter's candidates at each position (ids, values: its
        probabilities) are known: -> (proposals to verify, the first guesses' confidences, the tree to
        verify them as, or None for a chain of first guesses). Each candidate's odds of acceptance come
        from its confidence bin as for a chain; the best tree of n nodes is the best-first one by the
        product of its path's odds (trees.py), lookup's match (`found`) joined in by its own odds, and
        its expected tokens are 1 + the sum of those products; n is the one with the most tokens per
        second. A chain of n first guesses is one of the trees of n nodes, so a tree is chosen only
        where it is expected to beat the chain. `most`: the widest pass allowed (a batch's step has
        chosen its width)."""
        if not self.trees:
            k, confidence = self.narrow(choice, values[:, 0], context)
            return k, confidence, None
        ids, values = ids.tolist(), values.tolist()
        priors = self.dflash.rates(len(values))
        odds = [[self._odds(v, p) for v in row] for row, p in zip(values, priors)]
        width = min(most, TREE_MAX) - 1
        tree, scores = build(ids, odds, width)
        tokens, ngram = found
        chain = tokens[: min(width, self.max[LOOKUP])]
        if chain:
            rates = self._lookup_rates(ngram, len(chain))
            tree, scores = graft(tree, scores, chain, list(itertools.accumulate(rates, operator.mul)))
        n = self._widest_paying(list(itertools.accumulate(scores[:width], initial=1.0)), choice, context)
        tree = tree.first(n)
        return n, [row[0] for row in values], None if tree.first_guesses else tree

    def padded(self, width: int) -> int:
        """The width a batched pass whose widest block is `width` is padded to: one measured (`counts`)."""
        return next((w for w in self.costs.widths if w >= width), width)

    def observe(
        self,
        choice: Choice,
        k: int,
        accepted: int,
        confidence: list[float],
        ngram: int,
        match: list[int] | None = None,
    ) -> None:
        """Learn from a cycle's verify pass. Lookup's `match`, where given (all its tokens, of which the
        cycle verified k), is followed on through the tokens written next (`wrote`)."""
        if accepted:
            self.wait[choice.source] = PROBE_FIRST  # it pays again: a later parking probes soon
        if choice.source == LOOKUP and match is not None:
            self.matches.append((match, lookup_bucket(ngram), 0))
        elif choice.source == DFLASH:
            # A block drafted and then not verified at all cost a draft for nothing: a miss at position 1.
            self.dflash.observe(max(k, 1), accepted)
            self.bins.discount(DECAY)
            for j, c in enumerate(confidence[: min(accepted + 1, k)]):
                b = self._bin(c)
                self.bins.trials[b] += 1
                self.bins.hits[b] += j < accepted
        elif choice.source == LOOKUP:
            self._held(lookup_bucket(ngram), k, accepted)

    def _held(self, bucket: int, k: int, held: int) -> None:
        """The first `held` of k tokens of a match in `bucket` were the text's: its odds learn it, and
        so does this answer's yield past the first (see YIELD_PRIOR)."""
        odds = self.lookup[bucket]
        if k > 1:
            e = expected_tokens(odds.rates(k))
            past = (max(held - 1, 0), e[-1] - e[1])
            self.yielded[bucket] = tuple(YIELD_DECAY * x + y for x, y in zip(self.yielded[bucket], past))
        odds.observe(k, held)

    def wrote(self, tokens: list[int]) -> None:
        """The tokens a cycle wrote. Lookup's proposals cost nothing to make, so its odds learn how far
        each match held, not only the part a cycle verified: a match whose k proposals were all taken is
        compared with the tokens written after them too, until one differs or the match ends. Odds
        learnt from the verified part alone would stay where a few early misses left the positions past
        it, and the policy would not verify them again. Above temperature 0 too, a token written equals
        a proposal as often as the target would have accepted it."""
        following = []
        for match, bucket, held in self.matches:
            seen = held
            for t in tokens:
                if seen == len(match) or t != match[seen]:
                    break
                seen += 1
            if seen == len(match) or seen < held + len(tokens):
                self._held(bucket, len(match), seen)
            else:
                following.append((match, bucket, seen))
        self.matches = following

    def observe_tree(self, tree: Tree, values: list[list[float]], path: list[int], ngram: int) -> None:
        """Learn from a tree's verify pass (`values`: the drafter's probabilities it was built from, `path`
        the accepted block indices, `ngram` what lookup's match matched): each node whose parent was
        accepted was tried, and the target took one of them or none. The positions' odds are a chain's
        (what `choose` prices a draft by), so they learn from the tree's chain of first guesses alone:
        how long it was, and how many of them the target took; lookup's from its chain in the tree."""
        on = set(path)
        if tree.lookup:
            taken = next((j for j, i in enumerate(tree.lookup) if i not in on), len(tree.lookup))
            self._held(lookup_bucket(ngram), len(tree.lookup), taken)
            if taken:
                self.wait[LOOKUP] = PROBE_FIRST
        if any(tree.ranks[i - 1] >= 0 for i in path[1:]):
            self.wait[DFLASH] = PROBE_FIRST  # (a guess of the drafter's was taken)
        chain, node = 0, 0  # the chain of first guesses: its length, and its last node's block index
        for i, (parent, rank) in enumerate(zip(tree.parents, tree.ranks)):
            if parent == node and rank == 0:
                chain, node = chain + 1, i + 1
        taken = 0
        while taken < len(path) - 1 and tree.ranks[path[taken + 1] - 1] == 0:
            taken += 1
        # (a tree of lookup's nodes alone verified none of the drafter's: a drafted block not verified
        # at all is a miss at position 1, as for a chain)
        self.dflash.observe(max(chain, 1), taken)
        self.bins.discount(DECAY)
        for i, (parent, depth, rank) in enumerate(zip(tree.parents, tree.depths, tree.ranks)):
            if parent in on and rank >= 0:
                b = self._bin(values[depth - 1][rank])
                self.bins.trials[b] += 1
                self.bins.hits[b] += i + 1 in on


def choose_batch(
    policies: list, contexts: list[int], lookups: list[tuple], pace: BatchPace | None = None
) -> tuple[list[Choice], list[bool]]:
    """The choices of a step over several sequences, and which of them verify in a pass of their own.

    The step's shared pass is as wide as its widest block. For each width, each sequence takes what
    commits the most tokens within it (a draft pass counting as the tokens its time would buy); then a
    sequence whose own wide pass adds tokens faster than the step makes them goes alone (a long lookup
    match among sequences that have none, where a shared wide pass would compute every sequence's
    padding); the width with the most tokens per second wins (width 1 and no one alone: batched plain
    decoding). A sequence's parked option that is due a probe is tried in a step whose shared pass is
    wider than one token, within that width. Where `pace` has plain steps run, batched plain decoding
    (see BatchPace). Policies that are not adaptive (a fixed block) choose for themselves, together."""
    if not all(isinstance(p, AdaptivePolicy) for p in policies):
        return [p.choose(c, f) for p, c, f in zip(policies, contexts, lookups)], [False] * len(policies)
    first, batch, context = policies[0], len(policies), max(contexts)  # (one pair: the same costs)
    costs = first.costs
    if pace is not None and pace.start(batch, costs.batch_time(batch, 1, context)):
        return [Choice(PLAIN, 0)] * batch, [False] * batch
    drafted = first.draft_times(context)
    expected = [p.expectations(f) for p, f in zip(policies, lookups)]
    alone = [
        _alone(costs, by_lookup, by_dflash, drafted, c)
        for (by_lookup, by_dflash), c in zip(expected, contexts)
    ]
    best = (0.0, None, None, 1)
    for width in costs.widths:
        step, options = _within(costs, expected, drafted, width, context)
        tokens, seconds = sum(o[0] for o in options), step + sum(o[2] for o in options)
        solo = [False] * batch
        while True:  # the sequence whose pass alone adds the most over what the step makes, if any does
            rate = tokens / seconds
            gains = [
                (a[0] - rate * a[2]) - (o[0] - rate * o[2]) if a and not solo[b] else 0.0
                for b, (a, o) in enumerate(zip(alone, options))
            ]
            b = max(range(batch), key=gains.__getitem__)
            if gains[b] <= 0:
                break
            solo[b] = True
            tokens += alone[b][0] - options[b][0]
            seconds += alone[b][2] - options[b][2]
            options[b] = alone[b]
        if tokens / seconds > best[0]:
            best = (tokens / seconds, [o[1] for o in options], solo, width)
    _, choices, solo, width = best
    for b, (p, (tokens, n)) in enumerate(zip(policies, lookups)):
        if width == 1 or solo[b]:
            continue  # (a pass of its own for a probe would cost more than the step: measured)
        offered = [Choice(LOOKUP, min(len(tokens), p.max[LOOKUP]))] if p.max[LOOKUP] and tokens else []
        offered += [Choice(DFLASH, p.max[DFLASH])] if p.max[DFLASH] else []
        probe = p.probed(choices[b], offered, n)
        if probe is not choices[b]:
            choices[b] = Choice(probe.source, min(probe.k, width - 1))
    return choices, solo


def _within(costs, expected, drafted, width: int, context: int) -> tuple:
    """A batched step of this width: -> (its seconds, each sequence's best option within it: (expected
    tokens, choice, draft seconds), a draft pass counting as the tokens its time would buy)."""
    step = costs.batch_time(len(expected), width, context)
    share, options = step / len(expected), []
    for by_lookup, by_dflash in expected:
        k = min(width - 1, len(by_lookup) - 1)
        option = (by_lookup[k], Choice(LOOKUP, k) if k else Choice(PLAIN, 0), 0.0)
        for j in costs.counts(min(width - 1, len(by_dflash) - 1)):
            if by_dflash[j] - drafted[j] / share > option[0] - option[2] / share:
                option = (by_dflash[j], Choice(DFLASH, j), drafted[j])
        options.append(option)
    return step, options


def batch_plain_next(policies: list, indexes: list, context: int, pace: BatchPace) -> bool:
    """Whether a batch's next plain step is started before this step's tokens are read (as one
    sequence's is: `AdaptivePolicy.plain_next`): unless a wider step could pay, with each sequence's
    lookup weighed by the chance that a match follows whatever token comes next (`upcoming`).
    Policies that are not adaptive: unless some sequence's lookup may find a match at all."""
    if not all(isinstance(p, AdaptivePolicy) for p in policies):
        return not any(index is not None and index.possible() for index in indexes)
    first, batch = policies[0], len(policies)
    if pace.plain(batch):
        return True
    costs = first.costs
    drafted = first.draft_times(context)
    expected = [p.upcoming(index) for p, index in zip(policies, indexes)]
    plain = batch / costs.batch_time(batch, 1, context)
    for width in costs.widths[1:]:
        step, options = _within(costs, expected, drafted, width, context)
        if sum(o[0] for o in options) / (step + sum(o[2] for o in options)) > plain:
            return False
    return True


class BatchPace:
    """Whether a batch speculates at all, by what its steps really gave each way, by batch size (each
    power of two): tokens per unit of time, the unit a plain step's price at the step's batch size and
    context (`start`), the time from each step's launch to its tokens kept. The cost model prices one
    pass; what speculating costs the steps around it (rows left ragged by a wider step write their
    positions one row at a time until a run of plain steps puts them back in line, `align`, and the
    next plain step is not started ahead while a match may come)
    it cannot, and where width is dear (a CPU) that decides. So a batch runs in turns of BATCH_RUN
    steps: plain (batched plain decoding), or speculating (each step chosen by `choose_batch`); one
    turn of each first, then plain unless speculating's last BATCH_RUNS turns (their median) gave more,
    the other way again every BATCH_PROBE turns. Held by the engine: a batch's choice, not a
    sequence's."""

    def __init__(self):
        self.rates: dict[tuple, list] = {}  # (bucket, plain) -> the last turns' tokens a unit (`start`)
        self.turn: dict[int, list] = {}  # bucket -> [plain, steps left, tokens, units, turns since probe]
        self.warm: set[tuple] = set()  # (bucket, plain) whose first step was left out
        self.stepping: tuple | None = None  # the step under way: (bucket, plain, unit)

    def plain(self, batch: int) -> bool:
        """Whether a step of this batch size now is a plain one."""
        bucket = batch.bit_length()
        return self.turn.setdefault(bucket, [True, BATCH_RUN, 0, 0.0, 0])[0]

    def start(self, batch: int, unit: float) -> bool:
        """`plain`, for the step being launched (the one `timed` next); `unit`: what a plain step of
        it costs by the cost model, the unit its time is counted in (so that turns at other contexts
        and batch sizes within the bucket compare)."""
        self.stepping = (batch.bit_length(), self.plain(batch), unit)
        return self.stepping[1]

    def timed(self, tokens: int, seconds: float) -> None:
        """The step under way gave `tokens` in all in `seconds` (from its launch to its tokens kept)."""
        if self.stepping is None:
            return
        (bucket, plain, unit), self.stepping = self.stepping, None
        if (bucket, plain) not in self.warm:  # (kernels compiled on first use)
            self.warm.add((bucket, plain))
            return
        turn = self.turn[bucket]  # (the way of the step under way: it changes only here)
        turn[1:4] = [turn[1] - 1, turn[2] + tokens, turn[3] + seconds / unit]
        if turn[1] > 0:
            return
        key = (bucket, plain)
        self.rates[key] = [*self.rates.get(key, [])[1 - BATCH_RUNS :], turn[2] / turn[3]]
        rates = {
            way: statistics.median(self.rates[(bucket, way)])
            for way in (False, True)
            if (bucket, way) in self.rates
        }
        if len(rates) < 2:  # the other way not timed yet
            way, best = not plain, plain
        else:  # (plain steps unless speculating is clearly faster: they are never slower than mlx-lm's)
            best = rates[False] <= (1 + BATCH_MARGIN) * rates[True]
            way = not best if turn[4] + 1 >= BATCH_PROBE else best
        self.turn[bucket] = [way, BATCH_RUN, 0, 0.0, 0 if way != best else turn[4] + 1]


def _alone(costs, by_lookup, by_dflash, drafted, context) -> tuple | None:
    """A sequence's best pass of its own: (expected tokens, choice, seconds), the most tokens per second."""
    options = [
        (by_lookup[k], Choice(LOOKUP, k), costs.target_time(k + 1, context))
        for k in costs.counts(len(by_lookup) - 1)
    ] + [
        (by_dflash[j], Choice(DFLASH, j), costs.target_time(j + 1, context) + drafted[j])
        for j in costs.counts(len(by_dflash) - 1)
    ]
    return max(options, key=lambda o: o[0] / o[2], default=None)


# ---- measuring the costs --------------------------------------------------------------------------


def fastest_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` runs after a warm-up: what the pass costs when nothing else competes for
    the machine (a busy moment only ever adds time)."""
    fn()  # warm-up (and compilation)
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return min(times)


def _monotone(rows: list[list[float]]) -> list[list[float]]:
    """Costs that never fall with more positions or a longer context (what noise can make them do)."""
    rows = [[max(row[: i + 1]) for i in range(len(row))] for row in rows]
    return [[max(r[i] for r in rows[: j + 1]) for i in range(len(row))] for j, row in enumerate(rows)]


def _verify_pass(target, cache, block: mx.array):
    def run():
        mx.eval(target(block, cache.target_cache)[0])
        for c in cache.target_cache:  # back to the context (recurrent state does not grow)
            if c.is_trimmable():
                c.trim(block.shape[1])

    return run


def _plain_steps(target, cache, ahead: bool, steps: int):
    """Plain steps, each built while the one before runs, and launched before (`ahead`) or after that
    one's token is read, as decoding runs them (-> the seconds of `steps` of them)."""

    def run():
        y = mx.array([1])
        mx.eval(y)
        for _ in range(steps):
            nxt = mx.argmax(target(y.reshape(1, 1), cache.target_cache)[0][0, -1:], axis=-1)
            if ahead:
                mx.async_eval(nxt)
            y.item()
            mx.async_eval(nxt)
            y = nxt
        y.item()
        for c in cache.target_cache:
            if c.is_trimmable():
                c.trim(steps)

    return run


def _draft_pass(draft, cache, k: int):
    block = draft_block(k, draft.block_size)
    return lambda: mx.eval(draft.propose_logits(1, cache.draft_cache, block, True, heads=k))


def _plan(target, draft, contexts=(64, 1024), widths=WIDTHS, proposals=(1, 3, 7, 15, 31)) -> tuple:
    """The contexts (capped by the model's), widths and proposal counts a measurement times."""
    limit = context_length(target) or 1 << 30
    contexts = sorted({min(c, limit - max(widths) - 1) for c in contexts})
    proposals = [k for k in proposals if k < draft.block_size] if draft is not None else []
    return contexts, list(widths), proposals


def measured_passes(target, draft) -> int:
    """How many passes `measure_costs` times for this pair."""
    contexts, widths, proposals = _plan(target, draft)
    return len(contexts) * (len(widths) + 2 + len(proposals))


def ticker(progress, total: int):
    """-> a `tick()` that reports each pass timed as `progress(done, total)` (does nothing without one)."""
    if progress is None or not total:
        return _nothing
    done = itertools.count(1)
    return lambda: progress(next(done), total)


def _nothing() -> None:
    pass


def measure_costs(target, draft, repeats: int = 3, tick=_nothing, **plan) -> CostModel:
    """Time the target's passes by width and the drafter's by proposals, after random prompts of each
    context length (`_plan`'s); `tick()` after each pass is timed (for a progress bar)."""
    contexts, widths, proposals = _plan(target, draft, **plan)
    vocab = target.vocab_size
    key = mx.random.key(0)  # random ids without touching the global generator (a seeded run's draws)

    def timed(fn) -> float:
        seconds = fastest_seconds(fn, repeats)
        tick()
        return seconds

    table, drafts, ahead, built = [], [], [], []
    for context in contexts:
        cache = SpeculativeCache(target, draft)
        cache.prefill(mx.random.randint(0, vocab, (context,), key=key).tolist())
        table.append(
            [timed(_verify_pass(target, cache, mx.random.randint(0, vocab, (1, w), key=key))) for w in widths]
        )
        ahead.append(timed(_plain_steps(target, cache, True, steps=4)) / 4)
        built.append(timed(_plain_steps(target, cache, False, steps=4)) / 4)
        if proposals:
            drafts.append([timed(_draft_pass(draft, cache, k)) for k in proposals])
    table = _monotone(table)
    # Never dearer than a step alone (a noisy moment could make them look it), ahead never dearer than built.
    built = [min(b, row[0]) for b, row in zip(built, table)]
    ahead = [min(a, b) for a, b in zip(ahead, built)]
    return CostModel(list(contexts), list(widths), table, proposals, _monotone(drafts), ahead, built)


def warm_up(model, draft, context: int = 64) -> None:
    """Run once, at a short context, each pass the adaptive policy may choose for this pair: a verify
    pass of every width it verifies (`CostModel.counts`), as a chain and, where trees may be built, as a
    tree, and the drafter's pass for every proposal count. Where MLX compiles kernels on first use (a
    GPU), they are then compiled, or read from the kernel cache, before the first answer instead of
    during it. The pair's costs are measured first where they are not yet (they warm up as they go)."""
    target = prepare(model, draft)
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise UserError(f"context must be a whole number of tokens, 1 or more, got {context!r}")
    costs = costs_for(target, draft)
    if context + max(costs.widths) > (length := context_length(target) or 1 << 62):
        raise UserError(
            f"context leaves no room for the widest pass ({max(costs.widths)} tokens) in the model's "
            f"{length}: give at most {length - max(costs.widths)}"
        )
    cache = SpeculativeCache(target, draft)
    tokens = mx.random.randint(0, target.vocab_size, (context + max(costs.widths),), key=mx.random.key(0))
    cache.prefill(tokens[:context].tolist())
    cache.add(tokens[context : context + 1].tolist())  # (the pending token each pass starts from)
    trees = draft is not None and from_logits(draft) and target.trimmable
    for w in costs.widths:
        block = tokens[None, context : context + w]
        shapes = [None, [Tree([1] * (w - 1), [0] * (w - 1), [1] * (w - 1))]] if trees and w > 2 else [None]
        for tree in shapes:
            mx.eval(cache.verify(block, trees=tree)[0])
            cache.cancel()
    if draft is not None:
        drafter = DFlashDrafter(draft, draft.block_size)
        for k in costs.counts(draft.block_size - 1):
            mx.eval(drafter.candidates(cache.pending[-1], cache.draft_cache, k))


def _batch_pass(target, batch: list, tokens: mx.array):
    def run():
        logits, _, undo = target.verify(tokens, batch)
        mx.eval(logits)
        target.rollback(batch, undo, [0] * tokens.shape[0])

    return run


def _unpriced(priced, sizes) -> list[int]:
    return sorted({b for b in sizes if b > 1} - set(priced))


def with_batches(costs: CostModel, target, sizes, repeats: int = 3, tick=_nothing) -> CostModel:
    """These costs with a target pass over each batch size in `sizes` measured (at every context and
    width of the table), where it is not already: the rows of one random prompt's cache per context;
    `tick()` after each pass is timed."""
    sizes = _unpriced(costs.batches, sizes)
    if not sizes:
        return costs
    key, vocab = mx.random.key(1), target.vocab_size
    batches = {b: [] for b in sizes}
    for context in costs.contexts:
        cache = SpeculativeCache(target, None)
        cache.prefill(mx.random.randint(0, vocab, (context,), key=key).tolist())
        if not batchable(cache.target_cache):
            return costs  # (its sequences step one at a time: no batched pass to price)
        for b in sizes:
            batch, row = merge([cache.target_cache] * b), []
            for w in costs.widths:
                tokens = mx.random.randint(0, vocab, (b, w), key=key)
                row.append(fastest_seconds(_batch_pass(target, batch, tokens), repeats))
                tick()
            batches[b].append(row)
    measured = {b: _monotone(rows) for b, rows in batches.items()}
    return replace(costs, batches={**costs.batches, **measured})


def batch_sizes(most: int) -> list[int]:
    """The batch sizes to price for up to `most` sequences at once: powers of two, and `most`."""
    return sorted({1 << i for i in range(1, most.bit_length()) if 1 << i < most} | {most} - {1})


def cost_key(target, draft) -> str:
    """What the costs depend on: the models' shapes and dtypes, this machine and its MLX build."""

    def quantized(model) -> list:
        return sorted(
            {
                (type(m).__name__, m.bits, m.group_size, getattr(m, "mode", ""))
                for _, m in model.named_modules()
                if hasattr(m, "bits")
            }
        )

    facts = {
        "method": 6,  # how costs are measured: files from another method are measured again
        "target": [
            target.family,
            vars(target.args),
            str(target.inner.embed_tokens.weight.dtype),
            quantized(target.model),
        ],
        "draft": None if draft is None else [draft.config.to_dict(), str(draft.dtype), quantized(draft)],
        "machine": [
            platform.machine(),
            platform.processor(),
            platform.node(),
            backend(),
            mx.__version__,
            blas["library"],
        ],
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def costs_path(target, draft) -> Path:
    return cache_home() / "costs" / f"{cost_key(target, draft)}.json"


def costs_for(target, draft, batches=(), progress=None) -> CostModel:
    """This pair's costs on this machine: measured at first use (half a minute to a few minutes), then
    read from disk; `batches`: the batch sizes whose passes must be priced too (measured where they are
    not yet); `progress(done, total)`: the passes timed so far, of all this call times."""
    path = costs_path(target, draft)
    kept = kept_costs(path)  # (written whole: read without waiting for a process measuring more)
    if kept is not None and not _unpriced(kept.batches, batches):
        return kept
    # Two processes measuring at once would each time passes slowed by the other's: the second waits,
    # then reads what the first measured.
    with one_at_a_time(f"costs-{path.stem}", "measuring this machine's costs for the pair"):
        costs = kept_costs(path)
        contexts, widths = (costs.contexts, costs.widths) if costs else _plan(target, draft)[:2]
        priced = len(contexts) * len(widths) * len(_unpriced(costs.batches if costs else {}, batches))
        total = (costs is None) * measured_passes(target, draft) + priced
        tick = ticker(progress, total)
        if costs is None:
            costs = measure_costs(target, draft, tick=tick)
            keep_costs(path, costs)
        batched = with_batches(costs, target, batches, tick=tick)
        if batched is not costs:
            keep_costs(path, batched)
    return batched


def kept_costs(path: Path) -> CostModel | None:
    """The costs kept at `path`, or None (none, unreadable, or not a cost model: measured again)."""
    try:
        return CostModel(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def keep_costs(path: Path, costs: CostModel) -> bool:
    """-> whether they were kept."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as tmp:
            tmp.write_text(json.dumps(costs.to_dict()))
    except (OSError, UserError):  # (atomic_file's: a folder or a device there)
        return False  # a home that cannot be written: the costs serve this run, and are measured next time
    return True


# The adaptive policy last made in this process for each pair, lookup setting, draft window and kind of
# acceptance (matching or sampling): the next call (a chat turn, a request, a prompt) starts from what it
# learnt, not from the priors, which would spend the first cycles of every answer finding out again. What
# it learnt is kept on disk too (`keep_learnt`), so that the first answer of the next process (each
# `dflash-mlx generate`) starts from it as well.
_LEARNT: dict[tuple, AdaptivePolicy] = {}
LEARNT_METHOD = 3  # how cycles are timed and paced: paces learnt by an earlier method are not read


def weights_digest(model) -> str | None:
    """A few of a model's weights, as a short digest: what tells apart models of the same shapes (a
    drafter and its retrained successor, a target and its fine-tune)."""
    if model is None:
        return None
    arrays = [v for _, v in tree_flatten(model.parameters())]
    spread = sorted({0, len(arrays) // 2, len(arrays) - 1})
    picked = [arrays[i].reshape(-1)[:32].astype(mx.float32).tolist() for i in spread]
    return hashlib.sha256(json.dumps(picked).encode()).hexdigest()[:16]


def learnt_path(key: tuple) -> Path:
    """Where what the policies of this `_LEARNT` key learnt is kept (what cycles timed another way
    learnt, `LEARNT_METHOD`, is not read)."""
    name = hashlib.sha256(json.dumps([LEARNT_METHOD, *(str(x) for x in key)]).encode()).hexdigest()[:16]
    return cache_home() / "policies" / f"{name}.json"


def keep_learnt(policy) -> None:
    """Keep what an adaptive policy (made by `policy_for`) has learnt for the next process (a fixed
    policy learns nothing)."""
    if not isinstance(policy, AdaptivePolicy) or policy.key is None:
        return
    try:
        path = learnt_path(policy.key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as tmp:
            tmp.write_text(json.dumps(policy.learnt()))
    except (OSError, UserError):  # (atomic_file's: a folder or a device there)
        pass  # a home that cannot be written: the next process learns again


def policy_for(
    target,
    draft,
    *,
    block_size: int | None,
    lookup: bool,
    draft_window: int | None = None,
    sampled: bool = False,
    tree: int | None = None,
    trees: bool = False,
    processed: bool = False,
    keyed: bool = False,
):
    """A fixed block (or a fixed `tree` pass of that width) when one is given (or nothing to choose
    from), else the adaptive policy (choosing trees too where `trees`), from what the last one for the
    same pair learnt (in this process, else in the last one: `keep_learnt`)."""
    if tree is not None:
        return FixedPolicy(block_size or draft.block_size, True, tree)
    if block_size is not None or (draft is None and not lookup):
        return FixedPolicy(block_size or 1, draft is not None)
    path = costs_path(target, draft)
    policy = AdaptivePolicy(
        costs_for(target, draft),
        draft.block_size - 1 if draft is not None else 0,
        lookup,
        draft_window=draft_window,
        trees=trees,
    )
    # (the weights too: a retrained drafter has its predecessor's costs, not its acceptance)
    key = (path, lookup, draft_window, sampled, trees, weights_digest(target.model), weights_digest(draft))
    key += ("processed",) * processed  # (penalties move acceptance: what they learn is kept apart)
    key += ("keyed",) * keyed  # (seeded answers accept by matching keyed draws, not by rejection sampling)
    if key in _LEARNT:
        policy.learn_from(_LEARNT[key])
    else:
        try:  # what the last process learnt
            policy.restore(json.loads(learnt_path(key).read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none kept, or unreadable: from the priors
    policy.wait = {source: min(wait, PROBE_ANSWER) for source, wait in policy.wait.items()}
    policy.key = key
    _LEARNT[key] = policy
    return policy
