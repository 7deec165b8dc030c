"""Model references (user/repo[@revision][:QUANT]) and which files of a repository they load:
parsed in one place, with no network (the Hub client is not called here)."""

import pytest

from roseinfer import ModelLoadError
from roseinfer.models.model_store import ModelRef, parse_model_ref, select_files

GGUF_REPO = [
    "README.md", "model-Q4_K_M.gguf", "model-Q8_0.gguf", "mmproj-model-f16.gguf",
    "BF16/model-BF16-00001-of-00002.gguf", "BF16/model-BF16-00002-of-00002.gguf",
]


def test_references_parse_and_paths_stay_local(tmp_path):
    assert parse_model_ref("user/repo") == ModelRef("user/repo")
    assert parse_model_ref("user/repo:q8_0") == ModelRef("user/repo", None, "q8_0")
    assert parse_model_ref("hf.co/user/repo@v1.0:Q4_K_M") == ModelRef("user/repo", "v1.0", "Q4_K_M")
    for local in ("/abs/model.gguf", "./model.gguf", "~/m", "model.gguf", "a/../b", "a/b/c"):
        assert parse_model_ref(local) is None, local


def test_a_gguf_repo_gives_the_quant_its_shards_and_mmproj():
    default = select_files(ModelRef("u/r"), GGUF_REPO)
    assert default.model_file == "model-Q4_K_M.gguf" and default.mmproj == "mmproj-model-f16.gguf"
    assert default.files == ["model-Q4_K_M.gguf", "mmproj-model-f16.gguf"]
    assert default.quants == ["BF16", "Q4_K_M", "Q8_0"]
    split = select_files(ModelRef("u/r", quant="bf16"), GGUF_REPO)
    assert split.files[:2] == ["BF16/model-BF16-00001-of-00002.gguf", "BF16/model-BF16-00002-of-00002.gguf"]
    with pytest.raises(ModelLoadError, match=r"u/r has no Q5_K_M GGUF file; its quants: BF16, Q4_K_M, Q8_0"):
        select_files(ModelRef("u/r", quant="Q5_K_M"), GGUF_REPO)
    with pytest.raises(ModelLoadError, match="lacks its shard"):
        select_files(ModelRef("u/r", quant="BF16"), GGUF_REPO[:-1])


def test_a_transformers_repo_gives_safetensors_and_tokenizer_never_pickles():
    names = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "pytorch_model.bin",
             "README.md"]
    assert select_files(ModelRef("u/r"), names).files == ["config.json", "model.safetensors", "tokenizer.json",
                                                         "tokenizer_config.json"]
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        select_files(ModelRef("u/r"), ["config.json", "pytorch_model.bin"])


# -- against a Hub stand-in (tests/hub_standin.py): the real huggingface_hub client downloads ------

import hashlib  # noqa: E402
from pathlib import Path  # noqa: E402

from gguf_split import split_gguf  # noqa: E402
from hub_standin import HubStandin  # noqa: E402
from support import tiny_hf_model, write_llama_gguf  # noqa: E402

from roseinfer.models.model_store import pull, resolve_model  # noqa: E402

REPO = "rose/tiny-GGUF"
GATED = "rose/gated-GGUF"
TOKEN = "hf_standin_token"


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory) -> dict[str, Path]:
    """One tiny llama (rows of 256 values, so that K-quants fit) as Q8_0, F16 and Q4_K (random
    blocks: gguf cannot quantize K-quants), and the Q8_0 file split in shards."""
    root = tmp_path_factory.mktemp("ggufs")
    model = tiny_hf_model("llama-256", root / "hf")
    files = {}
    for quant, matrix_type, random in (("Q8_0", "Q8_0", False), ("F16", "F16", False), ("Q4_K_M", "Q4_K", True)):
        files[quant] = root / f"tiny-{quant}.gguf"
        write_llama_gguf(model, root / "hf", files[quant], "llama", matrix_type, random_blocks=random)
    (root / "split").mkdir()
    for shard in split_gguf(files["Q8_0"], root / "split" / "tiny-Q8_0.gguf", max_tensors=8):
        files[f"Q8_0/{shard.name}"] = shard
    return files


@pytest.fixture(scope="module")
def hub(tiny_ggufs):
    with HubStandin() as standin:
        # v1: one file per quant; main: the Q8_0 re-uploaded split in shards, and an F16 added.
        standin.add_repo(REPO, {"README.md": b"# tiny v1\n", "tiny-Q4_K_M.gguf": tiny_ggufs["Q4_K_M"],
                                "tiny-Q8_0.gguf": tiny_ggufs["Q8_0"]}, tag="v1")
        shards = {name: path for name, path in tiny_ggufs.items() if name.startswith("Q8_0/")}
        standin.add_repo(REPO, {"README.md": b"# tiny\n", "tiny-Q4_K_M.gguf": tiny_ggufs["Q4_K_M"],
                                "tiny-F16.gguf": tiny_ggufs["F16"]} | shards)
        standin.add_repo(GATED, {"tiny-Q4_K_M.gguf": tiny_ggufs["Q4_K_M"]}, gated_token=TOKEN)
        standin.add_repo("rose/evil-GGUF", {"../../evil-Q4_K_M.gguf": b"GGUF"})
        hf_dir = tiny_ggufs["Q8_0"].parent / "hf"  # the transformers model the GGUFs were written from
        standin.add_repo("rose/tiny-hf", {p.name: p for p in hf_dir.iterdir() if p.is_file()}
                         | {"pytorch_model.bin": b"never fetched", "README.md": b"# tiny\n"})
        yield standin


@pytest.fixture
def hub_env(hub, tmp_path, monkeypatch) -> Path:
    """huggingface_hub pointed at the stand-in, with an empty cache of its own."""
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    for name in ("HF_HUB_OFFLINE", "HF_TOKEN", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    hub.requests.clear()
    return cache


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_pull_downloads_the_quants_file_and_the_default_is_q4_k_m(hub, hub_env, tiny_ggufs):
    path = pull(parse_model_ref(f"{REPO}:Q4_K_M"), progress=False)
    assert path.name == "tiny-Q4_K_M.gguf" and hub_env in path.parents
    assert _sha256(path) == _sha256(tiny_ggufs["Q4_K_M"])
    assert pull(parse_model_ref(REPO), progress=False) == path  # no quant: Q4_K_M, as llama-server and Ollama
    # The LFS file came from the "CDN" the resolve URL redirected to; the README was not fetched.
    assert any(p.startswith("/cdn/") for p in hub.paths("GET"))
    assert not any("README" in p for p in hub.paths())


def test_a_split_model_by_name_loads_as_the_unsplit_file(hub, hub_env, tiny_ggufs):
    from roseinfer.engine.llm import LLM
    from roseinfer.sampling_params import SamplingParams

    path, name = resolve_model(f"{REPO}:q8_0")
    assert name == f"{REPO}:q8_0" and path.name == "tiny-Q8_0-00001-of-00003.gguf"
    assert sorted(p.name for p in path.parent.iterdir()) == [p.removeprefix("Q8_0/") for p in sorted(tiny_ggufs)
                                                             if p.startswith("Q8_0/")]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = [list(LLM(model, num_kv_blocks=16).generate(prompt_token_ids=[[5, 9, 30, 31]], sampling_params=greedy,
                                                         use_tqdm=False)[0].outputs[0].token_ids)
              for model in (f"{REPO}:Q8_0", str(tiny_ggufs["Q8_0"]))]
    assert tokens[0] == tokens[1]


def test_a_revision_is_pinned_by_tag_or_commit(hub, hub_env, tiny_ggufs):
    v1 = pull(parse_model_ref(f"{REPO}@v1:Q8_0"), progress=False)
    assert v1.name == "tiny-Q8_0.gguf" and _sha256(v1) == _sha256(tiny_ggufs["Q8_0"])
    commit = hub.repos[REPO].refs["v1"]
    assert v1.parent.name == commit  # the snapshot of that commit
    assert pull(parse_model_ref(f"{REPO}@{commit}:Q8_0"), progress=False) == v1
    main = pull(parse_model_ref(f"{REPO}:Q8_0"), progress=False)
    assert main.name == "tiny-Q8_0-00001-of-00003.gguf" and main.parent.parent.name == hub.repos[REPO].refs["main"]
    with pytest.raises(ModelLoadError, match=r"rose/tiny-GGUF has no revision 'v9'"):
        pull(parse_model_ref(f"{REPO}@v9"), progress=False)


def test_what_is_not_there_is_a_clear_error(hub, hub_env, monkeypatch):
    with pytest.raises(ModelLoadError, match=r"rose/tiny-GGUF has no Q5_K_M GGUF file; its quants: F16, Q4_K_M, Q8_0"):
        pull(parse_model_ref(f"{REPO}:Q5_K_M"), progress=False)
    with pytest.raises(ModelLoadError, match=r"'rose/nothing-here' not found on http://127.*HF_TOKEN"):
        pull(parse_model_ref("rose/nothing-here"), progress=False)
    with pytest.raises(ModelLoadError, match=r"rose/gated-GGUF is gated: .*HF_TOKEN"):
        pull(parse_model_ref(GATED), progress=False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert pull(parse_model_ref(GATED), progress=False).name == "tiny-Q4_K_M.gguf"
    # A name that could write outside the cache is refused before anything is fetched.
    with pytest.raises(ModelLoadError, match="not a plain path inside the repository"):
        pull(parse_model_ref("rose/evil-GGUF"), progress=False)
    assert not any("/resolve/" in p and "evil" in p for p in hub.paths())


def test_offline_mode_loads_from_the_cache_without_a_request(hub, hub_env, monkeypatch):
    pulled = pull(parse_model_ref(f"{REPO}:F16"), progress=False)
    hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model(f"{REPO}:F16") == (pulled, f"{REPO}:F16")
    assert pull(parse_model_ref(f"{REPO}:F16"), progress=False) == pulled
    with pytest.raises(ModelLoadError, match=r"rose/tiny-GGUF:Q8_0 is not in the local model cache .* offline"):
        resolve_model(f"{REPO}:Q8_0")
    assert hub.requests == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert resolve_model(f"{REPO}:F16") == (pulled, f"{REPO}:F16")  # in the cache: no request either
    assert hub.requests == []


def test_a_corrupt_download_is_an_error_and_a_cut_one_resumes(hub, hub_env, tiny_ggufs):
    hub.corrupt.add("tiny-F16.gguf")
    try:
        with pytest.raises(ModelLoadError, match=r"tiny-F16.gguf: its checksum [0-9a-f]+ is not the Hub's"):
            pull(parse_model_ref(f"{REPO}:F16"), progress=False)
    finally:
        hub.corrupt.discard("tiny-F16.gguf")
    assert not list(hub_env.rglob("tiny-F16.gguf")) and not [
        p for p in hub_env.rglob("blobs/*") if p.stat().st_size == tiny_ggufs["F16"].stat().st_size]
    assert pull(parse_model_ref(f"{REPO}:F16"), progress=False).name == "tiny-F16.gguf"


def test_a_cut_download_resumes_where_it_stopped(hub, hub_env):
    # huggingface_hub writes what it received in chunks of 10 MiB: a cut after 12 MiB resumes from 10.
    big = bytes(range(256)) * (20 * 4096)  # 20 MiB
    hub.add_repo("rose/big-GGUF", {"big-Q4_K_M.gguf": big})
    hub.cut_once.add("big-Q4_K_M.gguf")  # the whole length announced, 12 MiB sent, the connection dropped
    path = pull(parse_model_ref("rose/big-GGUF"), progress=False)
    assert path.read_bytes() == big
    gets = [(p, r) for m, p, r in hub.requests if m == "GET" and p.startswith("/cdn/")]
    assert [r for _, r in gets] == [None, f"bytes={10 << 20}-"]


def test_roseinfer_pull_prints_the_path(hub, hub_env, tiny_ggufs):
    import os
    import subprocess
    import sys

    env = os.environ | {"PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run([sys.executable, "-m", "roseinfer.cli", "pull", f"hf.co/{REPO}:Q4_K_M"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip().splitlines()[-1])
    assert hub_env in path.parents and _sha256(path) == _sha256(tiny_ggufs["Q4_K_M"])
    local = subprocess.run([sys.executable, "-m", "roseinfer.cli", "pull", "./model.gguf"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert local.returncode == 2 and "is not a Hub model reference" in local.stderr


def test_a_transformers_repo_by_name_loads_its_safetensors(hub, hub_env, tiny_ggufs):
    from roseinfer.engine.llm import LLM
    from roseinfer.sampling_params import SamplingParams

    path, _ = resolve_model("rose/tiny-hf")
    local = tiny_ggufs["Q8_0"].parent / "hf"
    assert path.is_dir() and (path / "config.json").is_file() and not (path / "pytorch_model.bin").exists()
    assert {p.name for p in path.iterdir()} == {p.name for p in local.iterdir() if p.suffix != ".md"} - {"README.md"}
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = [list(LLM(model, num_kv_blocks=16).generate(prompt_token_ids=[[5, 9, 30, 31]], sampling_params=greedy,
                                                         use_tqdm=False)[0].outputs[0].token_ids)
              for model in ("rose/tiny-hf", str(local))]
    assert tokens[0] == tokens[1]


def test_serve_by_name_downloads_at_startup_and_serves_under_the_reference(hub, hub_env, tiny_ggufs):
    import httpx
    from live_server import ServerProcess

    from roseinfer.engine.llm import LLM
    from roseinfer.sampling_params import SamplingParams

    env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(hub_env), "PYTHONPATH": str(Path(__file__).parents[1])}
    server = ServerProcess("--model", f"{REPO}:Q8_0", "--num-kv-blocks", "16", env=env)
    try:
        assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == [f"{REPO}:Q8_0"]
        assert httpx.get(server.url + "/api/tags").json()["models"][0]["name"] == f"{REPO}:Q8_0"
        served = httpx.post(server.url + "/v1/completions", json={
            "model": f"{REPO}:Q8_0", "prompt": [5, 9, 30, 31], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}).json()["choices"][0]["text"]
    finally:
        assert server.stop() == 0, server.output()
    assert any("/resolve/" in p for p in hub.paths("HEAD"))
    llm = LLM(str(tiny_ggufs["Q8_0"]), num_kv_blocks=16)
    local = llm.generate(prompt_token_ids=[[5, 9, 30, 31]], sampling_params=SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    assert served == local
