"""Models by name: `user/repo[@revision][:QUANT]` resolved to files in the Hugging Face cache.

One place parses a model reference and turns it into a local path; everything after it (the
loader, the engine-core process, the server) sees only that path. A name that exists on disk is
a local path and never touches the network. A reference already in the cache loads without a
network call; `pull` always asks the Hub for the revision's current files.

Through `huggingface_hub` (its cache layout, HF_HOME / HF_HUB_CACHE, HF_ENDPOINT, HF_TOKEN,
HF_HUB_OFFLINE, its progress bars and its resumption of a cut download). What it does not do is
done here: every downloaded file is checked against the Hub's checksum (LFS sha256, or the git
blob id of a small file) before it can be a model, and a remote file name that could point out of
the cache is refused before anything is fetched.

A GGUF repository (llama-server's `-hf user/repo:QUANT`, Ollama's `hf.co/user/repo:QUANT`)
gives the one model file of the quant (Q4_K_M by default), every shard of it if it is split, and
its vision projector (mmproj*.gguf) if the repository has one; a transformers repository its
safetensors, configuration and tokenizer files.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from roseinfer.errors import ModelLoadError
from roseinfer.models.gguf_file import split_shard_paths

logger = logging.getLogger(__name__)

DEFAULT_QUANT = "Q4_K_M"  # llama-server's and Ollama's default for a GGUF repository
# user/repo, @revision (a branch, tag or commit), :QUANT; the Hub's own character rules.
_REF = re.compile(
    r"^(?:hf\.co/|huggingface\.co/)?(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)"
    r"(?:@(?P<revision>[\w./-]+?))?(?::(?P<quant>[\w.-]+))?$"
)
# Files a transformers repository is loaded from (weights: safetensors only, never pickles).
_HF_FILES = re.compile(
    r"^(config\.json|generation_config\.json|.*\.safetensors|model\.safetensors\.index\.json|tokenizer\.json|"
    r"tokenizer_config\.json|special_tokens_map\.json|added_tokens\.json|vocab\.json|merges\.txt|"
    r"tokenizer\.model|chat_template\.jinja|chat_template\.json|preprocessor_config\.json|"
    r"processor_config\.json)$"
)
# A GGUF file's quant in its name: Q4_K_M, IQ4_XS, Q8_0, F16, BF16, TQ1_0, MXFP4, ...
_QUANT_IN_NAME = re.compile(r"(?<![A-Za-z0-9])((?:I|T)?Q\d+(?:_[A-Z0-9]+)*|BF16|F16|F32|MXFP4(?:_MOE)?)(?![A-Za-z0-9])",
                            re.IGNORECASE)
_LOGIN_HINT = "for a private or gated repository, log in with `hf auth login` or set HF_TOKEN"


@dataclass(frozen=True)
class ModelRef:
    """A model named on the Hub."""

    repo_id: str
    revision: str | None = None  # None: the default branch
    quant: str | None = None  # a GGUF repository's quant; None: Q4_K_M, or its only file

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "") + (f":{self.quant}" if self.quant else "")


def parse_model_ref(model: str) -> ModelRef | None:
    """`user/repo[@revision][:QUANT]` as a ModelRef; None for anything else (a local path)."""
    if os.path.isabs(model) or model.startswith((".", "~")) or "\\" in model:
        return None
    match = _REF.match(model)
    if match is None or ".." in match["repo"] or (match["revision"] and ".." in match["revision"]):
        return None
    return ModelRef(match["repo"], match["revision"], match["quant"])


def is_local(model: str | None) -> bool:
    """Whether `model` is the default model or a path on disk (and so never touches the network)."""
    return model is None or Path(model).expanduser().exists() or parse_model_ref(model) is None


@dataclass
class RemoteFile:
    name: str  # the path in the repository
    size: int | None = None
    sha256: str | None = None  # LFS files
    blob_id: str | None = None  # git's sha1 of "blob <size>\0<content>" (small files)


@dataclass
class Selection:
    """What a reference loads: the files to fetch, and which of them is the model."""

    files: list[str]
    model_file: str | None  # a GGUF model's (first) file; None: the repository's directory
    mmproj: str | None = None
    quant: str | None = None
    quants: list[str] = field(default_factory=list)  # every quant a GGUF repository has


def quant_of(file_name: str) -> str | None:
    """The quant a GGUF file's name says (the last one in its path), upper-case."""
    found = _QUANT_IN_NAME.findall(PurePosixPath(file_name).as_posix())
    return found[-1].upper() if found else None


def select_files(ref: ModelRef, names: list[str]) -> Selection:
    """The files of the repository (`names`) that `ref` loads; an error naming the quants there
    when its quant is not."""
    ggufs = [n for n in names if n.lower().endswith(".gguf")]
    mmprojs = [n for n in ggufs if PurePosixPath(n).name.lower().startswith("mmproj")]
    # A split file counts as one model, by its first shard.
    models = []
    for name in ggufs:
        if name in mmprojs:
            continue
        shards = split_shard_paths(Path(name))
        if shards is None or Path(name) == shards[0]:
            models.append(name)
    if not models:
        if "config.json" not in names:
            raise ModelLoadError(f"{ref.repo_id} has neither GGUF files nor a config.json: not a model roseinfer loads")
        if ref.quant:
            raise ModelLoadError(f"{ref.repo_id} is a transformers repository (no GGUF files): it has no quant "
                                 f"{ref.quant!r}; name it without ':{ref.quant}'")
        files = [n for n in names if _HF_FILES.match(n)]
        if not any(n.endswith(".safetensors") for n in files):
            raise ModelLoadError(f"{ref.repo_id} has no *.safetensors weights (roseinfer never loads pickled "
                                 "pytorch_model.bin files from a hub)")
        return Selection(files, None)
    quants = sorted({q for q in map(quant_of, models) if q})
    wanted = (ref.quant or DEFAULT_QUANT).upper()
    matching = [m for m in models if quant_of(m) == wanted]
    if not matching and ref.quant is None and len(models) == 1:
        matching = models  # a repository with one model file: that one
    if not matching:
        raise ModelLoadError(
            f"{ref.repo_id} has no {wanted} GGUF file; its quants: {', '.join(quants) or 'none named'} "
            f"(name one as {ref.repo_id}:QUANT)"
        )
    if len(matching) > 1:
        raise ModelLoadError(f"{ref.repo_id} has several {wanted} GGUF models ({', '.join(matching)}): "
                             "put the file in a local directory and pass its path")
    model = matching[0]
    shards = split_shard_paths(Path(model))
    files = [model] if shards is None else [p.as_posix() for p in shards]
    missing = [f for f in files if f not in names]
    if missing:
        raise ModelLoadError(f"{ref.repo_id}: the split model {model} lacks its shard(s) {', '.join(missing)}")
    mmproj = None
    if mmprojs:  # the projector in the model's quant, else F16, else the first
        mmproj = next((m for m in mmprojs if quant_of(m) == wanted), None) or \
            next((m for m in mmprojs if quant_of(m) == "F16"), None) or sorted(mmprojs)[0]
        files.append(mmproj)
    return Selection(files, model, mmproj, quant_of(model), quants)


def _check_remote_name(ref: ModelRef, name: str) -> None:
    """A repository's file name is a relative path below the repository: nothing that could write
    elsewhere (an absolute path, `..`, a backslash, a drive) is ever fetched."""
    parts = name.split("/")
    if (not name or name.startswith("/") or "\\" in name or ":" in name or "\x00" in name
            or any(p in ("", ".", "..") for p in parts)):
        raise ModelLoadError(f"{ref.repo_id}: the Hub lists a file named {name!r}, which is not a plain path "
                             "inside the repository; refusing it")


def _verify(path: Path, remote: RemoteFile) -> None:
    """The downloaded file against the Hub's checksum; a mismatch removes it from the cache."""
    if remote.sha256:
        digest, expected = hashlib.sha256(), remote.sha256
    elif remote.blob_id:
        digest, expected = hashlib.sha1(), remote.blob_id
        digest.update(f"blob {path.stat().st_size}\0".encode())
    else:
        return
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    if digest.hexdigest() != expected.lower():
        blob = path.resolve()
        path.unlink(missing_ok=True)
        blob.unlink(missing_ok=True)
        raise ModelLoadError(f"{remote.name}: its checksum {digest.hexdigest()} is not the Hub's {expected}; "
                             "the download was corrupt and has been removed (pull again)")


@dataclass(frozen=True)
class HubSettings:
    """huggingface_hub's settings, read from the environment when a model is resolved (its own
    constants are read once, when it is first imported)."""

    endpoint: str
    cache_dir: str
    offline: bool
    token: str | None

    @classmethod
    def from_env(cls) -> HubSettings:
        from huggingface_hub import constants

        env = os.environ
        home = env.get("HF_HOME")
        cache = env.get("HF_HUB_CACHE") or (os.path.join(home, "hub") if home else constants.HF_HUB_CACHE)
        offline = env.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE") or constants.HF_HUB_OFFLINE
        endpoint = (env.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
        return cls(endpoint, cache, offline, env.get("HF_TOKEN") or None)


def _hub_error(ref: ModelRef, exc: Exception, hub: HubSettings) -> ModelLoadError:
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):
        return ModelLoadError(f"{ref.repo_id} is gated: accept its terms on the Hub, then {_LOGIN_HINT}")
    if isinstance(exc, RepositoryNotFoundError):
        return ModelLoadError(f"model repository {ref.repo_id!r} not found on {hub.endpoint} "
                              f"(check the name; {_LOGIN_HINT})")
    if isinstance(exc, RevisionNotFoundError):
        return ModelLoadError(f"{ref.repo_id} has no revision {ref.revision!r}")
    if isinstance(exc, (OfflineModeIsEnabled, LocalEntryNotFoundError)):
        return ModelLoadError(f"{ref} is not in the local model cache ({hub.cache_dir}) and the Hub "
                              f"cannot be reached (offline mode or no network): pull it first with "
                              f"`roseinfer pull {ref}`")
    return ModelLoadError(f"{ref}: the Hub at {hub.endpoint} answered: {exc}")


def _cached(ref: ModelRef, hub: HubSettings) -> Path | None:
    """The reference's model in the local cache, found without any network call; None if it (or
    any of its files) is not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(ref.repo_id, revision=ref.revision, cache_dir=hub.cache_dir,
                                          local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    names = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
    try:
        selection = select_files(ref, names)
    except ModelLoadError:
        return None
    return snapshot if selection.model_file is None else snapshot / selection.model_file


def pull(ref: ModelRef, progress: bool = True) -> Path:
    """Fetch (or bring up to date) the reference's files into the cache; the local path of its
    model (a GGUF file, or a transformers snapshot directory)."""
    from huggingface_hub import HfApi, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    hub = HubSettings.from_env()
    if hub.offline:
        cached = _cached(ref, hub)
        if cached is None:
            raise ModelLoadError(f"{ref} is not in the local model cache ({hub.cache_dir}) and offline mode "
                                 "(HF_HUB_OFFLINE) is on")
        return cached
    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    try:
        info = api.model_info(ref.repo_id, revision=ref.revision, files_metadata=True)
    except (HfHubHTTPError, OfflineModeIsEnabled, OSError) as exc:
        raise _hub_error(ref, exc, hub) from exc
    remote = {
        s.rfilename: RemoteFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None, s.blob_id)
        for s in info.siblings or []
    }
    for name in remote:
        _check_remote_name(ref, name)
    selection = select_files(ref, sorted(remote))
    logger.info("%s at %s: %s", ref, (info.sha or "")[:12], ", ".join(selection.files))
    if not progress:
        disable_progress_bars()
    try:
        paths: dict[str, Path] = {}
        for name in selection.files:
            cached = info.sha and try_to_load_from_cache(ref.repo_id, name, cache_dir=hub.cache_dir,
                                                         revision=info.sha)
            try:
                # The revision as named (so that refs/<branch> in the cache points at this commit).
                path = Path(hf_hub_download(ref.repo_id, name, revision=ref.revision, cache_dir=hub.cache_dir,
                                            endpoint=hub.endpoint, token=hub.token))
            except (HfHubHTTPError, OfflineModeIsEnabled, OSError) as exc:
                raise _hub_error(ref, exc, hub) from exc
            if not isinstance(cached, str):  # fetched now: checked once, before it can load
                _verify(path, remote[name])
            paths[name] = path
    finally:
        if not progress:
            enable_progress_bars()
    if selection.model_file is None:
        return paths["config.json"].parent
    return paths[selection.model_file]


def resolve_model(model: str, allow_download: bool = True) -> tuple[Path, str]:
    """`model` as a local path and the name it is served under: a path on disk as it is; a Hub
    reference from the cache, or pulled if it is not there (`allow_download`)."""
    path = Path(model).expanduser()
    if path.exists():
        return path, (path.stem if path.is_file() else path.name)
    ref = parse_model_ref(model)
    if ref is None:
        raise ModelLoadError(
            f"model {model!r} not found: pass a GGUF file, a local Hugging Face model directory "
            "(config.json + *.safetensors + tokenizer.json), a Hub repository as user/repo[:QUANT], "
            "or omit --model for the default model"
        )
    cached = _cached(ref, HubSettings.from_env())
    if cached is not None:
        return cached, str(ref)
    if not allow_download:
        raise ModelLoadError(f"{ref} is not in the local model cache, and pulling is off here "
                             f"(`roseinfer pull {ref}` first, or start the server with --allow-pull)")
    return pull(ref), str(ref)
