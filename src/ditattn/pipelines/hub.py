"""Hugging Face repo ids as ``--model-path``: ``org/name`` resolved to a local snapshot folder
through ``huggingface_hub``.

Order: the local Hugging Face cache first (``HF_HOME`` / ``HF_HUB_CACHE``, or ``cache_dir``; no
network when the cached snapshot has ``model_index.json`` and every component folder it lists);
otherwise, unless downloads are off (``HF_HUB_OFFLINE=1`` or ``local_files_only``), a download with
the hub's progress bars through diffusers' ``DiffusionPipeline.download`` (which picks the files a
diffusers pipeline needs: safetensors over pickles, the requested weights variant).  Every failure
is one :class:`~ditattn.errors.AttentionConfigError` naming the id and what to do.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Optional

from ditattn.errors import AttentionConfigError

log = logging.getLogger("ditattn.pipeline")

# owner/name as the hub spells them (letters, digits, '-', '_', '.'; no leading punctuation)
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_TRUE = ("1", "on", "yes", "true")


def looks_like_repo_id(value: str) -> bool:
    """``org/name`` (not an absolute, home or dot-relative path)."""
    return bool(REPO_ID.match(value)) and not value.startswith(".") and ".." not in value


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub reads it (at its import) or as the environment says now."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def _cache_location(cache_dir: Optional[str]) -> str:
    from huggingface_hub import constants

    return str(cache_dir or constants.HF_HUB_CACHE)


def missing_components(folder: str) -> Optional[list[str]]:
    """None when ``folder`` has no ``model_index.json``; else the component folders it lists that
    are absent (an interrupted download)."""
    import json

    index = os.path.join(folder, "model_index.json")
    if not os.path.isfile(index):
        return None
    try:
        with open(index, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return [
        k
        for k, v in data.items()
        if not k.startswith("_")
        and isinstance(v, list)
        and len(v) == 2
        and v[0] is not None
        and not os.path.isdir(os.path.join(folder, k))
    ]


def cached_snapshot(repo_id: str, revision: Optional[str] = None, cache_dir: Optional[str] = None) -> Optional[str]:
    """The cached snapshot folder of ``repo_id`` at ``revision`` (None: ``main``), or None when the
    cache has no complete diffusers pipeline for it.  Never touches the network."""
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True)
    except Exception:  # LocalEntryNotFoundError and friends: not cached
        return None
    gone = missing_components(folder)
    return folder if gone == [] else None


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def resolve_repo_id(
    repo_id: str,
    *,
    revision: Optional[str] = None,
    local_files_only: bool = False,
    cache_dir: Optional[str] = None,
    variant: Optional[str] = None,
) -> str:
    """The local snapshot folder of the diffusers pipeline ``repo_id`` (see the module docstring);
    raises :class:`AttentionConfigError` naming the id when it is neither cached nor downloadable."""
    at = f" (revision {revision})" if revision else ""
    folder = cached_snapshot(repo_id, revision, cache_dir)
    if folder is not None:
        log.info("%s%s: using the cached snapshot %s", repo_id, at, folder)
        return folder
    where = _cache_location(cache_dir)
    if local_files_only or hub_offline():
        why = "--local-files-only" if local_files_only else "HF_HUB_OFFLINE is set"
        raise AttentionConfigError(
            f"--model-path '{repo_id}'{at} is not in the local Hugging Face cache ({where}) and downloads are off "
            f"({why}); download it once with network access (e.g. hf download {repo_id}), point HF_HOME at the "
            "cache that has it, or give a local diffusers-format folder"
        )
    from huggingface_hub import constants, model_info
    from huggingface_hub import errors as hub_errors

    try:  # one metadata call first: a missing repo, revision or connection is reported as such
        model_info(repo_id, revision=revision)
    except hub_errors.GatedRepoError:
        raise AttentionConfigError(
            f"--model-path '{repo_id}' is gated on the Hugging Face Hub: accept its terms on "
            "huggingface.co and log in (hf auth login)"
        ) from None
    except hub_errors.RepositoryNotFoundError:
        raise AttentionConfigError(
            f"--model-path '{repo_id}': no such Hugging Face repository (or it is private: "
            "log in with hf auth login); give org/name of a diffusers-format Wan pipeline, "
            "e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
        ) from None
    except hub_errors.RevisionNotFoundError:
        raise AttentionConfigError(
            f"--model-path '{repo_id}': revision '{revision}' does not exist; accepted: a "
            "branch, tag or commit of the repository"
        ) from None
    except Exception as exc:  # connection failures come as several types across huggingface_hub/httpx versions
        raise AttentionConfigError(
            f"--model-path '{repo_id}'{at} is not in the local Hugging Face cache ({where}) and the Hugging Face Hub "
            f"({constants.ENDPOINT}) cannot be reached: {_short(exc)}"
        ) from None
    sys.stderr.write(f"downloading {repo_id}{at} from the Hugging Face Hub into {where}\n")
    try:
        from diffusers import DiffusionPipeline

        folder = DiffusionPipeline.download(repo_id, revision=revision, cache_dir=cache_dir, variant=variant)
    except Exception as exc:
        raise AttentionConfigError(f"--model-path '{repo_id}'{at}: the download failed: {_short(exc)}") from None
    gone = missing_components(str(folder))
    if gone is None:
        raise AttentionConfigError(
            f"--model-path '{repo_id}' is not a diffusers-format pipeline (no model_index.json "
            "in the repository); use the -Diffusers repository of the model"
        )
    if gone:
        raise AttentionConfigError(
            f"--model-path '{repo_id}': the download lacks component folder(s) {', '.join(gone)}; run it again"
        )
    return str(folder)
