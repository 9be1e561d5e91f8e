"""`loading.resolve` against a fake Hugging Face Hub (tests/fakehub.py): the real huggingface_hub client
downloads over HTTP from 127.0.0.1 into a cache under tmp_path."""

from __future__ import annotations

import os
import threading
import time

import pytest
from fakehub import FakeHub
from huggingface_hub import constants

from dflash_mlx.data import prompt_source
from dflash_mlx.errors import UserError
from dflash_mlx.loading import resolve

WEIGHTS = os.urandom(300_000)
CHUNK = 64 * 1024
CONFIG = b'{"model_type": "llama", "hidden_size": 64}'
REPOS = {
    "org/tiny": {"config.json": CONFIG, "model.safetensors": WEIGHTS, "README.md": b"# not downloaded\n"},
    "org/gated": {"config.json": CONFIG, "model.safetensors": WEIGHTS},
    "org/gated-prompts": {"README.md": b"# prompts\n", "train.jsonl": b'{"prompt": "hi"}\n'},
    # A target as repos hold them: the tokenizer and the chat template in files of their own.
    "org/target": {
        "config.json": CONFIG,
        "model.safetensors": WEIGHTS,
        "tokenizer.json": b"{}",
        "tokenizer_config.json": b'{"a": 1}',
        "tokenizer.model": b"spm",
        "chat_template.jinja": b"{{ x }}",
        "README.md": b"# not downloaded\n",
        "original/consolidated.00.pth": b"not downloaded",
    },
    "org/drafter": {
        "config.json": CONFIG,
        "model.safetensors": WEIGHTS,
        "phrases.npz": b"PK",
        "README.md": b"#",
    },
}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A fresh fake Hub and an empty cache. huggingface_hub reads HF_ENDPOINT, HF_HUB_CACHE, ... once, at
    import, into `constants`, and reads `constants` at call time: patching them is what takes effect."""
    hub = FakeHub(REPOS, gated={"org/gated", "org/gated-prompts"}, datasets={"org/gated-prompts"})
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)  # for anything reading the environment afresh
    patches = {
        "ENDPOINT": hub.url,
        "HUGGINGFACE_CO_URL_TEMPLATE": hub.url + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_TOKEN_PATH": str(tmp_path / "token"),  # no token of the machine's user is sent
        "HF_STORED_TOKENS_PATH": str(tmp_path / "stored_tokens"),
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_XET": True,
        # http_get writes what it receives in chunks of this size (10 MB by default), and resumes from the
        # last whole chunk written: make it small so a cut inside a 300 KB file leaves something to resume.
        "DOWNLOAD_CHUNK_SIZE": CHUNK,
    }
    for name, value in patches.items():
        monkeypatch.setattr(constants, name, value)
    yield hub
    hub.close()
    left = [t for t in threading.enumerate() if t.name == "fakehub" or "process_request" in t.name]
    assert not left, f"server threads left running: {left}"


def cache_files(tmp_path):
    return sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "hub").rglob("*") if p.is_file())


def test_download_then_cached(hub, tmp_path):
    path = resolve("org/tiny")
    assert path.is_dir() and str(path).startswith(str(tmp_path / "hub"))
    assert path.name == FakeHub.commit("org/tiny")  # .../snapshots/<commit>
    assert (path / "config.json").read_bytes() == CONFIG
    assert (path / "model.safetensors").read_bytes() == WEIGHTS
    assert not (path / "README.md").exists()  # outside allow_patterns
    gets = hub.file_requests("org/tiny")
    assert sorted(r[1].rsplit("/", 1)[1] for r in gets) == ["config.json", "model.safetensors"]

    n = len(hub.log)
    assert resolve("org/tiny") == path
    new = hub.log[n:]
    assert new, "the second resolve should still ask the Hub for the current commit"
    assert not [r for r in new if "/resolve/" in r[1]], f"files fetched again: {new}"
    assert (path / "model.safetensors").read_bytes() == WEIGHTS


def test_a_ctrl_c_during_a_download_stops_it_at_once(hub, monkeypatch):
    """huggingface_hub downloads in a pool of threads: a Ctrl-C came only once the file being downloaded
    was whole (minutes for a model's weights), and Python waited for the pool at exit too."""
    import signal

    import dflash_mlx.hub as hub_module

    monkeypatch.setattr(hub_module, "abandoned", False)
    hub.stall[("org/tiny", "model.safetensors")] = release = threading.Event()

    def ctrl_c_once_it_downloads():
        deadline = time.monotonic() + 30
        while not hub.file_requests("org/tiny") and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=ctrl_c_once_it_downloads, daemon=True).start()
    tic = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        resolve("org/tiny")
    assert time.monotonic() - tic < 10 and hub_module.abandoned  # (the command line exits at once)
    release.set()  # (the download left behind ends, before the Hub closes)
    deadline = time.monotonic() + 30
    while any(t.name == "download" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_target_comes_with_its_tokenizer_and_chat_template(hub):
    """What mlx-lm's own download fetches: a template or tokenizer left behind breaks the target later."""
    path = resolve("org/target")
    got = sorted(r[1].rsplit("/", 1)[1] for r in hub.file_requests("org/target"))
    assert got == [
        "chat_template.jinja",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
    ]
    assert (path / "chat_template.jinja").read_bytes() == b"{{ x }}"


def test_a_drafter_comes_with_its_phrase_table_and_shows_as_here_once_downloaded(hub):
    """The table was left out (mlx-lm's patterns have no .npz); `dflash-mlx models` never showed a
    downloaded pair as here (asked of the cache for every file of the repo, README.md too)."""
    from dflash_mlx.loading import Pair, local_copies

    pair = Pair(name="p", target="org/target", draft="org/drafter", family="llama")
    assert local_copies(pair) == {}
    path = resolve("org/drafter")
    assert (path / "phrases.npz").read_bytes() == b"PK" and not (path / "README.md").exists()
    resolve("org/target")
    assert set(local_copies(pair)) == {"target", "drafter"}


def test_interrupted_download_resumes_with_range(hub):
    """The first GET of the weights breaks halfway; huggingface_hub 2.4 retries inside the same call
    (http_get, after a 1 s pause) with `Range: bytes=N-` and completes the file. (Across calls there is
    no resume in 2.4: a failed download's temporary file is deleted, see the next test.)"""
    hub.cut[("org/tiny", "model.safetensors")] = 1
    path = resolve("org/tiny")
    gets = [r for r in hub.file_requests("org/tiny") if r[1].endswith("/model.safetensors")]
    assert len(gets) == 2 and gets[0][2] is None, gets
    start = int(gets[1][2].removeprefix("bytes=").removesuffix("-"))
    assert 0 < start <= len(WEIGHTS) // 2  # the whole chunks received before the cut are kept
    assert (path / "model.safetensors").read_bytes() == WEIGHTS


def test_failed_download_then_retry(hub, tmp_path):
    """The weights break halfway and the in-call resume gets a 500: resolve fails. Calling it again
    completes the snapshot with the exact bytes and leaves no partial file in the cache."""
    hub.cut[("org/tiny", "model.safetensors")] = 1
    hub.fail_ranged[("org/tiny", "model.safetensors")] = 1
    with pytest.raises(
        ConnectionError, match="Hugging Face refused the download of org/tiny: .*500 Internal Server Error"
    ):
        resolve("org/tiny")
    assert [r[2] for r in hub.file_requests("org/tiny") if r[1].endswith("/model.safetensors")][-1]
    assert not [f for f in cache_files(tmp_path) if f.endswith(("model.safetensors", ".incomplete"))]

    path = resolve("org/tiny")  # (huggingface_hub 2.4 fetches the weights again from byte 0)
    assert (path / "model.safetensors").read_bytes() == WEIGHTS
    assert (path / "config.json").read_bytes() == CONFIG
    assert not [f for f in cache_files(tmp_path) if f.endswith(".incomplete")]


def test_cached_snapshot_works_with_the_hub_down(hub):
    path = resolve("org/tiny")
    hub.close()  # the port now refuses connections
    assert resolve("org/tiny") == path
    assert (path / "model.safetensors").read_bytes() == WEIGHTS


def test_missing_repo(hub):
    with pytest.raises(
        FileNotFoundError, match="no folder nobody/missing-repo here, and no such repo on Hugging Face"
    ):
        resolve("nobody/missing-repo")
    assert ("GET", "/api/models/nobody/missing-repo/revision/main", None) in hub.log


def test_gated_repo(hub):
    with pytest.raises(PermissionError, match="gated"):
        resolve("org/gated")
    assert hub.file_requests("org/gated", "HEAD"), "the refusal should come from the Hub's file endpoint"


def test_hub_down_and_nothing_cached(hub):
    hub.close()
    with pytest.raises(
        ConnectionError, match="no folder org/tiny here, and Hugging Face cannot be reached"
    ) as info:
        resolve("org/tiny")
    assert "no such repo" not in str(info.value)  # a network failure is not a missing repo


def test_a_dataset_of_prompts_missing_gated_or_unreachable_is_one_line(hub):
    """`datasets` alone would try an unreachable Hub five times over half a minute and name no cause."""
    pytest.importorskip("datasets")
    with pytest.raises(FileNotFoundError, match="the dataset nobody/missing: no such repo on Hugging Face"):
        prompt_source("hf:nobody/missing")
    assert ("GET", "/api/datasets/nobody/missing/revision/main", None) in hub.log
    with pytest.raises(FileNotFoundError, match="no such repo"):  # (a model's id is no dataset's)
        prompt_source("hf:org/tiny")
    with pytest.raises(PermissionError, match="org/gated-prompts is gated on Hugging Face"):
        prompt_source("hf:org/gated-prompts")
    hub.close()
    tic = time.monotonic()
    with pytest.raises(
        ConnectionError,
        match=(
            "the dataset org/gated-prompts: Hugging Face cannot be reached to download it .* or give the "
            "prompts as a .jsonl file"
        ),
    ):
        prompt_source("hf:org/gated-prompts")
    assert time.monotonic() - tic < 15  # (not after retries)


def test_a_misspelt_or_wrong_drafter_is_said_before_the_target_downloads(hub):
    """The drafter was looked for only once the target was whole: minutes of a model's download, then
    "no such repo" for a typo in --draft."""
    from dflash_mlx.loading import load_pair

    with pytest.raises(FileNotFoundError, match="no folder org/drafterr here, and no such repo"):
        load_pair("org/target", "org/drafterr")
    with pytest.raises(UserError, match="org/tiny is a target .*, not a DFlash drafter"):
        load_pair("org/target", "org/tiny")
    assert not hub.file_requests("org/target")
    assert [r[1].rsplit("/", 1)[1] for r in hub.file_requests("org/tiny")] == ["config.json"]
