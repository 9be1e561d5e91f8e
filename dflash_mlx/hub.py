"""Downloads from the Hugging Face Hub (huggingface_hub, into its standard cache), each failure said in
one line with what to do."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from .errors import NotFound


def download(name: str, repo_type: str = "model", **kwargs) -> Path:
    """The snapshot of repo `name` (a model's folder, or a dataset's), downloading what `kwargs`
    (snapshot_download's) select and the cache lacks."""
    missing = f"no folder {name} here, and" if repo_type == "model" else f"the dataset {name}:"
    try:
        return Path(snapshot_download(name, repo_type=repo_type, **kwargs))
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
