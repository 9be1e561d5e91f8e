"""GGUF target -> MLX model folder that `mlx_lm.load` reads (written by hand: mlx-lm has no GGUF
import). MLX itself reads the tensors (`mx.load`), keeping Q4_0/Q4_1/Q8_0 in its own quantized
layout (group size 32); this module maps names, undoes llama.cpp's Q/K row permutation, writes
config.json from the GGUF metadata, and rebuilds tokenizer.json / tokenizer_config.json from the
GGUF tokenizer with the `tokenizers` library.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from .errors import UserError

GGUF_GROUP_SIZE = 32
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
SUPPORTED_TYPES = "F32, F16, BF16, Q4_0, Q4_1 and Q8_0"

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Pre-tokenizer split patterns by `tokenizer.ggml.pre` (the regexes the original tokenizers use).
KNOWN_PRE = ("gpt2", "llama-bpe", "qwen2", "smollm", "starcoder", "refact")
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _scalar(meta, key, default=None):
    v = meta.get(key, default)
    return v.item() if isinstance(v, mx.array) else v


# GGML tensor types MLX reads exactly: floats, and the three quantizations it maps onto its own layout.
_NATIVE_TYPES = {0: "F32", 1: "F16", 30: "BF16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}
_OTHER_TYPES = {
    6: "Q5_0",
    7: "Q5_1",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    29: "IQ1_M",
    34: "TQ1_0",
    35: "TQ2_0",
}


def tensor_types(path: str | Path) -> dict[str, int]:
    """{tensor name: GGML type id}, read from the GGUF header (MLX does not expose the types)."""
    with open(path, "rb") as f:
        end = os.fstat(f.fileno()).st_size

        def read(fmt):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

        def string():
            n = read("Q")
            if n > end - f.tell():  # (read whole, a forged length would ask for exabytes)
                raise struct.error(f"a string of {n} bytes at byte {f.tell()}, past the end of the file")
            return f.read(n).decode("utf-8", "replace")

        sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

        def skip_value(kind):
            if kind == 8:
                f.seek(read("Q"), 1)
            elif kind == 9:
                item, n = read("I"), read("Q")
                if item in sizes:
                    f.seek(sizes[item] * n, 1)
                else:
                    for _ in range(n):
                        skip_value(item)
            elif kind in sizes:
                f.seek(sizes[kind], 1)
            else:
                raise struct.error(f"a value of unknown type {kind} at byte {f.tell()}")

        if f.read(4) != b"GGUF":
            raise UserError(f"{path} is not a GGUF file (no GGUF magic number)")
        read("I")  # version
        n_tensors, n_kv = read("Q"), read("Q")
        for _ in range(n_kv):
            string()
            skip_value(read("I"))
        types = {}
        for _ in range(n_tensors):
            name = string()
            f.seek(8 * read("I"), 1)  # dims
            types[name] = read("I")
            read("Q")  # offset
        return types


def read_gguf(path: str | Path):
    """-> (tensors, metadata), refusing up front the tensor types MLX does not read exactly."""
    try:
        types = tensor_types(path)
    except (OSError, struct.error, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not a readable GGUF file: {e}") from None
    bad = {n: t for n, t in types.items() if t not in _NATIVE_TYPES}
    if bad:
        names = sorted({_OTHER_TYPES.get(t, f"type {t}") for t in bad.values()})
        raise UserError(
            f"{path} holds tensors of type {', '.join(names)} (e.g. {next(iter(bad))}); "
            f"dflash-mlx reads GGUF tensors of types {SUPPORTED_TYPES}: use such a file "
            "(e.g. a Q8_0 or Q4_0 one), or convert the Hugging Face weights instead"
        )
    try:
        return mx.load(str(path), format="gguf", return_metadata=True)  # whatever the case of ".gguf"
    except Exception as e:  # MLX raises a terse RuntimeError/ValueError
        raise UserError(f"{path} is not a readable GGUF file: {str(e).strip()}") from None


def gguf_config(meta: dict, tensors: dict) -> dict:
    """An mlx-lm (Hugging Face style) config.json from the GGUF metadata."""
    arch = _scalar(meta, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UserError(
            f"GGUF architecture '{arch}' is not supported; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    g = lambda k, d=None: _scalar(meta, f"{arch}.{k}", d)  # noqa: E731
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    vocab = len(meta["tokenizer.ggml.tokens"]) if "tokenizer.ggml.tokens" in meta else int(g("vocab_size"))
    config = {
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 4096)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if arch == "qwen2":
        config["attention_bias"] = True
    scaling = _scalar(meta, f"{arch}.rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(g("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise UserError(
            f"GGUF RoPE scaling '{scaling}' is not supported: convert the model's Hugging Face "
            f"checkpoint instead (dflash-mlx convert <repo id> <folder>)"
        )
    if "rope_freqs.weight" in tensors:  # Llama 3.1+: llama.cpp stores the scaled RoPE as per-pair divisors
        config["rope_scaling"] = _llama3_scaling(
            tensors["rope_freqs.weight"], config["head_dim"], config["rope_theta"]
        )
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = _scalar(meta, f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            config[key] = int(value)
    return config


def _llama3_rope_divisors(
    head_dim: int,
    theta: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
    **_,
) -> mx.array:
    """Llama 3's RoPE scaling as one divisor per frequency: 1 for short wavelengths, `factor` for
    long ones, a smooth blend between (what llama.cpp writes as `rope_freqs`)."""
    wavelen = 2 * math.pi * theta ** (mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smooth = mx.clip(smooth, 0.0, 1.0)
    return 1 / ((1 - smooth) / factor + smooth)


def _llama3_scaling(divisors: mx.array, head_dim: int, theta: float) -> dict:
    """mlx-lm's llama3 rope_scaling for a GGUF's `rope_freqs`. The GGUF keeps only the divisors, so
    this takes the parameters every Llama 3.1-3.3 release uses and checks they give exactly those."""
    divisors = divisors.astype(mx.float32)
    scaling = {
        "rope_type": "llama3",
        "factor": divisors.max().item(),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if (
        divisors.shape != (head_dim // 2,)
        or not mx.allclose(divisors, _llama3_rope_divisors(head_dim, theta, **scaling), rtol=1e-4).item()
    ):
        raise UserError(
            "this GGUF's RoPE frequency divisors (rope_freqs) are not Llama 3's usual ones: convert "
            "the model's Hugging Face checkpoint instead (dflash-mlx convert <repo id> <folder>)"
        )
    return scaling


def _unpermute(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> rotate-half halves).

    Rows are independent in MLX's quantized layout too, so this applies to weight, scales and
    biases alike.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _mlx_name(name: str) -> str:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias|scales|biases)", name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias|scales|biases)", name)
    if m and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    raise UserError(f"unexpected GGUF tensor '{name}' for this architecture")


def gguf_weights(tensors: dict, config: dict, dtype: mx.Dtype | None):
    """-> (MLX weights, quantization config or None)."""
    weights = {_mlx_name(k): v for k, v in tensors.items() if k != "rope_freqs.weight"}  # now in config
    if config["model_type"] == "llama":  # llama.cpp permutes Q/K rows for this architecture only
        for k in list(weights):
            for proj, heads in (
                ("q_proj", config["num_attention_heads"]),
                ("k_proj", config["num_key_value_heads"]),
            ):
                if f".self_attn.{proj}." in k:
                    weights[k] = _unpermute(weights[k], heads)
    quantized = {k[: -len(".scales")] for k in weights if k.endswith(".scales")}
    if dtype is not None:
        for base in quantized:
            w, s, b = (
                weights.pop(f"{base}.weight"),
                weights.pop(f"{base}.scales"),
                weights.pop(f"{base}.biases"),
            )
            # Dequantize in float32: GGUF's float16 scales times 4-bit levels are not float16 numbers.
            weights[f"{base}.weight"] = mx.dequantize(
                w,
                s.astype(mx.float32),
                b.astype(mx.float32),
                group_size=GGUF_GROUP_SIZE,
                bits=32 * w.shape[-1] // (s.shape[-1] * GGUF_GROUP_SIZE),
            )
        return {k: v.astype(dtype) for k, v in weights.items()}, None
    bits = {
        base: 32
        * weights[f"{base}.weight"].shape[-1]
        // (weights[f"{base}.scales"].shape[-1] * GGUF_GROUP_SIZE)
        for base in quantized
    }
    if not bits:
        return weights, None
    common = max(set(bits.values()), key=list(bits.values()).count)
    quant = {"group_size": GGUF_GROUP_SIZE, "bits": common}
    quant.update(
        {base: {"group_size": GGUF_GROUP_SIZE, "bits": b} for base, b in bits.items() if b != common}
    )
    return weights, quant


def gguf_tokenizer(meta: dict):
    """-> (tokenizers.Tokenizer, tokenizer_config dict) from the GGUF tokenizer metadata."""
    kind = _scalar(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UserError(f"GGUF tokenizer model '{kind}' is not supported (only byte-level BPE, 'gpt2')")
    tokens = list(meta["tokenizer.ggml.tokens"])

    def token(key):
        i = _scalar(meta, f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None else None

    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = meta["tokenizer.ggml.token_type"].tolist()
    pre = _scalar(meta, "tokenizer.ggml.pre", "gpt2")
    if pre not in KNOWN_PRE:  # another split would silently give the model other tokens
        raise UserError(
            f"GGUF pre-tokenizer '{pre}' is not supported (known: {', '.join(KNOWN_PRE)}): "
            "convert the model from its Hugging Face folder instead"
        )
    tok = Tokenizer(
        models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=pre == "llama-bpe")
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    split = {"llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre, _GPT2_SPLIT)
    steps = [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]
    if pre in ("smollm", "starcoder", "refact"):  # these split every digit apart first
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    add_bos = bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False))
    bos_id = _scalar(meta, "tokenizer.ggml.bos_token_id")
    if add_bos and bos_id is not None:  # as the original tokenizer.json's post-processor does
        bos = tokens[int(bos_id)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
        )
    # Control (3) and user-defined (4) tokens are matched whole, before BPE.
    tok.add_tokens(
        [
            AddedToken(t, special=types[i] == 3, normalized=False)
            for i, t in enumerate(tokens)
            if types[i] in (3, 4)
        ]
    )

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": add_bos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(
            _scalar(meta, f"{_scalar(meta, 'general.architecture')}.context_length", 4096)
        ),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tok, {k: v for k, v in config.items() if v is not None}


WRITTEN = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")  # (convert_gguf's)


def convert_gguf(
    path: str | Path,
    out: Path,
    dtype: mx.Dtype | None = None,
    progress: Callable[[str], None] | None = None,
) -> None:
    """Write an MLX model folder for a GGUF target into `out` (an empty folder)."""
    say = progress or (lambda _: None)
    say("reading GGUF")
    tensors, meta = read_gguf(path)
    try:  # (what is checked is said on its own; a key missing or of another kind reaches here)
        config = gguf_config(meta, tensors)
        tokenizer, tokenizer_config = gguf_tokenizer(meta)
        say("mapping weights")
        weights, quantization = gguf_weights(tensors, config, dtype)
    except (KeyError, TypeError, IndexError, ZeroDivisionError, AttributeError) as e:
        raise UserError(
            f"{path} lacks what a llama.cpp GGUF of its architecture holds ({type(e).__name__}: {e}): "
            "convert the model it came from again"
        ) from None
    if quantization:
        config["quantization"] = quantization
    say("writing weights")
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
