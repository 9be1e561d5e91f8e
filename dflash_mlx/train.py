"""`dflash-mlx train`: train a DFlash drafter for an mlx-lm target (the paper's recipe, section 4).

* The target is frozen. Its hidden states at `target_layer_ids` are computed in the training pass
  (kept in RAM as float16 after the first time a sequence is seen, up to `feature_cache_gb`, so later
  epochs skip the target for those sequences).
* The drafter shares the target's embedding and lm_head, frozen; only the drafter's own weights train.
* Each step takes `batch_size` sequences (prompt + the target's own response, from `dflash-mlx train
  data`; in epochs: each sequence once, in random order, before any repeats) and `anchors` random
  positions in each response. Each anchor starts a block [token, MASK x B-1]
  whose labels are the next B-1 tokens. All blocks go through the drafter in one pass, each as its
  own batch row, seeing its own sequence's context features strictly before its anchor and its own
  block (bidirectionally), never another block: exactly what it sees when drafting for real.
  Sequences of a step are right-padded to one length (causal attention: padding is never seen), and
  a step may run as several passes whose gradients add up (`micro_batch`), for memory.
* Precision "bf16" runs the drafter's forward and backward in bfloat16 and keeps float32 master
  weights and optimizer state; the loss's softmax is float32 either way.
* Loss: cross-entropy on block positions k = 1..B-1 weighted by exp(-(k-1)/gamma), normalised by
  the step's weight sum (every block token of the step counts the same); AdamW, linear warm-up then
  cosine decay, gradient clipping.
* `vocab="data"` (not the paper's; EAGLE-3 drafts over a reduced vocabulary too) takes the loss's
  softmax over only the tokens the training answers contain instead of the whole vocabulary: every
  label is among them, and a large vocabulary is mostly tokens that never occur. The drafter still
  drafts over the whole vocabulary, and the held-out estimate scores it that way.

* Target features are standardised for `fc` (not in the paper; a reparameterisation, so the drafter
  is unchanged): a target's tapped layers and dimensions differ in scale by orders of magnitude, and
  with Adam a weight's effect on the output grows with its input's scale, so the large dimensions
  drown the small ones' learning.
  Training keeps fc as W' = W * s over features / s (s: each dimension's RMS); checkpoints hold W.

Checkpoints (weights, optimizer state, step) are written atomically every `checkpoint_every` steps
and when a stop is asked for (Ctrl-C in the CLI); a run restarted with the same output folder resumes
from the last one. The data order and anchors of
step s depend only on (seed, s), so a resumed run follows the same curve.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from .errors import UserError
from .files import atomic_folder
from .loading import read_config
from .models.dflash import DFlashConfig, DFlashDraftModel, default_target_layer_ids
from .models.targets import Target
from .pairing import check_block_size, check_pair, prepare
from .platform import backend, machine_memory

GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # the paper's loss decay per block size


@dataclass
class TrainConfig:
    block_size: int = 16
    num_layers: int = 2
    intermediate_size: int | None = None  # the drafter's MLP width; default: the target's
    target_layer_ids: list[int] | None = None  # default: the paper's spread over the target
    mask_token_id: int | None = None  # default: the tokenizer's mask token, else an unused special
    anchors: int = 64  # blocks per sequence and step (more amortise each step's fixed cost)
    batch_size: int = 1  # sequences per step
    micro_batch: int | None = None  # sequences per pass (gradients add up); default: all (GPU), 1 (CPU)
    precision: str = "float32"  # the drafter's compute: "float32" or "bf16" (float32 master weights)
    steps: int = 2000
    lr: float = 6e-4
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None
    seed: int = 0
    checkpoint_every: int = 100
    eval_every: int = 0  # 0: only at the end
    holdout: int = 16  # sequences kept out of training for the offline acceptance estimate
    max_seq_len: int = 1024
    vocab: str = "full"  # the loss's softmax over the "full" vocabulary, or the tokens the "data" uses
    history: list = field(default_factory=list)

    def __post_init__(self):
        for name in ("steps", "anchors", "checkpoint_every", "batch_size"):
            if getattr(self, name) < 1:
                raise UserError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("warmup", "eval_every"):
            if getattr(self, name) < 0:
                raise UserError(f"{name.replace('_', '-')} cannot be negative, got {getattr(self, name)}")
        if not 0 < self.lr < math.inf:
            raise UserError(f"the learning rate must be a positive number, got {self.lr}")
        for name in ("weight_decay", "grad_clip"):
            if not 0 <= getattr(self, name) < math.inf:
                raise UserError(f"{name.replace('_', '-')} must be a number >= 0, got {getattr(self, name)}")
        if self.gamma is not None and not 0 < self.gamma < math.inf:
            raise UserError(f"gamma must be a positive number, got {self.gamma}")
        if self.micro_batch is not None and not 1 <= self.micro_batch <= self.batch_size:
            raise UserError(
                f"micro-batch must be from 1 to the batch size, {self.batch_size}, got {self.micro_batch}"
            )
        if self.precision not in ("float32", "bf16"):
            raise UserError(f"precision must be 'float32' or 'bf16', got {self.precision!r}")

    def loss_gamma(self) -> float:
        return self.gamma or GAMMA.get(self.block_size, 0.44 * self.block_size)


def drafter_config(target: Target, tokenizer, cfg: TrainConfig) -> DFlashConfig:
    """A drafter as wide as the target (it reads the target's embeddings and feeds its lm_head), with
    the target's attention geometry and RoPE; its depth and MLP width are the run's choice."""
    check_block_size(cfg.block_size, least=2)
    for name in ("num_layers", "intermediate_size"):
        if (value := getattr(cfg, name)) is not None and value < 1:
            raise UserError(f"{name} must be at least 1, got {value}")
    a = target.args
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else pick_mask_token(tokenizer)
    return DFlashConfig(
        hidden_size=a.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=a.num_attention_heads,
        num_key_value_heads=getattr(a, "num_key_value_heads", None) or a.num_attention_heads,
        head_dim=getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads,
        intermediate_size=cfg.intermediate_size or a.intermediate_size or a.block_ff_dim,
        vocab_size=a.vocab_size,
        target_layer_ids=cfg.target_layer_ids or default_target_layer_ids(target.num_layers, cfg.num_layers),
        mask_token_id=mask,
        block_size=cfg.block_size,
        num_target_layers=target.num_layers,
        rms_norm_eps=target.norm_eps,
        rope_theta=float(getattr(a, "rope_theta", 10000.0)),
        rope_scaling=getattr(a, "rope_scaling", None),
        max_position_embeddings=getattr(a, "max_position_embeddings", None) or 32768,
    )


def check_new_drafter(target: Target, tokenizer, cfg: TrainConfig) -> DFlashDraftModel:
    """A new drafter of the run's architecture for `target` (its weights drawn, not yet computed), refused
    where it cannot train here or cannot pair with the target (layers tapped, mask token)."""
    draft = DFlashDraftModel(drafter_config(target, tokenizer, cfg))
    check_fits(draft)
    check_pair(Target(target.model, draft.config.target_layer_ids), draft)
    return draft


def check_fits(draft: DFlashDraftModel) -> None:
    """A new drafter too big to train here (a mistyped --layers): one line now, before its weights are
    made, not the machine's memory running out later. Training holds each weight four times in float32:
    itself, its gradient and Adam's two moments."""
    n = sum(v.size for _, v in tree_flatten(draft.parameters()))  # (shapes only: nothing made yet)
    need, memory = 16 * n, machine_memory()
    if need > memory / 2:
        c = draft.config
        raise UserError(
            f"a drafter of {c.num_hidden_layers} layers and MLP width {c.intermediate_size} "
            f"({n / 1e6:,.0f}M weights) needs about {need / 2**30:.0f} GiB to train, more than half "
            f"this machine's {memory / 2**30:.0f}: give fewer --layers or a smaller --intermediate-size"
        )


def pick_mask_token(tokenizer) -> int:
    """The tokenizer's mask token, else the last special token that is not BOS/EOS/PAD/UNK."""
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return tokenizer.mask_token_id
    taken = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    specials = [i for i, t in added.items() if getattr(t, "special", False)]
    specials = [i for i in specials + list(getattr(tokenizer, "all_special_ids", [])) if i not in taken]
    if not specials:
        raise UserError("the tokenizer has no spare special token to use as the mask: pass --mask-token-id")
    return max(specials)


def block_logits(
    draft: DFlashDraftModel,
    target: Target,
    features: mx.array,
    tokens: mx.array,
    anchors: mx.array,
    head: mx.array | None = None,
    rows: mx.array | None = None,
) -> mx.array:
    """Drafter logits (N, B-1, vocab) for blocks anchored at `anchors`.

    The same `denoise` as inference, with one block per batch row and ctx_len = its anchor. One
    sequence: features (1, L, F), tokens (L,). A batch of S right-padded sequences: features (S, L, F),
    tokens (S, L) and `rows`, each block's sequence. `head`: lm_head rows of a vocabulary subset to
    score instead of the whole vocabulary.
    """
    B = draft.block_size
    ctx = draft.context(features.astype(draft.dtype))
    n = anchors.shape[0]
    tokens = tokens.reshape(-1, tokens.shape[-1])

    counts = [n] if rows is None else np.bincount(np.array(rows), minlength=features.shape[0]).tolist()

    def per_block(x):  # each block's context keys or values: its own sequence's (rows are in order)
        parts = [mx.broadcast_to(x[s : s + 1], (c, *x.shape[1:])) for s, c in enumerate(counts) if c]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)

    keys, values = [], []
    for layer in draft.layers:
        k, v = layer.self_attn.keys_values(ctx, 0)
        keys.append(per_block(k))
        values.append(per_block(v))
    first = tokens[0, anchors] if rows is None else tokens[rows, anchors]
    block = mx.concatenate([first[:, None], mx.full((n, B - 1), draft.mask_token_id)], axis=1)
    emb = target.embed(block).astype(draft.dtype)
    h = draft.denoise(emb, keys, values, anchors)[:, 1:]
    return target.lm_head(h) if head is None else target.finish(h @ head.T)


def block_labels(
    tokens: mx.array,
    anchors: mx.array,
    block_size: int,
    rows: mx.array | None = None,
    lengths: mx.array | None = None,
):
    """Labels (N, B-1) of each block (the tokens after its anchor) and which ones exist. A batch
    (see block_logits) also gives each sequence's unpadded length."""
    tokens = tokens.reshape(-1, tokens.shape[-1])
    rows = mx.zeros_like(anchors) if rows is None else rows
    length = tokens.shape[1] if lengths is None else lengths[rows][:, None]
    pos = anchors[:, None] + mx.arange(1, block_size)[None]
    return tokens[rows[:, None], mx.minimum(pos, tokens.shape[1] - 1)], pos < length


def loss_weights(block_size: int, gamma: float) -> mx.array:
    """exp(-(k-1)/gamma) for block positions k = 1..B-1: early positions matter most."""
    return mx.exp(-mx.arange(block_size - 1) / gamma)


CE_ROWS = 64  # rows of the NumPy softmax at a time: a reused buffer, not fresh pages for every temporary


def _softmax_rows(x: np.ndarray):
    """Per row chunk of x: (rows, exp(x - max) in a reused buffer, row sums, row max)."""
    buf = np.empty((min(CE_ROWS, len(x)), x.shape[1]), dtype=np.float32)
    for lo in range(0, len(x), CE_ROWS):
        rows = slice(lo, lo + CE_ROWS)
        e = buf[: len(x[rows])]
        m = x[rows].max(-1, keepdims=True)
        np.subtract(x[rows], m, out=e)
        np.exp(e, out=e)
        yield rows, e, e.sum(-1, keepdims=True), m


@mx.custom_function
def _cpu_cross_entropy(logits, labels):
    """Per-row cross-entropy computed in NumPy (hand-written: on MLX's CPU backend `mx.exp` is scalar
    code, NumPy's is vectorised, and the vocabulary-wide softmax is a large part of a training step).
    Same values as nn.losses.cross_entropy."""
    x = np.array(logits, copy=False)
    lse = np.empty(len(x), dtype=np.float32)
    for rows, _, s, m in _softmax_rows(x):
        lse[rows] = np.log(s[:, 0]) + m[:, 0]
    return mx.array(lse - x[np.arange(len(x)), np.array(labels)])


@_cpu_cross_entropy.vjp
def _cpu_cross_entropy_vjp(primals, cotangent, output):
    logits, labels = primals
    x = np.array(logits, copy=False)
    d = np.array(cotangent)[:, None]
    grad = np.empty_like(x)
    for rows, e, s, _ in _softmax_rows(x):
        np.multiply(e, d[rows] / s, out=grad[rows])
    grad[np.arange(len(grad)), np.array(labels)] -= d[:, 0]
    return mx.array(grad), mx.zeros_like(labels)


def cross_entropy(logits: mx.array, labels: mx.array) -> mx.array:
    """Unreduced cross-entropy over the last axis, in float32."""
    logits = logits.astype(mx.float32)
    if mx.default_device() != mx.cpu:
        return nn.losses.cross_entropy(logits, labels, reduction="none")
    shape = labels.shape
    return _cpu_cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).reshape(shape)


def acceptance_from_blocks(logits, labels, valid) -> tuple[float, np.ndarray]:
    """Greedy acceptance length each block would get (1 + leading correct proposals), and the
    per-position accuracy. On self-distilled data this is the real greedy acceptance at that point."""
    right = np.array((logits.argmax(-1) == labels) & valid)
    lead = np.cumprod(right, axis=1).sum(axis=1)
    v = np.array(valid)
    return float(1 + lead.mean()), right.sum(0) / np.maximum(v.sum(0), 1)


class FeatureCache:
    """Target hidden features per sequence, computed once and kept as float16 in RAM while they fit in
    `max_bytes` (a whole data set's can outgrow RAM); past that, a sequence's features are recomputed
    each time it comes round. Features past float16's range (the massive activations of some targets),
    or a bfloat16 target's, are kept as bfloat16."""

    def __init__(self, target: Target, max_bytes: float = float("inf")):
        self.target, self.max_bytes, self.store, self.nbytes = target, max_bytes, {}, 0

    def __call__(self, index: int, tokens: mx.array) -> mx.array:
        return self.many([index], [tokens])[0]

    def many(self, indices: list[int], tokens: list[mx.array], per_pass: int | None = None) -> list[mx.array]:
        """Features (1, L, F) of each sequence; those not kept are computed in target passes over up to
        `per_pass` of them (default: all) right-padded to one length (causal attention: the padding
        changes nothing before it)."""
        out = {i: self.store[i] for i in indices if i in self.store}
        missing = [(i, t) for i, t in zip(indices, tokens) if i not in out]
        per_pass = per_pass or max(len(missing), 1)
        for lo in range(0, len(missing), per_pass):
            todo = missing[lo : lo + per_pass]
            width = max(t.shape[0] for _, t in todo)
            batch = mx.stack([mx.pad(t, (0, width - t.shape[0])) for _, t in todo])
            _, features = self.target(batch, None, last_logits_only=True)
            bf16 = features.dtype == mx.bfloat16
            # float32 first, so that each kept slice is a copy of its own, not a view holding the batch
            features = mx.stop_gradient(features).astype(mx.float32)
            rows = [features[row : row + 1, : t.shape[0]] for row, (_, t) in enumerate(todo)]
            loudest = mx.stack([mx.abs(f).max() for f in rows]).tolist()
            for (i, _), f, loud in zip(todo, rows, loudest):
                f = f.astype(mx.bfloat16 if bf16 or loud >= 65504 else mx.float16)
                mx.eval(f)
                out[i] = f
                if self.nbytes + f.nbytes <= self.max_bytes:
                    self.store[i] = f
                    self.nbytes += f.nbytes
        return [out[i] for i in indices]


class StandardisedFC(nn.Module):
    """The drafter's `fc` while training: W x computed as W' (x / s), with W' = W * s trained and the
    per-dimension feature scale s fixed. The function is fc's own; only Adam's steps change, which
    now move every input dimension's weights at the rate its (unit-scale) input warrants."""

    def __init__(self, fc: nn.Linear, scale: mx.array):
        super().__init__()
        self.scale = scale
        self.weight = fc.weight * scale
        self.freeze(keys=["scale"])

    def __call__(self, x: mx.array) -> mx.array:
        return (x / self.scale) @ self.weight.T

    def plain(self) -> nn.Linear:
        fc = nn.Linear(self.weight.shape[1], self.weight.shape[0], bias=False)
        fc.weight = self.weight / self.scale
        return fc


def feature_scale(features: list[mx.array]) -> mx.array:
    """Each feature dimension's RMS over these sequences' positions after the first (position 0 is
    an attention sink with activations up to ~10^4 in some targets), floored at a thousandth of the
    median so that a dead dimension is not blown up."""
    x = np.concatenate([np.array(f[0, 1:].astype(mx.float32)) for f in features])
    rms = np.sqrt(np.mean(x * x, axis=0))
    return mx.array(np.maximum(rms, 1e-3 * np.median(rms)))


def plain_parameters(draft: DFlashDraftModel) -> dict:
    """The drafter's weights in its own layout (fc as W, whatever training wraps it in)."""
    params = dict(tree_flatten(draft.parameters()))
    if isinstance(draft.fc, StandardisedFC):
        params.pop("fc.scale")
        params["fc.weight"] = draft.fc.plain().weight
    return params


def sample_anchors(rng: np.random.Generator, prompt_len: int, length: int, n: int) -> np.ndarray:
    """Up to n distinct anchor positions among the response tokens that have a next token."""
    first, last = max(prompt_len, 1), length - 2
    if last < first:
        return np.zeros(0, dtype=np.int32)
    choices = np.arange(first, last + 1)
    return np.sort(rng.choice(choices, size=min(n, len(choices)), replace=False)).astype(np.int32)


def sequence_for_step(seed: int, draw: int, train_idx: np.ndarray) -> int:
    """The run's `draw`-th sequence (step s of a run with batch size N takes draws sN .. sN+N-1): epochs
    in a fresh random order each, so every training sequence is used once before any is used twice (and a
    resumed run draws the same ones)."""
    epoch, k = divmod(draw, len(train_idx))
    return int(np.random.default_rng([seed, 1, epoch]).permutation(train_idx)[k])


def block_weight_sum(anchors: np.ndarray, length: int, block_size: int, gamma: float) -> float:
    """The loss weights of one sequence's blocks that have a label (the sum a step's loss is over)."""
    w = np.array(loss_weights(block_size, gamma))
    return float((w[None] * (anchors[:, None] + np.arange(1, block_size)[None] < length)).sum())


def batch_arrays(features: list[mx.array], tokens: list[mx.array], anchors: list[np.ndarray]):
    """A pass's sequences as block_logits takes them: one as it is; several right-padded to one length
    (a multiple of 64, so that few shapes occur), with each block's sequence and each sequence's length."""
    if len(tokens) == 1:
        return features[0], tokens[0], mx.array(anchors[0]), None, None
    width = -(-max(t.shape[0] for t in tokens) // 64) * 64
    padded = [mx.pad(f, [(0, 0), (0, width - f.shape[1]), (0, 0)]) for f in features]
    rows = np.repeat(np.arange(len(anchors)), [len(a) for a in anchors]).astype(np.int32)
    return (
        mx.concatenate(padded),
        mx.stack([mx.pad(t, (0, width - t.shape[0])) for t in tokens]),
        mx.array(np.concatenate(anchors)),
        mx.array(rows),
        mx.array([t.shape[0] for t in tokens]),
    )


def schedule(cfg: TrainConfig):
    warm = optim.linear_schedule(cfg.lr * 0.01, cfg.lr, max(cfg.warmup, 1))
    decay = optim.cosine_decay(cfg.lr, max(cfg.steps - cfg.warmup, 1), cfg.lr * 0.05)
    return optim.join_schedules([warm, decay], [max(cfg.warmup, 1)])


def evaluate_blocks(draft, target, features_of, seqs, indices, cfg: TrainConfig, rng_seed=1234):
    """Offline acceptance estimate and per-position accuracy on sequences `indices`."""
    rng = np.random.default_rng(rng_seed)
    taus, accs = [], []
    for i in indices:
        ids, plen = seqs[i]
        tokens = mx.array(ids[: cfg.max_seq_len])
        anchors = sample_anchors(rng, plen, tokens.shape[0], cfg.anchors)
        if len(anchors) == 0:
            continue
        a = mx.array(anchors)
        logits = block_logits(draft, target, features_of(i, tokens), tokens, a)
        labels, valid = block_labels(tokens, a, cfg.block_size)
        tau, acc = acceptance_from_blocks(logits, labels, valid)
        taus.append(tau)
        accs.append(acc)
    return float(np.mean(taus)), np.mean(accs, axis=0)


# All a resumed run takes from the new command (the rest is its recipe, which its curve depends on).
RUN_CONTROL = ("steps", "checkpoint_every", "eval_every", "micro_batch")


def saved_run(out: str | Path) -> dict | None:
    """A run folder's last checkpoint: its step, train_config and the drafter's config (None: it has
    none)."""
    ckpt = Path(out).expanduser() / "checkpoint"
    old = ckpt.with_name(".checkpoint.old")
    if not ckpt.exists() and (old / "state.json").exists():
        old.rename(ckpt)  # a stop between the two renames of a checkpoint swap: the previous one is whole
    if not (ckpt / "state.json").exists():
        return None
    with checkpoint_file(ckpt / "state.json"):
        state = json.loads((ckpt / "state.json").read_text())
        if not isinstance(state, dict) or not {"step", "train_config"} <= state.keys():
            raise ValueError("no step and train_config")
        try:  # (its settings' kinds and ranges, before a resume reads them)
            TrainConfig(**{**asdict(TrainConfig()), **state["train_config"]})
        except UserError as e:
            raise ValueError(e) from None
    with checkpoint_file(ckpt / "config.json"):
        config = DFlashConfig.from_dict(read_config(ckpt))
    return {**state, "config": config}


@contextmanager
def checkpoint_file(file: Path) -> Iterator[None]:
    """Reading a checkpoint's file: one line naming it if it is damaged (a disk that filled up, a copy
    cut short), not a traceback from the JSON or safetensors reader."""
    try:
        yield
    except UserError:
        raise
    except OSError as e:  # (a permission, a failing disk: the run itself may be whole)
        raise UserError(f"cannot read {file} ({e.strerror or e})") from None
    except (ValueError, RuntimeError, KeyError, TypeError) as e:
        raise UserError(
            f"{file} is damaged ({e}): this run cannot go on from its checkpoint; start a new run (another "
            "-o), from an exported drafter with --init if you have one"
        ) from None


def data_fingerprint(seqs: list[tuple[list[int], int]]) -> dict:
    """What a run trains on (its usable sequences, in order): a resume on other data would change its
    order of sequences and its held-out set, so it is refused."""
    h = hashlib.sha256()
    for ids, plen in seqs:
        h.update(np.asarray([plen, *ids], dtype=np.int64).tobytes())
    return {"sequences": len(seqs), "sha256": h.hexdigest()[:16]}


def check_same_data(run: dict, now: dict) -> None:
    """A clear error if a run would resume on other data (`now`: their data_fingerprint) than it trained
    on (runs that did not record their data are not checked)."""
    saved = run.get("data")
    if saved is not None and now != saved:
        how = (
            f"{saved['sequences']} usable sequences, these have {now['sequences']}"
            if now["sequences"] != saved["sequences"]
            else "the same number of sequences, not the same ones"
        )
        raise UserError(
            f"the run trained on other data ({how}): resume it with the same --data folders in "
            "the same order, or export it and start a new run from it with --init"
        )


def target_fingerprint(target: Target) -> dict:
    """What identifies the frozen target a run trains against: its shape and a checksum of its embedding."""
    rows = target.embed(mx.arange(min(target.vocab_size, 1024))).astype(mx.float32)
    return {
        "family": target.family,
        "layers": target.num_layers,
        "vocab": target.vocab_size,
        "embedding": float(mx.abs(rows).sum()),
    }


def check_same_target(run: dict, now: dict) -> None:
    """A clear error if a run would resume against another target than it trained with (other weights of
    the same shape included; runs that did not record it are not checked)."""
    saved = run.get("target")
    if saved is None:
        return
    same_shape = all(saved[k] == now[k] for k in ("family", "layers", "vocab"))
    if not (same_shape and math.isclose(saved["embedding"], now["embedding"], rel_tol=1e-4)):

        def shape(t):
            return f"{t['family']}, {t['layers']} layers, vocabulary {t['vocab']}"

        raise UserError(
            "the run trained against another target ("
            + ("other weights of the same shape" if same_shape else f"{shape(saved)}; this one: {shape(now)}")
            + "): resume it with the -m it was trained with, or export it and start a new run from it with "
            "--init"
        )


def usable_sequences(seqs: list[tuple[list[int], int]], cfg: TrainConfig) -> list[tuple[list[int], int]]:
    """The sequences a run can use (2+ response tokens within the first `max_seq_len`, so that each
    has an anchor), or a clear error before any work."""
    seqs = [s for s in seqs if min(len(s[0]), cfg.max_seq_len) - max(s[1], 1) >= 2]
    if len(seqs) <= cfg.holdout:
        raise UserError(
            f"the dataset has {len(seqs)} usable sequences (2+ response tokens within the first "
            f"{cfg.max_seq_len}); need more than the {cfg.holdout} held out"
        )
    check_block_size(cfg.block_size, least=2)
    if cfg.vocab not in ("full", "data"):
        raise UserError(f"vocab must be 'full' or 'data', got {cfg.vocab!r}")
    return seqs


def train(
    target: Target,
    tokenizer,
    seqs: list[tuple[list[int], int]],
    out: str | Path,
    cfg: TrainConfig,
    draft: DFlashDraftModel | None = None,
    on_step: Callable[[dict], None] | None = None,
    evaluate: Callable[[DFlashDraftModel], dict] | None = None,
    feature_cache_gb: float = 4.0,
    stop: Callable[[], bool] | None = None,
) -> DFlashDraftModel:
    """Train (or resume training) a drafter into `out`; returns the trained drafter.

    `on_step(record)` sees every step's loss/lr/tokens-per-second; `evaluate(draft)` (e.g. a real
    stream_generate tau on held-out prompts) runs every `eval_every` steps and at the end.
    `feature_cache_gb` caps the RAM kept for target features between epochs (it never changes the result).
    `stop()` is asked after every step; when it says so, the run checkpoints that step and returns early.
    """
    out = Path(out).expanduser()
    start = 0
    ckpt = out / "checkpoint"
    for stale in out.glob(".checkpoint.partial-*"):  # a checkpoint being written when the process was killed
        shutil.rmtree(stale, ignore_errors=True)
    run = saved_run(out)
    if run is not None:  # resume: the run's recipe and weights
        # A field the run did not record (it predates the field) has the default it ran with.
        cfg = TrainConfig(
            **{**asdict(TrainConfig()), **run["train_config"], **{k: getattr(cfg, k) for k in RUN_CONTROL}}
        )
        draft = DFlashDraftModel(run["config"])
        with checkpoint_file(ckpt / "model.safetensors"):
            draft.load_weights(str(ckpt / "model.safetensors"))
        start = run["step"]
    seqs = usable_sequences(seqs, cfg)
    data, frozen = data_fingerprint(seqs), target_fingerprint(target)
    if run is not None:
        check_same_data(run, data)
        check_same_target(run, frozen)
    else:
        if draft is None:
            mx.random.seed(cfg.seed)
            draft = check_new_drafter(target, tokenizer, cfg)
        elif type(draft) is not DFlashDraftModel:
            raise UserError(f"training starts from a DFlash drafter, not a {type(draft).__name__}")
        elif cfg.block_size != draft.config.block_size:  # a starting drafter brings its own architecture
            raise UserError(
                f"block size {cfg.block_size} does not match the starting drafter's "
                f"{draft.config.block_size}: train it at its own block size"
            )
        c = draft.config  # the run records the architecture it got, defaults resolved
        cfg = replace(
            cfg,
            num_layers=c.num_hidden_layers,
            intermediate_size=c.intermediate_size,
            target_layer_ids=list(c.target_layer_ids),
            mask_token_id=c.mask_token_id,
        )
    target = Target(target.model, draft.config.target_layer_ids)
    check_pair(target, draft)
    features_of = FeatureCache(target, feature_cache_gb * 2**30)
    train_idx = np.arange(cfg.holdout, len(seqs))
    if run is None:  # the scale of the features the run starts on (they are kept for its first steps anyway)
        first = [sequence_for_step(cfg.seed, k, train_idx) for k in range(min(16, len(train_idx)))]
        scale = feature_scale([features_of(i, mx.array(seqs[i][0][: cfg.max_seq_len])) for i in first])
    else:  # the run's own (runs from before standardisation have none and go on without it)
        saved = ckpt / "feature_scale.safetensors"
        with checkpoint_file(saved):
            scale = mx.load(str(saved))["scale"] if saved.exists() else None
    if scale is not None:
        draft.fc = StandardisedFC(draft.fc, scale.astype(draft.fc.weight.dtype))
        draft.unbind()  # a drafter bound before: compile its step around this fc
    prepare(target, draft)  # binds the shared embedding and lm_head
    mx.eval(draft.parameters())

    opt = optim.AdamW(learning_rate=schedule(cfg), weight_decay=cfg.weight_decay)
    opt.init(draft.trainable_parameters())
    if start:
        with checkpoint_file(ckpt / "optimizer.safetensors"):
            opt.state = tree_unflatten(list(mx.load(str(ckpt / "optimizer.safetensors")).items()))
    gamma = cfg.loss_gamma()
    head, to_subset = None, None
    if cfg.vocab == "data":
        used = np.unique(
            np.concatenate([np.asarray(seqs[i][0][seqs[i][1] : cfg.max_seq_len]) for i in train_idx])
        )
        head = target.head_rows(mx.array(used))
        if head is not None:  # else (a head with a bias) the full vocabulary
            lookup = np.zeros(target.vocab_size, np.int32)
            lookup[used] = np.arange(len(used))
            to_subset = mx.array(lookup)  # a label's index in the subset
            mx.eval(head, to_subset)

    weights = loss_weights(cfg.block_size, gamma)

    def loss_fn(model, features, tokens, anchors, rows, lengths, total):
        """The pass's share of the step's loss: its blocks' weighted cross-entropy over the step's weight
        sum `total`, so that the passes of a step add up to the weighted mean over all of its blocks."""
        logits = block_logits(model, target, features, tokens, anchors, head, rows)
        labels, valid = block_labels(tokens, anchors, cfg.block_size, rows, lengths)
        labels = labels if to_subset is None else to_subset[labels]
        return (cross_entropy(logits, labels) * (weights[None] * valid)).sum() / total

    compute = mx.bfloat16 if cfg.precision == "bf16" else None
    master = None  # bf16: the float32 weights the optimizer steps; the drafter holds their bf16 copy
    if compute is not None:
        master = draft.trainable_parameters()
        draft.set_dtype(compute)

    def plain_precision():  # the drafter with its float32 master weights, to save or return
        if master is not None:
            draft.set_dtype(mx.float32)
            draft.update(master)

    loss_and_grad = nn.value_and_grad(draft, loss_fn)
    history = list(cfg.history)
    # A CPU runs a batch one sequence a pass (the target's too): on it padded passes cost more than they
    # save.
    per_pass = cfg.micro_batch or (1 if backend() == "cpu" else cfg.batch_size)
    for step in range(start, cfg.steps):
        tic = time.perf_counter()
        rng = np.random.default_rng([cfg.seed, step])
        n = cfg.batch_size
        picked = [sequence_for_step(cfg.seed, step * n + j, train_idx) for j in range(n)]
        tokens = [mx.array(seqs[i][0][: cfg.max_seq_len]) for i in picked]
        anchors = [sample_anchors(rng, seqs[i][1], t.shape[0], cfg.anchors) for i, t in zip(picked, tokens)]
        total = sum(block_weight_sum(a, t.shape[0], cfg.block_size, gamma) for a, t in zip(anchors, tokens))
        features = features_of.many(picked, tokens, per_pass)
        loss, grads = mx.array(0.0), None
        for lo in range(0, n, per_pass):
            part = slice(lo, lo + per_pass)
            value, g = loss_and_grad(draft, *batch_arrays(features[part], tokens[part], anchors[part]), total)
            loss = loss + value
            grads = g if grads is None else tree_map(mx.add, grads, g)
            if per_pass < n:
                mx.eval(loss, grads)  # one pass's activations at a time
        if master is not None:
            grads = tree_map(lambda x: x.astype(mx.float32), grads)
        grads, norm = optim.clip_grad_norm(grads, cfg.grad_clip)
        if master is None:
            opt.update(draft, grads)
        else:
            master = opt.apply_gradients(grads, master)
            draft.update(tree_map(lambda x: x.astype(compute), master))
        mx.eval(loss, draft.parameters(), opt.state, master)
        record = {
            "step": step + 1,
            "sequences": picked,
            "loss": loss.item(),
            "grad_norm": norm.item(),
            "lr": float(opt.learning_rate),
            "block_tokens": sum(len(a) for a in anchors) * cfg.block_size,
            "seconds": time.perf_counter() - tic,
        }
        if not math.isfinite(record["loss"]) or not math.isfinite(record["grad_norm"]):
            # (weights that are no longer numbers: nothing of this step is kept, the last checkpoint stays)
            saved = max(start, step // cfg.checkpoint_every * cfg.checkpoint_every)
            kept = f"the checkpoint of step {saved}" if saved else "no checkpoint"
            raise UserError(
                f"the loss became {record['loss']} at step {step + 1}: training diverged and stopped, "
                f"keeping {kept}; start a new run with a lower --lr (or a longer --warmup)"
            )
        history.append({k: record[k] for k in ("step", "loss")})
        checking = cfg.eval_every and (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps
        interrupted = False  # the check cut short (a Ctrl-C during it): the step is kept, the run ends
        if checking and not (stop is not None and stop()):  # (a stop asked for skips it)
            try:
                tau, acc = evaluate_blocks(draft, target, features_of, seqs, range(cfg.holdout), cfg)
                record.update(offline_tau=tau, position_accuracy=[round(float(x), 3) for x in acc])
                if evaluate is not None:
                    try:
                        record.update(evaluate(draft))
                    except Exception as e:  # a failed check must not cost the run: logged, training goes on
                        record["eval_error"] = f"{type(e).__name__}: {e}"
                history.append({k: v for k, v in record.items() if k != "seconds"})
            except KeyboardInterrupt:
                interrupted = True
                record["eval_error"] = "interrupted"
        if on_step is not None:
            on_step(record)
        stopping = interrupted or (stop is not None and stop())
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps or stopping:
            plain_precision()
            save_checkpoint(
                ckpt, draft, opt, step + 1, TrainConfig(**{**asdict(cfg), "history": history}), data, frozen
            )
            if master is not None and step + 1 < cfg.steps and not stopping:
                draft.set_dtype(compute)
        if interrupted and step + 1 < cfg.steps:  # (at the last step, the run is done all the same)
            raise KeyboardInterrupt
        if stopping:
            break
    plain_precision()
    if isinstance(draft.fc, StandardisedFC):  # the caller gets the drafter as saved: fc a plain Linear
        draft.fc = draft.fc.plain()
        draft.unbind()
    return draft


def save_checkpoint(
    folder: Path, draft: DFlashDraftModel, opt, step: int, cfg: TrainConfig, data: dict, target: dict
) -> None:
    with atomic_folder(folder, force=True) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), plain_parameters(draft))
        if isinstance(draft.fc, StandardisedFC):
            mx.save_safetensors(str(tmp / "feature_scale.safetensors"), {"scale": draft.fc.scale})
        (tmp / "config.json").write_text(json.dumps(draft.config.to_dict(), indent=2))
        mx.save_safetensors(
            str(tmp / "optimizer.safetensors"),
            {k: v for k, v in tree_flatten(opt.state) if isinstance(v, mx.array)},
        )
        (tmp / "state.json").write_text(
            json.dumps({"step": step, "train_config": asdict(cfg), "data": data, "target": target})
        )
