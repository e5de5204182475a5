"""Hub model ids resolved offline, against a Hugging Face cache the test lays out itself.

``huggingface_hub`` reads ``HF_HOME`` and ``HF_HUB_OFFLINE`` when it is imported, so the checks
run in a fresh interpreter started with them, as a user's ``heron serve owner/name`` would.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

MAIN, V1 = "a" * 40, "b" * 40  # commit hashes of the branches main and v1


def _cache_repo(hub_cache: Path, repo_id: str, commit: str, files: dict[str, Path]) -> Path:
    """Lay out ``files`` as huggingface_hub stores a snapshot: blobs by hash, symlinks."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name, src in files.items():
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


def _set_ref(hub_cache: Path, repo_id: str, ref: str, commit: str) -> None:
    refs = hub_cache / f"models--{repo_id.replace('/', '--')}" / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / ref).write_text(commit)


CHECKS = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import heron.loader.resolve as resolve
    from heron import LLM, SamplingParams

    def outcome(model, revision=None):
        try:
            return str(resolve.resolve_model_path(model, revision))
        except ValueError as e:
            return "error: " + str(e)

    result = {
        "main": outcome("owner/tiny"),
        "v1": outcome("owner/tiny", "v1"),
        "commit": outcome("owner/tiny", sys.argv[1]),
        "missing": outcome("owner/absent"),
        "missing_revision": outcome("owner/tiny", "v9"),
    }
    resolve.resolve_gguf = lambda path: Path("converted") / Path(path).name  # tested apart
    result["gguf"] = outcome("owner/tiny-gguf:quant/tiny.Q8_0.gguf")
    greedy = SamplingParams(temperature=0, max_tokens=6)
    llm = LLM("owner/tiny", revision="v1", device="cpu", max_model_len=64)
    result["text"] = llm.generate("Paris is", greedy, use_tqdm=False)[0].outputs[0].text
    print(json.dumps(result))
    """
)


def test_hub_ids_resolve_from_the_offline_cache(tiny_model_dir, tmp_path):
    from heron import LLM, SamplingParams

    main_model, v1_model = tiny_model_dir("qwen2"), tiny_model_dir("llama")
    hub = tmp_path / "hf" / "hub"
    main_dir = _cache_repo(hub, "owner/tiny", MAIN, {p.name: p for p in main_model.iterdir()})
    v1_dir = _cache_repo(hub, "owner/tiny", V1, {p.name: p for p in v1_model.iterdir()})
    _set_ref(hub, "owner/tiny", "main", MAIN)
    _set_ref(hub, "owner/tiny", "v1", V1)
    fake_gguf = tmp_path / "tiny.Q8_0.gguf"
    fake_gguf.write_bytes(b"GGUF")
    gguf_dir = _cache_repo(hub, "owner/tiny-gguf", MAIN, {"quant/tiny.Q8_0.gguf": fake_gguf})
    _set_ref(hub, "owner/tiny-gguf", "main", MAIN)

    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), *sys.path])
    done = subprocess.run(
        [sys.executable, "-c", CHECKS, MAIN],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["main"] == result["commit"] == str(main_dir)
    assert result["v1"] == str(v1_dir)
    assert result["gguf"] == str(Path("converted") / "tiny.Q8_0.gguf")
    assert Path(gguf_dir, "quant/tiny.Q8_0.gguf").resolve().read_bytes() == b"GGUF"
    for key, name in (("missing", "'owner/absent'"), ("missing_revision", "revision 'v9'")):
        assert result[key].startswith("error: model ") and name in result[key], result[key]
        assert f"cache {hub} (HF_HUB_OFFLINE is set)" in result[key]
    # The engine built from the hub id (revision v1: the llama) generates what the directory
    # itself does.
    want = LLM(str(v1_model), max_model_len=64).generate(
        "Paris is", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
    )
    assert result["text"] == want[0].outputs[0].text
    shutil.rmtree(tmp_path / "hf")
