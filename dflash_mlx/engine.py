"""The speculative cycle as one step over a batch of sequences.

    choose   each sequence's policy: a plain step, lookup k or DFlash k; with several sequences, one
             width for the whole step, the one that gives the batch the most tokens per second
    propose  lookup from each sequence's own index, the drafter for each sequence that drafts
    verify   ONE target pass over every sequence's block [pending, proposals] (narrower blocks padded)
    accept   per sequence: greedy match or rejection sampling -> n proposals + 1 target token
    commit   per sequence: the target keeps n + 1 of its positions, the drafter's context their features

A step is launched (`launch`) before the previous step's tokens are handed out (`collect` returns them),
so Python's work overlaps the models'; a plain step's successor is even built while it runs, and started
when every policy is sure of it (see cache.py). Sequences join (`add`) and leave between steps; while
a step has two or more, their target caches are lent to one batch (batching.py). A target whose caches
cannot batch (recurrent layers) runs its sequences one step each, in turn.

Every step yields at least one token per sequence, and every token is one the target would have
produced for that sequence alone: the same tokens at temperature 0, the same distribution above it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from .batching import RowView, align, batchable, join, leave, merge, split
from .cache import SpeculativeCache
from .drafters import DFlashDrafter, from_logits, propose_together
from .errors import UserError
from .pairing import prepare
from .policy import (
    DFLASH,
    LOOKUP,
    PLAIN,
    TREE,
    BatchPace,
    Choice,
    batch_plain_next,
    choose_batch,
    keep_learnt,
    policy_for,
)
from .sampling import acceptance, guarded, log_probabilities, match_accept, out_of_vocabulary
from .settings import GenerationSettings
from .trees import TREE_MAX, Tree, path_of, walk

NONE = mx.array([], dtype=mx.int32)


@dataclass
class Cycle:
    """One sequence's part of a step under way: its choice and proposals, and (lazy) how many of them
    the target accepted and the token it adds."""

    choice: Choice
    x: mx.array  # proposals
    confidence: list
    found: tuple  # lookup's (tokens, n) for this cycle (`NgramIndex.match`)
    row: int  # its row in the step's pass
    n: mx.array
    nxt: mx.array
    tree: Tree | None = None  # the proposals' tree, if they were verified as one
    values: mx.array | None = None  # ... the drafter's candidates' probabilities it was built from
    accepted: mx.array | None = None  # ... which of the block's positions were accepted
    after: str | None = None  # a plain step built before its turn: "built", or "ahead" if also started
    logprobs: mx.array | None = None  # its pass's logits rows, where the answer gives log-probabilities


@dataclass(eq=False)
class Sequence:
    """One answer: its cache, settings and the rules its tokens are chosen and accepted by."""

    cache: SpeculativeCache
    settings: GenerationSettings
    room: int  # tokens it may produce in all (max_tokens, within the context)
    eos: frozenset = frozenset()
    sampler: Callable | None = None
    compile: bool = True
    processors: list = field(default_factory=list)  # mlx-lm logits processors, after the settings' own
    scores: list | None = None  # the log-probabilities of the tokens last handed out (`score`)
    produced: int = 0
    finish: str | None = None  # "stop" or "length" once it has ended
    removed: bool = False  # taken out of the engine (it may be added again)
    cycle: Cycle | None = field(default=None, repr=False)

    def __post_init__(self):
        """`keyed`: with a seed, above temperature 0, the token at each position is drawn with a key made
        from the seed and the position (a custom sampler draws with MLX's generator seeded so), and
        proposals are accepted where they equal those draws: the answer then depends on the seed alone,
        not on what the policy chose to propose, so not on the machine's pace or on what runs beside it
        in a batch either."""
        s, cache = self.settings, self.cache
        # the latest tokens the processors look at (all where one is the caller's own)
        sizes = (s.repetition_context_size, s.presence_context_size, s.frequency_context_size)
        self.window = None if self.processors else max(sizes)
        vocab = cache.target.vocab_size
        if s.logit_bias and max(s.logit_bias) >= vocab:  # (before MLX reads them: past 2**63 it cannot)
            raise UserError(
                f"logit_bias token id {max(s.logit_bias)} is past the vocabulary (0..{vocab - 1})"
            )
        self.processors = s.processors() + list(self.processors)
        if self.sampler is not None:
            self.sampler = guarded(self.sampler)
        self.keyed = s.seed is not None and (self.sampler is not None or not s.greedy)
        self.draw, self.accept = acceptance(s, self.sampler)
        if self.keyed and self.sampler is None:
            self.draw = lambda logits: (mx.argmax(logits, axis=-1), None)
        matched = self.sampler is not None or s.greedy  # proposals accepted where they equal the target's
        draft = cache.draft
        self.lookup = s.lookup and s.block_size is None  # (a fixed tree joins lookup's match in)
        # Trees need a drafter whose guesses at each position come from its logits alone, and a target
        # whose caches take a tree's positions back (no recurrent layers). The adaptive policy builds
        # them where proposals are accepted by matching the target's own choices (trees.py).
        can_tree = draft is not None and from_logits(draft) and cache.target.trimmable
        if s.tree is not None and not can_tree:
            raise UserError(
                "tree needs a DFlash drafter (not a DFlash2 one) and a target without recurrent layers"
            )
        self.trees = can_tree and (s.tree is not None or (s.block_size is None and (matched or self.keyed)))
        self.policy = policy_for(
            cache.target,
            draft,
            block_size=s.block_size,
            lookup=s.lookup,
            draft_window=cache.draft_window,
            sampled=not matched,
            processed=bool(self.processors),
            keyed=self.keyed,
            tree=s.tree,
            trees=self.trees,
        )
        q_temperature = 0.0 if matched or self.keyed else s.temperature
        self.drafter = (
            DFlashDrafter(draft, s.block_size or draft.block_size, self.compile, q_temperature)
            if draft is not None
            else None
        )
        sampler = self.sampler
        self.pick = (
            (lambda logits: sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True)))
            if sampler is not None
            else s.sample
        )

    def start(self, prompt: list[int], progress=None) -> list[int]:
        """Prefill the prompt (after what the cache holds; `progress` as `SpeculativeCache.prefill`
        takes it) and choose the first token: -> the tokens to hand out (none past the room; the EOS
        included)."""
        return self.begin(self.cache.prefill(prompt, self.settings.prefill_step_size, progress))

    def begin(self, logits: mx.array) -> list[int]:
        """`start` once the prompt is prefilled (`logits`: the target's after it, as `prefill` gives)."""
        try:
            row = self.processed(logits, [[]])
            first = int(self.pick_at(row, len(self.cache.tokens)).item())
            if first < 0:
                raise out_of_vocabulary()
            self.scores = self.score(self.scored(row), [0], [first])
        except BaseException:  # (a failing sampler, Ctrl-C): the prompt is in, its answer is not
            self.cache.broken = True
            raise
        new = self.cut([first])
        self.cache.add([first])
        return new

    def cut(self, new: list[int]) -> list[int]:
        """New tokens cut at the room left, then after an EOS (one past the room is never reached);
        sets `finish` when they end the answer."""
        room = self.room - self.produced
        new = new[:room]
        for i, t in enumerate(new):
            if t in self.eos:
                new, self.finish = new[: i + 1], "stop"
                break
        else:
            if len(new) == room:
                self.finish = "length"
        self.produced += len(new)
        return new

    def processed(self, logits: mx.array, paths: list) -> mx.array:
        """Logits rows with the logits processors applied, row j's seeing the sequence's tokens and then
        paths[j] (the proposals before its position: a list or an array of ids), as plain decoding's
        see every token before theirs. Each row is processed alone (a processor takes one history)."""
        if not self.processors:
            return logits
        history = mx.array(self.cache.tokens[-self.window if self.window else 0 :], dtype=mx.int32)
        rows = []
        for j, path in enumerate(paths):
            seen = mx.concatenate([history, mx.array(path, dtype=mx.int32)]) if len(path) else history
            row = logits[j : j + 1]
            for processor in self.processors:
                row = _checked(processor(seen, row), logits.shape[-1])
            rows.append(row)
        return mx.concatenate(rows)

    def scored(self, logits: mx.array) -> mx.array | None:
        """A pass's (processed) logits rows, kept where the answer gives log-probabilities (`score`)."""
        return None if self.settings.logprobs is None else logits

    def score(self, logits: mx.array | None, rows: list[int], tokens: list[int]) -> list | None:
        """For each token (predicted by logits[rows[j]]): (its log-probability, the settings' number of
        most likely tokens there as (id, log-probability), best first); None where none are given.
        Only the rows of the tokens kept are normalised."""
        if logits is None or not tokens:
            return None if logits is None else []
        return log_probabilities(logits[mx.array(rows[: len(tokens)])], tokens, self.settings.logprobs)

    def pick_at(self, logits: mx.array, position: int, depths: list[int] | None = None) -> mx.array:
        """The target's token(s) for logits rows predicting positions `position`, `position` + 1, ...
        (or `position` + depths[j] for row j: a tree's nodes), each row drawn on its own."""
        if self.keyed:
            depths, seed = range(logits.shape[0]) if depths is None else depths, self.settings.seed
            if self.sampler is not None:  # (its draws come from MLX's generator)
                rows = []
                for j, d in enumerate(depths):
                    mx.random.seed(_position_seed(seed, position + d))
                    rows.append(self.pick(logits[j : j + 1]))
                return mx.concatenate(rows)
            scaled = self.settings.scaled(logits)
            noise = mx.stack(
                [mx.random.gumbel(scaled.shape[-1:], key=_position_key(seed, position + d)) for d in depths]
            )
            # The Gumbel-max draw (exact) moves only where two tokens' perturbed logits tie within the
            # logits' float noise, so a batched pass's noise (about 1e-5) leaves it as alone.
            # mx.random.categorical's draw with the same key moved at about 1 position in 70 under it.
            return mx.argmax(scaled + noise, axis=-1)
        if self.sampler is not None and logits.shape[0] > 1:  # (a sampler may draw once per call)
            return mx.concatenate([self.pick(logits[j : j + 1]) for j in range(logits.shape[0])])
        return self.pick(logits)

    def accept_at(self, x: mx.array, q, logits: mx.array, position: int, tree: Tree | None = None):
        """(accepted proposals, next token, and for a tree which block positions were accepted) of a
        verify pass whose first row predicts `position`."""
        if tree is not None:  # (the target's own choice at every node, followed from the root)
            return walk(tree, self.pick_at(logits, position, [0, *tree.depths]))
        if self.keyed:
            return (*match_accept(x, self.pick_at(logits, position)), None)
        return (*self.accept(x, q, logits), None)


def _position_seed(seed: int, position: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + position) % 2**64


def _position_key(seed: int, position: int) -> mx.array:
    return mx.random.key(_position_seed(seed, position))


@dataclass
class Result:
    """What one step gave one sequence."""

    seq: Sequence
    tokens: list[int]
    accepted: int  # proposals kept + 1
    source: str  # PLAIN, LOOKUP, DFLASH or TREE
    proposed: int  # proposals verified (a tree's nodes)
    scores: list | None = None  # the tokens' log-probabilities, where the answer gives them (`score`)


class Engine:
    def __init__(self, model, draft):
        """`model`: the mlx-lm target (or a Target); `draft`: its drafter, or None."""
        self.target, self.draft = prepare(model, draft), draft
        self.rows: list[Sequence] = []  # the sequences generating, in batch order
        self.joining: list[Sequence] = []
        self.batch: list | None = None  # the lent target caches while two or more rows step together
        self.step_rows: list[Sequence] = []  # the rows of the step under way
        self.undo = None  # the batched pass under way (one row: its cache holds it)
        self.solo: dict = {}  # rows of the step under way verified in a pass of their own (see _verify)
        self.features = None
        self.ready = None  # a plain step built on the last step's tokens: (features, next tokens, their rows)
        self.started = False  # ... and launched
        self.turn = 0  # whose step it is, when sequences cannot batch
        self.launched: float | None = None  # when the step under way was launched (None: not timed)
        self.collected: float | None = 0.0  # when the last step was collected, less the time it spent
        # starting the next (None: the driver did other work since: `other_work`)
        self.pace = BatchPace()  # what its batched steps really take

    # ---- membership -------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """A sequence `start`ed and not finished joins from the next step."""
        seq.removed = False
        self.joining.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out: its part of a step under way is taken back, leaving its cache as before
        that step and its own again: now, or where a batched step is under way, when it is collected."""
        seq.removed = True
        if seq in self.joining:
            self.joining.remove(seq)
        stepping = self.step_rows and self.ready is None  # a step launched and not collected
        if stepping and (self.batch is not None or seq not in self.step_rows):
            return  # (collect hands it back)
        self._drop_step()
        self._regroup()

    @property
    def active(self) -> bool:
        return any(s.finish is None and not s.removed for s in self.rows + self.joining)

    def _regroup(self) -> None:
        """Let finished and removed rows go (their caches handed back), new ones in; lend the caches to
        a batch while two or more rows can step together. Rows that stay stay in the batch: only the
        rows that come and go are copied (`join`, `leave`)."""
        gone = [s for s in self.rows if s.finish is not None or s.removed]
        for s in gone:  # an answer's end: what its policy learnt is kept for the next process
            keep_learnt(s.policy)
        new = [s for s in self.joining if not s.removed]
        self.joining = []
        if not gone and not new:
            return
        if self.batch is None:
            self.rows = [s for s in self.rows if s not in gone]
        else:
            if gone:
                rows = [self.rows.index(s) for s in gone]
                order = leave(self.batch, rows, [s.cache.target_cache for s in gone])
                self.rows = [self.rows[b] for b in order]
            if new:
                join(self.batch, [s.cache.target_cache for s in new])
        self.rows += new
        if self.batch is None and len(self.rows) > 1 and batchable(self.rows[0].cache.target_cache):
            self.batch = merge([s.cache.target_cache for s in self.rows])
        elif self.batch is not None and len(self.rows) < 2:  # (one row steps on its own cache)
            self._unbatch()

    # ---- the step ---------------------------------------------------------------------------------

    def launch(self) -> None:
        """Choose, propose and start the next step's target pass."""
        tic = time.perf_counter()
        rows, ready, started = self._next_rows()
        if not rows:
            return
        self.launched = tic
        contexts = [len(s.cache.tokens) for s in rows]
        founds = [s.cache.index.match() if s.lookup and not started else ([], 0) for s in rows]
        if len(rows) == 1:
            choices, solo = [rows[0].policy.choose(contexts[0], founds[0])], [False]
        else:
            choices, solo = choose_batch([s.policy for s in rows], contexts, founds, self.pace)
        if ready is not None:
            if all(c.source == PLAIN for c in choices):  # the plain step built already
                if not started:
                    self._launch_built(*ready[:2])
                self.features, self.step_rows = ready[0], rows
                after = "ahead" if started else "built"
                if started:  # (it runs from the last collection on)
                    self.launched = self.collected
                for b, (s, c) in enumerate(zip(rows, choices)):
                    nxt, logprobs = ready[1][b], s.scored(ready[2][b])
                    s.cycle = Cycle(c, NONE, [], founds[b], b, mx.array(0), nxt, after=after)
                    s.cycle.logprobs = logprobs
                return
            self._drop_step()
        proposals = self._propose(rows, choices, founds, contexts, solo)
        blocks = [mx.concatenate([mx.array([s.cache.pending[-1]]), p[0]]) for s, p in zip(rows, proposals)]
        logits = self._verify(rows, blocks, solo, [p[3] for p in proposals])
        for b, (s, choice, (x, q, confidence, tree, values)) in enumerate(zip(rows, choices, proposals)):
            accepted = None
            if x.size:
                row = (self.solo[b][1][0] if b in self.solo else logits[b])[: blocks[b].size]
                if s.processors:
                    paths = tree.paths() if tree is not None else [x[:j] for j in range(x.size + 1)]
                    row = s.processed(row, paths)
                n, nxt, accepted = s.accept_at(x, q, row, contexts[b], tree)
            else:
                row = s.processed(logits[b, :1], [[]])
                n, nxt = mx.array(0), s.pick_at(row, contexts[b])[0]
            mx.async_eval(n, nxt)
            s.cycle = Cycle(choice, x, confidence, founds[b], b, n, nxt, tree, values, accepted)
            s.cycle.logprobs = s.scored(row)
        self.step_rows = rows

    def _next_rows(self):
        """The rows of the next step, after letting rows go and come: -> (rows, the plain step built for
        them if it still fits, whether it was launched)."""
        ready, started = self.ready, self.started
        if ready is not None and (self.joining or any(s.finish or s.removed for s in self.rows)):
            self._drop_step()  # (built for the rows that were; they change)
            ready = None
        self._regroup()
        rows = self.rows
        if self.batch is None and len(self.rows) > 1:  # one row a step, in turn
            self.turn = (self.turn + 1) % len(self.rows)
            rows = [self.rows[self.turn]]
            if self.step_rows != rows and ready is not None:
                self._drop_step()
                ready = None
        self.ready = None
        return rows, ready, started and ready is not None

    def _propose(self, rows, choices, founds, contexts, solo) -> list[tuple]:
        """Each row's proposals for its choice: -> (tokens, their q or None, confidences, their tree or
        None, the candidates' probabilities it was built from). Rows that draft draft together (one
        drafter pass where the drafter can), each cut back to the width its confidences pay for; a row
        that may verify a tree drafts its candidates alone, and its policy shapes them."""
        out = [(NONE, None, [], None, None)] * len(rows)
        shaped = [b for b, c in enumerate(choices) if c.source == DFLASH and rows[b].trees and not solo[b]]
        for b in shaped:
            s = rows[b]
            ids, values = s.drafter.candidates(s.cache.pending[-1], s.cache.draft_cache, choices[b].k)
            most = choices[b].k + 1 if len(rows) > 1 else TREE_MAX  # (a batch's width is chosen)
            k, confidence, tree = s.policy.shape(choices[b], ids, values, contexts[b], most, founds[b])
            x = ids[:k, 0] if tree is None else mx.array(tree.tokens, dtype=mx.int32)
            out[b] = (x, None, confidence, tree, values)
        drafting = [b for b, c in enumerate(choices) if c.source == DFLASH and b not in shaped]
        if drafting:
            drafted = propose_together(
                [rows[b].drafter for b in drafting],
                [rows[b].cache.pending[-1] for b in drafting],
                [rows[b].cache.draft_cache for b in drafting],
                [choices[b].k for b in drafting],
                [rows[b].draw for b in drafting],
            )
            for b, (x, q, confidence) in zip(drafting, drafted):
                k, confidence = rows[b].policy.narrow(choices[b], confidence, contexts[b])
                out[b] = (x[:k], None if q is None else q[:k], confidence, None, None)
        for b, (choice, found) in enumerate(zip(choices, founds)):
            if choice.source == LOOKUP:  # q None: proposed with certainty
                out[b] = (mx.array(found[0][: choice.k], dtype=mx.int32), None, [], None, None)
        return out

    def collect(self) -> list[Result]:
        """Finish the step under way: -> each of its sequences' new tokens (cut at EOS and the room)."""
        rows = self.step_rows
        if not rows:
            return []
        cycles = [s.cycle for s in rows]
        plain = all(c.x.size == 0 for c in cycles)
        going = all(s.produced + 1 < s.room and not s.removed for s in rows)
        same = self.batch is not None or len(self.rows) == 1  # (the same rows step next)
        ahead = 0.0  # the seconds spent here starting the next step (see `_time`)
        if plain and going and same:  # build the next plain step on tokens not yet read
            self._keep(rows, [1] * len(rows))
            if self.batch is not None and self.pace.plain(len(rows)):  # a run of plain steps:
                align(self.batch)  # rows a speculative step left ragged go back in line first
            self.ready = self._build_plain(rows, mx.stack([c.nxt for c in cycles]))
            if self._plain_next(rows):
                tic = time.perf_counter()
                self._launch_built(*self.ready[:2])
                ahead = time.perf_counter() - tic
                self.started = True
            else:
                self.started = False
        mx.eval([(c.n, c.nxt, c.x, c.accepted) for c in cycles])
        results, tokens, paths = [], [], {}
        for b, (s, c) in enumerate(zip(rows, cycles)):
            if s.removed:
                tokens.append([])
                continue
            n = c.n.item()
            if c.tree is None:
                s.policy.observe(c.choice, c.x.size, n, c.confidence, c.found[1], c.found[0])
                proposals, source = c.x.tolist()[:n], c.choice.source if c.x.size else PLAIN
            else:
                paths[b] = path_of(c.accepted.tolist())
                s.policy.observe_tree(c.tree, c.values.tolist(), paths[b], c.found[1])
                proposals, source = [c.tree.tokens[i - 1] for i in paths[b][1:]], TREE
            nxt = c.nxt.item()
            if nxt < 0:  # (only a custom sampler's draw: see `guarded`)
                s.cache.broken = True
                raise out_of_vocabulary()
            new = s.cut(proposals + [nxt])
            s.policy.wrote(new)
            tokens.append(new)
            scores = s.score(c.logprobs, paths.get(b) or list(range(n + 1)), new)
            results.append(Result(s, new, n + 1, source, c.x.size, scores))
        if self.ready is None:
            self._keep(rows, [len(t) for t in tokens], tokens, paths)
        else:
            for s, t in zip(rows, tokens):
                s.cache.add(t)
        for s in rows:
            s.cycle = None
        self.step_rows = [] if self.ready is None else rows
        if self.launched is not None and results:
            if self.batch is None:
                self._time(results[0], cycles[0], ahead)
            else:
                self.pace.timed(sum(map(len, tokens)), time.perf_counter() - self.launched - ahead)
            self.launched = None
        self.collected = time.perf_counter() - ahead
        if any(s.finish or s.removed for s in self.rows):  # their caches go back to them now
            self._drop_step()
            self._regroup()
        return results

    def _time(self, result: Result, cycle: Cycle, ahead: float) -> None:
        """Tell a sequence stepping alone what its cycle took, from its launch (a plain step started
        ahead: from its start in the last collection) to its tokens kept, with whatever the driver did
        meanwhile (handing out the last tokens): its policy learns its pace. `ahead`: the seconds this
        collection spent starting the next step, which are that step's: on MLX's CPU backend starting
        a step waits for most of it to run (an eval keeps at most 10 tasks in flight), and a plain
        step after any other cycle would otherwise be timed as two."""
        seconds = time.perf_counter() - self.launched - ahead
        context = len(result.seq.cache.tokens) - len(result.tokens)
        result.seq.policy.timed(cycle.choice, cycle.x.size, context, cycle.after, seconds)

    def other_work(self) -> None:
        """The driver is doing other work (a prompt's prefill) between steps: a plain step started
        ahead, running meanwhile, is not timed."""
        self.collected = None

    def _plain_next(self, rows: list[Sequence]) -> bool:
        """Whether to start the plain step just built before this step's tokens are read: when the one
        sequence's policy is sure of it, or, in a batch, when no wider step could pay with the matches
        lookup may find with whatever tokens come next (`batch_plain_next`)."""
        if any(s.settings.logprobs is not None for s in rows):
            return False  # (their log-probabilities are read first: started, the next pass would run before)
        if len(rows) == 1:
            (s,) = rows
            return s.policy.plain_next(len(s.cache.tokens) + 1, s.cache.index)
        indexes = [s.cache.index if s.lookup else None for s in rows]
        context = max(len(s.cache.tokens) for s in rows) + 1
        return batch_plain_next([s.policy for s in rows], indexes, context, self.pace)

    def close(self) -> None:
        """Take back whatever is under way and hand every cache back (a driver that stops early)."""
        self._drop_step()
        self._unbatch()

    def _unbatch(self) -> None:
        if self.batch is not None:
            for b, s in enumerate(self.rows):
                split(self.batch, b, s.cache.target_cache)
            self.batch = None

    # ---- the target pass, for one row (its own cache) or a batch (lent caches) ----------------------

    def _verify(
        self, rows: list[Sequence], blocks: list[mx.array], solo: list[bool], trees: list
    ) -> mx.array:
        """The step's target pass(es) -> the shared pass's logits (rows holding trees masked as trees).
        A row verifying alone runs its own pass first (`self.solo[row]`: its views, logits, features and
        undo) and has only its pending token in the shared one, whose position there it does not keep."""
        if self.batch is None:
            (s,) = rows
            logits, self.features = s.cache.verify(blocks[0][None], trees=trees)
            return logits
        for s in rows:
            s.cache.broken = True
        self.solo = {}
        for b in (b for b, alone in enumerate(solo) if alone):
            views = [RowView(c, b) for c in self.batch]
            self.solo[b] = (views, *self.target.verify(blocks[b][None], views))
            blocks = blocks[:b] + [blocks[b][:1]] + blocks[b + 1 :]
        width = rows[0].policy.padded(max(b.size for b in blocks))
        tokens = mx.stack([mx.pad(b, (0, width - b.size)) for b in blocks])
        logits, self.features, self.undo = self.target.verify(tokens, self.batch, trees=trees)
        return logits

    def _build_plain(self, rows: list[Sequence], tokens: mx.array):
        """A plain step on (lazy) tokens, built but not run: (features, each row's next token, the
        logits row it is chosen from). Each row's token is its own array of the step: one sliced out
        later would queue behind whatever was launched since, and reading it would wait for that."""
        if self.batch is None:
            (s,) = rows
            logits, features = s.cache.verify(tokens.reshape(1, 1), unrun=True)
            processed = [s.processed(logits[0], [tokens])]
        else:
            for s in rows:
                s.cache.broken = True
            logits, features, self.undo = self.target.verify(tokens.reshape(-1, 1), self.batch, unrun=True)
            processed = [s.processed(logits[b], [tokens[b : b + 1]]) for b, s in enumerate(rows)]
        nexts = [s.pick_at(row, len(s.cache.tokens) + 1)[0] for s, row in zip(rows, processed)]
        return features, nexts, processed

    def _launch_built(self, features, nxt: list[mx.array]) -> None:
        if self.batch is None:
            self.step_rows[0].cache.launch(features, *nxt)
        else:
            self.undo.buffers = None  # (see Target.verify)
            mx.async_eval(features, *nxt)

    def _keep(self, rows: list[Sequence], keep: list[int], tokens=None, paths: dict | None = None) -> None:
        """Keep each row's first keep[b] positions of the pass under way (and commit its tokens); for
        a row that verified a tree, the positions of its accepted path (`paths[b]`)."""
        paths = paths or {}
        if self.batch is None:
            (s,) = rows
            s.cache.keep(self.features, keep[0], paths.get(0))
        else:
            self.target.rollback(
                self.batch, self.undo, [0 if b in self.solo else k for b, k in enumerate(keep)], paths
            )
            self.undo = None
            for b, s in enumerate(rows):
                if b in self.solo:
                    views, _, features, undo = self.solo[b]
                    self.target.rollback(views, undo, keep[b])
                else:
                    features = None if self.features is None else self.features[b : b + 1]
                s.cache.kept(features, keep[b], paths.get(b))
            self.solo = {}
        for s, t in zip(rows, tokens or []):
            s.cache.add(t)

    def _drop_step(self) -> None:
        """Take back the pass under way (a built step too) as a whole."""
        if self.batch is None:
            for s in self.step_rows:
                if s.cache.in_flight:
                    s.cache.cancel()
        elif self.undo is not None:
            self.target.rollback(self.batch, self.undo, [0] * len(self.step_rows))
            for views, _, _, undo in self.solo.values():
                self.target.rollback(views, undo, 0)
            self.undo, self.solo = None, {}
            for s in self.step_rows:
                s.cache.broken = False
        self.ready, self.started, self.step_rows = None, False, []


def _checked(row, vocab: int) -> mx.array:
    """What a logits processor returned, if it is logits like those it was given; else a clear error
    (MLX's own, from the concatenation or the sampler after it, names neither the processor nor what
    is wrong)."""
    if isinstance(row, mx.array) and row.shape == (1, vocab) and mx.issubdtype(row.dtype, mx.floating):
        return row
    got = (
        f"{str(row.dtype).split('.')[-1]} {tuple(row.shape)}"
        if isinstance(row, mx.array)
        else type(row).__name__
    )
    raise UserError(
        f"a logits processor must return an mx.array of logits shaped as it was given (1, {vocab}); "
        f"it returned {got}"
    )
