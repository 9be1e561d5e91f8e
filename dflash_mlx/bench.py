"""`dflash-mlx bench`: DFlash against plain decoding of the same target.

For every prompt, in turn: plain autoregressive decoding through mlx-lm (`mlx_lm.stream_generate`,
what a user would otherwise run), then DFlash at each fixed block size and with the adaptive policy
(block size None), at each temperature. The first prompt is
run once more beforehand as a warm-up and not counted. At temperature 0 every DFlash output must be
token for token the baseline's; a difference is reported as a failure, never averaged away.

With `fresh` (`run_fresh`), each prompt is answered in new processes instead, one for plain decoding
and one per policy, as `dflash-mlx generate` runs: what a first answer gives where a GPU compiles
kernels on first use, against a later one in the same process.

With `concurrency` (`run_concurrent`), many answers at once: for each number of sequences at a time,
all the prompts through mlx-lm's continuous batching (`BatchGenerator`, what `mlx_lm.server` runs) and
through our engine, the next prompt starting as soon as an answer ends; aggregate tokens per second
and time to first token, outputs checked equal at temperature 0.
"""

from __future__ import annotations

import functools
import importlib
import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
from mlx_lm import stream_generate as plain_stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from .chat import apply_chat_template
from .errors import UserError
from .files import atomic_file
from .loading import load, load_pair
from .pairing import context_room, prepare
from .platform import backend, ctrl_c_in_mlx, has_module, report
from .policy import batch_sizes, costs_for, warm_up
from .settings import GenerationSettings
from .speculative import stream_generate


def _plain(model, tokenizer, ids, max_tokens, temperature, seed):
    mx.random.seed(seed)
    mx.reset_peak_memory()  # each run's own peak, not loading's or an earlier run's
    tic, first, tokens = time.perf_counter(), None, []
    for r in plain_stream_generate(
        model, tokenizer, ids, max_tokens=max_tokens, sampler=make_sampler(temperature)
    ):
        first = first or time.perf_counter()
        tokens.append(r.token)
    end = time.perf_counter()
    return _record(tokens, tic, first, end, [])


def _dflash(target, draft, tokenizer, ids, settings: GenerationSettings, seed: int):
    # Seeded here rather than through `seed=`, whose answers accept only proposals equal to draws keyed
    # by position (for a repeatable answer): the bench measures what answers without seeds get.
    mx.random.seed(seed)
    mx.reset_peak_memory()
    tic, first, tokens, acc, mix = time.perf_counter(), None, [], [], Counter()
    for r in stream_generate(target, draft, tokenizer, ids, **asdict(settings)):
        first = first or time.perf_counter()
        tokens += r.tokens
        if r.accepted is not None:
            acc.append(r.accepted)
            mix[r.source] += 1
    end = time.perf_counter()
    return dict(_record(tokens, tic, first, end, acc), mix=dict(mix))


def first_difference(model, ids: list[int], plain: list[int], ours: list[int]) -> dict | None:
    """Where `ours` first leaves `plain` (greedy decoding), and the target's top-2 logit gap there, from
    one pass over the prompt and the tokens both share: a gap near 0 is a near-tie that floating
    point can flip (a many-token pass and a one-token step round differently); a wide one, a wrong
    token. None where they are the same."""
    if plain == ours:
        return None
    at = next((i for i, (a, b) in enumerate(zip(plain, ours)) if a != b), min(len(plain), len(ours)))
    logits = model(mx.array([list(ids) + plain[:at]]), cache=make_prompt_cache(model))[0, -1]
    top = mx.sort(logits.astype(mx.float32))[-2:]
    return {"at": at, "gap": (top[1] - top[0]).item()}


def _compare(model, ids: list[int], plain: list[int], r: dict) -> None:
    """Mark a greedy run `r` identical to plain decoding's tokens or not (and where it left them)."""
    r["identical"] = r["tokens"] == plain
    if not r["identical"]:
        r["first_difference"] = first_difference(model, ids, plain, r["tokens"])


def _record(tokens, tic, first, end, acc):
    decode = end - first
    return {
        "tokens": tokens,
        "n": len(tokens),
        "ttft_s": first - tic,
        "total_s": end - tic,
        "decode_tps": (len(tokens) - 1) / decode if decode > 0 and len(tokens) > 1 else 0.0,
        "e2e_tps": len(tokens) / (end - tic),
        "acceptance": acc,
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
    }


def run_name(policy, temperature: float) -> str:
    """A run's key in a prompt's "dflash" record, e.g. "16@0.0" or "adaptive@1.0"."""
    return f"{policy or 'adaptive'}@{temperature}"


def settings_grid(block_sizes, temperatures, max_tokens: int, lookup: bool = True, draft_window=None) -> dict:
    """{(policy, temperature): its settings}, checked before anything runs, where a policy is a fixed
    block size, "treeN" (every cycle a tree in a pass of N) or None (the adaptive policy); each
    setting once (a repeated one would be run again and overwrite its own record)."""
    sizes = dict.fromkeys(b if b is None or str(b).startswith("tree") else int(b) for b in block_sizes)
    return {
        (b, t): GenerationSettings.answers(
            temperature=t,
            block_size=b if isinstance(b, int) else None,
            tree=int(b[4:]) if isinstance(b, str) else None,
            lookup=lookup,
            max_tokens=max_tokens,
            draft_window=draft_window,
        )
        for t in dict.fromkeys(float(t) for t in temperatures)
        for b in sizes
    }


def run_bench(
    model,
    draft,
    tokenizer,
    prompts: list[list[dict]],
    *,
    block_sizes=(16, None),
    lookup: bool = True,
    draft_window: int | None = None,
    temperatures=(0.0,),
    max_tokens: int = 256,
    seed: int = 0,
    template_kwargs: dict | None = None,
    progress: Callable[[int, int], None] | None = None,
    rounds: int = 1,
) -> dict:
    """-> results: per prompt and configuration, a summary per configuration, and the machine.
    `template_kwargs` reach the chat template (e.g. enable_thinking=False). With several `rounds`, every
    prompt is run that many times (all prompts, then all again) and a speedup is the median of the
    rounds' own: on a shared machine one busy moment then moves it little."""
    grid = settings_grid(block_sizes, temperatures, max_tokens, lookup, draft_window)
    temperatures, configs = list(dict.fromkeys(t for _, t in grid)), list(grid)
    target = prepare(model, draft)
    encoded = _encode(target, tokenizer, prompts, template_kwargs, max_tokens)
    if rounds < 1:
        raise UserError(f"rounds must be 1 or more, got {rounds}")
    per_prompt = []
    total = rounds * len(encoded) * (len(temperatures) + len(configs))
    done, interrupted = 0, False

    def counted():
        nonlocal done
        if n > 0:
            done += 1
            if progress:
                progress(done, total)

    try:
        with ctrl_c_in_mlx():
            order = [(0, 0)] + [(r, k) for r in range(rounds) for k in range(len(encoded))]
            for n, (rnd, k) in enumerate(order):  # the first pass over prompt 0 is the warm-up
                if n == 1 and progress:
                    progress(0, total)  # the warm-up is over
                ids = encoded[k]
                row = {"prompt": k, "round": rnd, "prompt_tokens": len(ids), "baseline": {}, "dflash": {}}
                for t in temperatures:
                    row["baseline"][str(t)] = _plain(model, tokenizer, ids, max_tokens, t, seed)
                    counted()
                for b, t in configs:
                    r = _dflash(target, draft, tokenizer, ids, grid[b, t], seed)
                    if t == 0:
                        _compare(model, ids, row["baseline"][str(t)]["tokens"], r)
                    row["dflash"][run_name(b, t)] = r
                    counted()
                if n > 0:
                    per_prompt.append(row)
    except KeyboardInterrupt:
        if not per_prompt:
            raise
        interrupted = True  # the prompts finished so far are summarised; the one under way is not
    return {
        "machine": report()["facts"],
        "max_tokens": max_tokens,
        "rounds": rounds,
        "summary": _summaries(configs, per_prompt),
        "prompts": per_prompt,
        "interrupted": interrupted,
    }


def _encode(target, tokenizer, prompts, template_kwargs, max_tokens: int) -> list[list[int]]:
    """The prompts as token ids through the chat template, each leaving room for max_tokens."""
    encoded = [apply_chat_template(tokenizer, p, **(template_kwargs or {})) for p in prompts]
    if not encoded:
        raise UserError("no prompts to benchmark")
    for k, ids in enumerate(encoded):
        try:
            room = context_room(target, len(ids))
        except UserError as e:
            raise UserError(f"prompt {k}: {e}") from None
        if room < max_tokens:
            raise UserError(
                f"prompt {k} ({len(ids)} tokens) leaves less than max_tokens {max_tokens} of the "
                f"model's context: lower --max-tokens"
            )
    return encoded


def _summaries(configs: list, per_prompt: list[dict]) -> list[dict]:
    """One summary per configuration over the prompts' runs."""
    summary = []
    for b, t in configs:
        base = [p["baseline"][str(t)] for p in per_prompt]
        ours = [p["dflash"][run_name(b, t)] for p in per_prompt]
        acc = [a for r in ours for a in r["acceptance"]]
        summary.append(
            {
                "block_size": b,
                "temperature": t,
                "prompts": len({p["prompt"] for p in per_prompt}),
                "tokens": sum(r["n"] for r in ours),
                "baseline_tokens": sum(r["n"] for r in base),
                "baseline_decode_tps": _rate(base, "decode"),
                "dflash_decode_tps": _rate(ours, "decode"),
                "baseline_e2e_tps": _rate(base, "e2e"),
                "dflash_e2e_tps": _rate(ours, "e2e"),
                # None when there was nothing to compare: no decode phase (answers of one token), no cycle
                **_speedups(per_prompt, base, ours),
                "tau": sum(acc) / len(acc) if acc else None,
                "tau_histogram": dict(sorted(Counter(acc).items())),
                "ttft_s": sum(r["ttft_s"] for r in ours) / len(ours),
                "baseline_ttft_s": sum(r["ttft_s"] for r in base) / len(base),
                "peak_memory_gb": max(r["peak_memory_gb"] for r in ours),
                "identical": all(r.get("identical", True) for r in ours) if t == 0 else None,
                "mismatched_prompts": sorted(
                    {p["prompt"] for p, r in zip(per_prompt, ours) if r.get("identical") is False}
                ),
                "differences": [
                    dict(prompt=p["prompt"], **r["first_difference"])
                    for p, r in zip(per_prompt, ours)
                    if r.get("first_difference")
                ],
                "mix": dict(sum((Counter(r["mix"]) for r in ours), Counter())),
            }
        )
    return summary


def run_fresh(
    names: tuple[str, str | None],
    model,
    draft,
    tokenizer,
    prompts: list[list[dict]],
    *,
    block_sizes=(None,),
    lookup: bool = True,
    draft_window: int | None = None,
    max_tokens: int = 256,
    answers: int = 3,
    seed: int = 0,
    template_kwargs: dict | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Each prompt answered (temperature 0) by plain decoding and by each policy, each in a new process
    of its own that does what `dflash-mlx generate` does: load the pair (`names`: target and drafter, as
    `load_pair` takes them), warm up on a GPU, answer; then answers the same prompt `answers - 1` times
    more. -> results as `run_bench`'s for the first answers (what a fresh process gives; where MLX
    compiles kernels on first use, it pays for that), and as "warm_summary" for the last ones. Costs
    are measured here first where they are not yet (a one-time cost that no answer should carry);
    processes after the first read the kernels the earlier ones compiled, as a user's next run does."""
    if answers < 1:
        raise UserError(f"answers must be 1 or more, got {answers}")
    grid = settings_grid(block_sizes, [0.0], max_tokens, lookup, draft_window)
    configs = list(grid)
    target = prepare(model, draft)
    encoded = _encode(target, tokenizer, prompts, template_kwargs, max_tokens)
    if any(b is None for b, _ in configs):
        costs_for(target, draft)
    first, last, interrupted = [], [], False
    total = len(encoded) * (1 + len(configs))
    if progress:
        progress(0, total)
    try:
        with ctrl_c_in_mlx():
            for k, ids in enumerate(encoded):
                job = dict(names=names, ids=ids, max_tokens=max_tokens, answers=answers, seed=seed)
                rows = [
                    {"prompt": k, "round": 0, "answer": a + 1, "prompt_tokens": len(ids)}
                    for a in (0, answers - 1)
                ]
                for row, r in zip(rows, _in_new_process(dict(job, settings=None))):
                    row.update(baseline={"0.0": r}, dflash={})
                if progress:
                    progress(k * (1 + len(configs)) + 1, total)
                for n, (b, t) in enumerate(configs):
                    runs = _in_new_process(dict(job, settings=asdict(grid[b, t])))
                    for row, r in zip(rows, runs):
                        _compare(model, ids, row["baseline"]["0.0"]["tokens"], r)
                        row["dflash"][run_name(b, t)] = r
                    if progress:
                        progress(k * (1 + len(configs)) + 2 + n, total)
                first.append(rows[0])
                last.append(rows[1])
    except KeyboardInterrupt:
        if not first:
            raise
        interrupted = True  # the prompts finished so far are summarised
    summaries, kept = {}, [("summary", first)] + ([("warm_summary", last)] if answers > 1 else [])
    for name, rows in kept:
        summaries[name] = _summaries(configs, rows)
        for (b, t), s in zip(configs, summaries[name]):
            s["startup_s"] = statistics.mean(row["dflash"][run_name(b, t)]["startup_s"] for row in rows)
            s["baseline_startup_s"] = statistics.mean(row["baseline"]["0.0"]["startup_s"] for row in rows)
    return {
        "machine": report()["facts"],
        "max_tokens": max_tokens,
        "rounds": 1,
        "fresh": answers,
        **summaries,
        "prompts": [row for _, rows in kept for row in rows],
        "interrupted": interrupted,
    }


def _in_new_process(job: dict) -> list[dict]:
    """`answer_fresh(job)` run by a new Python process: -> its first and last answers' records, each
    with `startup_s`, the seconds from starting the process to its first answer."""
    job = dict(job, started=time.time())
    done = subprocess.run(
        [sys.executable, "-c", "import dflash_mlx.bench as b; b.answer_fresh()"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        if done.returncode == -signal.SIGINT:
            raise KeyboardInterrupt
        raise RuntimeError(f"a fresh process failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def answer_fresh() -> None:
    """A new process's part of `run_fresh`: the job on stdin, the first and last answers' records as
    one JSON line on stdout."""
    job = json.loads(sys.stdin.read())
    target_name, draft_name = job["names"]
    if job["settings"] is None:  # plain decoding
        model, tokenizer = load(target_name)
        answer = lambda: _plain(model, tokenizer, job["ids"], job["max_tokens"], 0.0, job["seed"])  # noqa: E731
    else:
        settings = GenerationSettings(**job["settings"])
        model, draft, tokenizer = load_pair(target_name, draft_name)
        if backend() != "cpu":  # (as `generate` does: see cli/options.warm)
            warm_up(model, draft)
        answer = lambda: _dflash(model, draft, tokenizer, job["ids"], settings, job["seed"])  # noqa: E731
    startup = time.time() - job["started"]
    records = [answer() for _ in range(job["answers"])]
    records[0]["startup_s"] = startup
    records[-1]["startup_s"] = startup
    print(json.dumps([records[0], records[-1]]))


def run_concurrent(
    model,
    draft,
    tokenizer,
    prompts: list[list[dict]],
    *,
    concurrency=(1, 2, 4, 8),
    workers: int = 1,
    processes: int = 1,
    names: tuple[str, str | None] | None = None,
    max_tokens: int = 256,
    lookup: bool = True,
    draft_window: int | None = None,
    template_kwargs: dict | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """-> results: per number of sequences at a time, mlx-lm's batched plain decoding and `serve`'s
    `workers` in each of its `processes` (the others loading the pair by `names`; adaptive policy,
    temperature 0) over all the prompts, submitted together."""
    served = functools.partial(_served, workers=workers, processes=processes, names=names)
    settings = GenerationSettings(max_tokens=max_tokens, lookup=lookup, draft_window=draft_window)
    levels = list(dict.fromkeys(int(c) for c in concurrency))
    if not levels or min(levels) < 1:
        raise UserError(f"--concurrency takes numbers of sequences of 1 or more, got {concurrency}")
    target = prepare(model, draft)
    encoded = [apply_chat_template(tokenizer, p, **(template_kwargs or {})) for p in prompts]
    if not encoded:
        raise UserError("no prompts to benchmark")
    for k, ids in enumerate(encoded):
        if context_room(target, len(ids)) < max_tokens:
            raise UserError(f"prompt {k} ({len(ids)} tokens) leaves less than max_tokens {max_tokens}")
    eos = frozenset(tokenizer.eos_token_ids)
    costs_for(target, draft, batches=batch_sizes(max(levels)))  # priced as `serve` prices them
    _batched_plain(model, encoded[:1], 1, max_tokens, eos)  # warm-ups, not counted
    served(model, draft, tokenizer, encoded[:1], 1, settings)
    rows, interrupted = [], False
    for c in levels:
        try:
            with ctrl_c_in_mlx():
                base = _batched_plain(model, encoded, c, max_tokens, eos)
                ours = served(model, draft, tokenizer, encoded, c, settings)
        except KeyboardInterrupt:
            if not rows:
                raise
            interrupted = True  # the levels finished so far are summarised
            break
        mismatched = [k for k, (a, b) in enumerate(zip(base["tokens"], ours["tokens"])) if a != b]
        rows.append(
            {
                "concurrency": c,
                "prompts": len(encoded),
                "tokens": ours["n"],
                "baseline_tps": base["tps"],
                "dflash_tps": ours["tps"],
                "speedup": _ratio(ours["tps"], base["tps"]),
                "baseline_ttft_s": base["ttft_s"],
                "ttft_s": ours["ttft_s"],
                "identical": not mismatched,
                "mismatched_prompts": mismatched,
                "mix": ours["mix"],
                "plain_steps": ours["plain_steps"],
                "steps": ours["steps"],
                "workers": ours["workers"],
                "processes": ours["processes"],
            }
        )
        if progress:
            progress(len(rows), len(levels))
    return {
        "machine": report()["facts"],
        "max_tokens": max_tokens,
        "lookup": lookup,
        "draft_window": draft_window,
        "concurrency": rows,
        "interrupted": interrupted,
    }


def _batched_plain(model, encoded, c: int, max_tokens: int, eos) -> dict:
    """All prompts through mlx-lm's BatchGenerator, c sequences at a time, greedy."""
    batch_generator = importlib.import_module("mlx_lm.generate").BatchGenerator
    gen = batch_generator(
        model,
        max_tokens=max_tokens,
        stop_tokens=[[t] for t in eos],
        completion_batch_size=c,
        prefill_batch_size=c,
    )
    tic = time.perf_counter()
    uids = gen.insert(encoded, [max_tokens] * len(encoded))
    tokens, firsts, left = {u: [] for u in uids}, {}, set(uids)
    while left:
        for r in gen.next_generated():
            tokens[r.uid].append(r.token)
            firsts.setdefault(r.uid, time.perf_counter() - tic)
            if r.finish_reason is not None:
                left.discard(r.uid)
    seconds = time.perf_counter() - tic
    gen.close()
    out = [tokens[u] for u in uids]
    n = sum(map(len, out))
    return {"tokens": out, "n": n, "tps": n / seconds, "ttft_s": sum(firsts.values()) / len(firsts)}


def _served(
    model, draft, tokenizer, encoded, c: int, settings: GenerationSettings, workers, processes, names
) -> dict:
    """All prompts through `serve`'s workers and engines (its scheduler, without HTTP), c requests at a
    time (the next one starting when one ends); worker processes start before the clock does."""
    from .server.metrics import Metrics
    from .server.pool import PromptCachePool
    from .server.processes import scheduler_for
    from .server.scheduler import Finished, Request

    metrics, lock = Metrics(), threading.Lock()
    pool = PromptCachePool(model, draft, 0, settings.draft_window)  # (nothing kept: each level starts anew)
    scheduler = scheduler_for(
        model, draft, tokenizer, pool, metrics, c, len(encoded), workers, processes, names
    )
    tokens, firsts, errors, mix = {k: [] for k in range(len(encoded))}, {}, [], Counter()
    scheduler.start()
    tic = time.perf_counter()

    def emit(event, k):
        with lock:
            if isinstance(event, Finished):
                errors.append(event.error)
            elif getattr(event, "tokens", None) is not None:
                firsts.setdefault(k, time.perf_counter() - tic)
                tokens[k] += event.tokens
                if event.source is not None:  # (None: the first token, from the prompt's pass)
                    mix[event.source] += 1

    try:
        for k, ids in enumerate(encoded):
            scheduler.admit()
            scheduler.submit(Request(ids, settings, [], lambda e, k=k: emit(e, k)))
        while len(errors) < len(encoded):
            time.sleep(0.005)
        seconds = time.perf_counter() - tic
        steps = {
            kind: metrics.total("dflash_mlx_steps_total", kind=kind) for kind in ("plain", "speculative")
        }
    finally:
        scheduler.stop()
    if failed := next((e for e in errors if e is not None), None):
        raise failed
    out = [tokens[k] for k in range(len(encoded))]
    n = sum(map(len, out))
    return {
        "tokens": out,
        "n": n,
        "tps": n / seconds,
        "ttft_s": sum(firsts.values()) / len(firsts),
        "mix": dict(mix),
        "steps": int(sum(steps.values())),
        "plain_steps": int(steps["plain"]),
        "workers": len(scheduler.local),  # (in each process)
        "processes": 1 + len(scheduler.remotes),
    }


def _rate(records, kind):
    """Tokens per second over all prompts together (a ratio of sums, not a mean of ratios)."""
    if kind == "decode":
        return sum(r["n"] - 1 for r in records) / max(sum(r["total_s"] - r["ttft_s"] for r in records), 1e-9)
    return sum(r["n"] for r in records) / max(sum(r["total_s"] for r in records), 1e-9)


def _speedups(rows: list[dict], base: list[dict], ours: list[dict]) -> dict:
    """Each round's speedups (decode, end to end) and, as "speedup_decode" and "speedup_e2e", their
    medians."""
    rounds = [
        [j for j, row in enumerate(rows) if row["round"] == r] for r in sorted({row["round"] for row in rows})
    ]
    out = {}
    for kind in ("decode", "e2e"):
        by_round = [
            _ratio(_rate([ours[j] for j in pick], kind), _rate([base[j] for j in pick], kind))
            for pick in rounds
        ]
        known = [x for x in by_round if x is not None]
        out[f"speedup_{kind}"] = statistics.median(known) if known else None
        out[f"speedup_{kind}_rounds"] = by_round
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if a > 0 and b > 0 else None


def _fmt(x: float | None, spec: str, unit: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{unit}"


def _speedup(summary: dict, kind: str) -> str:
    """A speedup cell: the median, with the rounds' range where there were several."""
    cell = _fmt(summary[f"speedup_{kind}"], ".2f", "x")
    rounds = [x for x in summary.get(f"speedup_{kind}_rounds", []) if x is not None]
    return f"{cell} ({min(rounds):.2f}-{max(rounds):.2f})" if len(rounds) > 1 else cell


def counted(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def policy_name(policy: int | str | None) -> str:
    """A policy of `settings_grid` in words."""
    if policy is None:
        return "adaptive"
    return f"tree {policy[4:]}" if isinstance(policy, str) else f"block {policy}"


def markdown(results: dict, title: str) -> str:
    if "concurrency" in results:
        return markdown_concurrent(results, title)
    m = results["machine"]
    stopped = " (stopped early: the prompts finished by then)" if results.get("interrupted") else ""
    n = results.get("rounds", 1)
    rounds = f", {n} rounds (a speedup: the rounds' median, and their range)" if n > 1 else ""
    answers = results.get("fresh")
    how = (
        "; plain decoding and each policy in a new process of their own per prompt (loading, a warm-up "
        "on a GPU, then the answer)"
        + (f", which then answers it {counted(answers - 1, 'time')} more" if answers > 1 else "")
        if answers
        else "; warm-up excluded"
    )
    lines = [
        f"# {title}",
        "",
        f"Machine: {m.get('platform')}, MLX {m.get('mlx')} on {m.get('mlx backend')}, "
        f"BLAS: {m.get('blas preload')}. {counted(results['summary'][0]['prompts'], 'prompt')}, up to "
        f"{results['max_tokens']} tokens each{rounds}{how}{stopped}.",
        "",
    ]
    if not answers:
        return "\n".join(lines + _table(results["summary"])) + "\n"
    starts = ", ".join(f"{policy_name(s['block_size'])} {s['startup_s']:.1f} s" for s in results["summary"])
    lines += ["## The first answer in a fresh process", "", *_table(results["summary"]), ""]
    lines += [
        f"From starting the process to the answer's start (imports, loading, warm-up): plain decoding "
        f"{results['summary'][0]['baseline_startup_s']:.1f} s, {starts}.",
        "",
    ]
    if answers > 1:
        lines += [f"## Answer {answers} in the same process", "", *_table(results["warm_summary"])]
    return "\n".join(lines) + "\n"


def _table(summaries: list[dict]) -> list[str]:
    lines = [
        "| policy | temp | tau | plain tok/s | ours tok/s | speedup (decode) | speedup (end to end) "
        "| TTFT plain / ours (s) | cycles: dflash / tree / lookup / plain | identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        first = min(s.get("differences", []), key=lambda d: d["gap"], default=None)
        where = f"; the nearest tie: token {first['at']}, top-2 gap {first['gap']:.2g}" if first else ""
        same = {
            True: "yes",
            False: f"**NO** ({counted(len(s['mismatched_prompts']), 'prompt')}{where})",
            None: "n/a (sampling)",
        }
        mix = " / ".join(str(s["mix"].get(k, 0)) for k in ("dflash", "tree", "lookup", "plain"))
        lines.append(
            f"| {policy_name(s['block_size'])} | {s['temperature']} | {_fmt(s['tau'], '.2f')} | "
            f"{s['baseline_decode_tps']:.1f} | {s['dflash_decode_tps']:.1f} | "
            f"{_speedup(s, 'decode')} | {_speedup(s, 'e2e')} | "
            f"{s['baseline_ttft_s']:.2f} / {s['ttft_s']:.2f} | {mix} | {same[s['identical']]} |"
        )
    return lines


def markdown_concurrent(results: dict, title: str) -> str:
    m, rows = results["machine"], results["concurrency"]
    policy = "the adaptive policy" + "".join(
        [
            "" if results.get("lookup", True) else " without lookup",
            f", a draft window of {results['draft_window']}" if results.get("draft_window") else "",
        ]
    )
    lines = [
        f"# {title}",
        "",
        f"Machine: {m.get('platform')}, MLX {m.get('mlx')} on {m.get('mlx backend')}, "
        f"BLAS: {m.get('blas preload')}. {counted(rows[0]['prompts'], 'prompt')} submitted together, up to "
        f"{results['max_tokens']} tokens each, temperature 0; mlx-lm's continuous batching (BatchGenerator) "
        f"against `serve`'s workers and engines with {policy}, the same number of sequences at a time.",
        "",
        "| sequences at a time | mlx-lm tok/s | ours tok/s | ratio | TTFT mlx-lm / ours (s) "
        "| our workers | cycles: dflash / lookup / plain | steps all plain | identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mix = " / ".join(str(r["mix"].get(k, 0)) for k in ("dflash", "lookup", "plain"))
        same = "yes" if r["identical"] else f"**NO** ({counted(len(r['mismatched_prompts']), 'prompt')})"
        lines.append(
            f"| {r['concurrency']} | {r['baseline_tps']:.1f} | {r['dflash_tps']:.1f} | "
            f"{_fmt(r['speedup'], '.2f', 'x')} | {r['baseline_ttft_s']:.2f} / {r['ttft_s']:.2f} | "
            f"{_workers(r)} | {mix} | "
            f"{r['plain_steps']} of {r['steps']} | {same} |"
        )
    return "\n".join(lines) + "\n"


def _workers(row: dict) -> str:
    workers, processes = row.get("workers", 1), row.get("processes", 1)
    return str(workers) if processes == 1 else f"{workers} in each of {processes} processes"


def plot(results: dict, path: Path) -> None:
    import matplotlib  # optional bench extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = results["summary"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    labels = [f"{policy_name(x['block_size'])}\nT={x['temperature']}" for x in s]
    axes[0].bar(labels, [x["speedup_decode"] or 0 for x in s], color="tab:blue")
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].set_title("speedup over plain decoding (decode)")
    axes[1].bar(labels, [x["tau"] or 0 for x in s], color="tab:green")
    axes[1].set_title("mean acceptance length tau")
    width = 0.8 / max(len(s), 1)
    for k, x in enumerate(s):
        h = {int(a): n for a, n in x["tau_histogram"].items()}
        total = sum(h.values()) or 1
        axes[2].bar(
            [a + (k - (len(s) - 1) / 2) * width for a in h],
            [n / total for n in h.values()],
            width,
            label=f"{policy_name(x['block_size'])} T={x['temperature']}",
        )
    axes[2].set_title("tokens per cycle (share of cycles)")
    axes[2].set_xlabel("tokens committed in one cycle")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def write(results: dict, out: Path, title: str) -> list[Path]:
    """results.json, summary.md and plot.png in `out`. All three are made beside their destinations first
    and only then swapped in, so a failure or Ctrl-C while writing (or plotting) leaves the earlier run's
    files as they were, never one run's results beside another run's plot; a plot of an earlier run is
    removed when there is no matplotlib to draw this one."""
    out.mkdir(parents=True, exist_ok=True)
    slim = json.loads(json.dumps(results))
    for p in slim.get("prompts", []):  # keep files small: drop token lists, keep counts
        for group in (p["baseline"], p["dflash"]):  # ("dflash": every policy's runs, fixed or adaptive)
            for r in group.values():
                r.pop("tokens", None)
    plotted = has_matplotlib() and "prompts" in results  # (a plot per policy, not per concurrency)
    paths = [out / "results.json", out / "summary.md"] + ([out / "plot.png"] if plotted else [])
    with ExitStack() as stack:  # the swaps happen together as the stack closes, after everything is made
        tmps = [stack.enter_context(atomic_file(p)) for p in paths]
        tmps[0].write_text(json.dumps(slim, indent=1))
        tmps[1].write_text(markdown(results, title))
        if len(tmps) == 3:
            plot(results, tmps[2])
        else:
            (out / "plot.png").unlink(missing_ok=True)
    return paths


def has_matplotlib() -> bool:
    """The plot is optional: matplotlib comes with the `bench` extra, not the base install."""
    return has_module("matplotlib")
