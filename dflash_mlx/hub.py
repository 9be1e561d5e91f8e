"""Downloads from the Hugging Face Hub (huggingface_hub, into its standard cache), each failure said in
one line with what to do."""

from __future__ import annotations

import threading
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from .errors import NotFound

abandoned = False  # a download was stopped and left running in huggingface_hub's threads (`_fetched`)


def _fetched(name: str, **kwargs) -> str:
    """snapshot_download, in a thread of its own and waited for here: it downloads in a pool of threads
    that a Ctrl-C in this one does not stop, and whose end Python waits for (a model's file: minutes,
    hours) both before the KeyboardInterrupt comes and at exit. Stopped, the download is left to end
    with the process (`abandoned`: the command line then ends at once)."""
    global abandoned
    done: dict = {}

    def fetch():
        try:
            done["path"] = snapshot_download(name, **kwargs)
        except BaseException as e:  # noqa: BLE001  (raised again in the caller's thread)
            done["error"] = e

    thread = threading.Thread(target=fetch, name="download", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.1)
    except BaseException:
        abandoned = True
        raise
    if "error" in done:
        raise done["error"]
    return done["path"]


def download(name: str, repo_type: str = "model", **kwargs) -> Path:
    """The snapshot of repo `name` (a model's folder, or a dataset's), downloading what `kwargs`
    (snapshot_download's) select and the cache lacks."""
    missing = f"no folder {name} here, and" if repo_type == "model" else f"the dataset {name}:"
    try:
        return Path(_fetched(name, repo_type=repo_type, **kwargs))
    except GatedRepoError:  # (a subclass of RepositoryNotFoundError: keep it first)
        raise PermissionError(
            f"{name} is gated on Hugging Face: accept its license on its page, and "
            "log in with `hf auth login`"
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise NotFound(
            f"{missing} no such repo on Hugging Face (check the spelling; private repos need `hf auth login`)"
        ) from None
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise ConnectionError(
                f"{missing} HF_HUB_OFFLINE is set, so Hugging Face is not asked for it (nor is it in the "
                "local cache): unset HF_HUB_OFFLINE to download it"
            ) from None
        raise ConnectionError(
            f"{missing} Hugging Face cannot be reached to download it (nor is it in the local cache): "
            + (
                "check the path, or the network (or HF_ENDPOINT)"
                if repo_type == "model"
                else "check the network (or HF_ENDPOINT), or give the prompts as a .jsonl file"
            )
        ) from None
    except HfHubHTTPError as e:
        raise ConnectionError(
            f"Hugging Face refused the download of {name}: {str(e).splitlines()[0]}"
        ) from None
