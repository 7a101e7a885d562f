"""The README and docs/ stay true: the site builds strictly, every link resolves, every snippet runs.

The Python blocks (```python) and the commands of the ```sh blocks that start with ``materialize`` run in a
folder holding tiny models under the names they use (``fixtures``). Where no GPU is present, ``cuda`` in a
snippet becomes ``cpu``; nothing else in a snippet is changed. The names a docs snippet uses without
defining them (``MyModel``, ``cfg``) are given in ``GIVEN`` below, and that is said in the page itself.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from conftest import TINY, hub_cache, reference_model, saved_state, write_sharded
from azure_server import AzureServer
from fake_hub import FakeHub
from gcs_server import GcsServer
from s3_server import S3Server
from vision import import_torchvision, pythonpath_with_shim
import preforked

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
CLI = str(Path(sys.executable).parent / "materialize")
GIVEN = {"docs/library.md": "from bench.models.transformer import DecoderLM as MyModel\n"
                            f"cfg = {TINY!r}\n"}


def fenced(path: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def on_this_machine(text: str) -> str:
    return text if torch.cuda.is_available() else text.replace('device="cuda"', 'device="cpu"').replace(
        "--device cuda", "--device cpu")


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the locked dev environment only")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], capture_output=True, text=True)

    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site" / "limits" / "index.html").is_file()


def slug(heading: str) -> str:
    """A heading's anchor, as GitHub and mkdocs make it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_relative_link_of_the_readme_and_docs_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a web address: not checked offline
            file, _, anchor = target.partition("#")
            resolved = (page.parent / file).resolve() if file else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md":
                anchors = {slug(h) for h in re.findall(r"^#+ (.+)$", resolved.read_text(), flags=re.M)}
                if anchor not in anchors:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")

    assert broken == []


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    """Every file the snippets name, tiny, and the environment their commands run in: with an S3 server holding
    ``s3://bucket/llama/``, a stand-in GCS holding ``gs://bucket/llama/`` (a service account's key for it), a
    stand-in Blob service holding ``az://container/llama/`` (a managed identity for it), and a stand-in hub serving
    ``tiny-org/tiny-llama``, all on 127.0.0.1 (docs/remote.md)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("moto")
    pytest.importorskip("google.auth")
    pytest.importorskip("azure.identity")
    if import_torchvision() is None:
        pytest.skip("timm and torchvision are not installed (make test-oldest's venvs)")
    import timm
    import torchvision

    folder = tmp_path_factory.mktemp("snippets")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=99)
    transformers.LlamaForCausalLM(config).save_pretrained(folder / "tiny-llama")
    save_file(saved_state(reference_model()), str(folder / "model.safetensors"))
    torch.save(timm.create_model("resnet50", pretrained=False, num_classes=10).state_dict(),
               folder / "resnet50-finetuned.pth")
    torch.save(torchvision.models.resnet50().state_dict(), folder / "resnet50.pth")
    mlp = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    save_file({k: v.contiguous() for k, v in mlp.state_dict().items()}, str(folder / "mlp.safetensors"))
    write_sharded(saved_state(reference_model()), folder / "checkpoints" / "llama")
    bert = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                   vocab_size=99, max_position_embeddings=64)
    transformers.BertModel(bert).save_pretrained(folder / "tiny-bert")
    cache = hub_cache(folder, folder / "tiny-llama", "tiny-org/tiny-llama")
    shutil.copytree(folder / "tiny-llama", folder / "hub" / "tiny-org" / "tiny-llama")
    (folder / "gcloud").mkdir()  # gcloud's configuration: none of this machine's
    with S3Server() as s3, FakeHub(folder / "hub") as hub, GcsServer(folder / "gcs") as gcs, \
            AzureServer(folder / "azure") as blobs:
        s3.make_bucket("bucket")
        gcs.make_bucket("bucket")
        blobs.make_container("container")
        for path in sorted((folder / "tiny-llama").iterdir()):
            s3.put("bucket", f"llama/{path.name}", path)
            gcs.put("bucket", f"llama/{path.name}", path)
            blobs.put("container", f"llama/{path.name}", path)
        google = {**gcs.env(), "GOOGLE_APPLICATION_CREDENTIALS": str(gcs.service_account_file(folder / "key.json")),
                  "CLOUDSDK_CONFIG": str(folder / "gcloud"), "NO_GCE_CHECK": "true"}
        azure = {**blobs.identity_env(), **blobs.no_identity_env(),
                 "AZURE_STORAGE_CONNECTION_STRING": blobs.connection_string()}
        env = {**pythonpath_with_shim(folder), **s3.env(), **google, **azure, "HF_HUB_CACHE": str(cache),
               "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": hub.endpoint}
        yield folder, env


def command_environment(line: str, env: dict[str, str]) -> dict[str, str]:
    """Offline, so that a cached repo is read from the cache alone; but --stream goes to the (stand-in) hub."""
    return {**env, "HF_HUB_OFFLINE": "0"} if "--stream" in line.split() else env


PYTHON_SNIPPETS = [(page, i) for page in PAGES for i, _ in enumerate(fenced(page, "python"))]


@pytest.mark.parametrize("page, index", PYTHON_SNIPPETS,
                         ids=[f"{p.relative_to(ROOT)}[{i}]" for p, i in PYTHON_SNIPPETS])
def test_a_python_snippet_runs(page, index, fixtures, monkeypatch):
    folder, env = fixtures
    for name in [n for n in env if n.startswith("AWS_")]:
        monkeypatch.setenv(name, env[name])  # an s3:// snippet reads the test server, as a command does
    code = on_this_machine(fenced(page, "python")[index])
    given = GIVEN.get(str(page.relative_to(ROOT)), "")
    monkeypatch.chdir(folder)

    namespace: dict = {}
    exec(compile(given + code, f"{page.name} block {index}", "exec"), namespace)

    assert isinstance(namespace.get("report"), __import__("materialize").Report)


COMMANDS = [(page, line) for page in PAGES for block in fenced(page, "sh") for line in block.splitlines()
            if line.startswith("materialize ")]


@pytest.mark.parametrize("page, line", COMMANDS, ids=[line.split("#")[0].strip() for _, line in COMMANDS])
def test_a_command_runs(page, line, fixtures):
    folder, env = fixtures
    args = on_this_machine(line.split("#")[0]).split()[1:]

    done = preforked.run([CLI, *args], capture_output=True, text=True, cwd=folder,
                          env=command_environment(line, env), timeout=300)

    assert done.returncode == 0, f"{page.relative_to(ROOT)}: {line}\n{done.stderr}"


def test_the_snippets_are_found():
    # A renamed fence (```py, ```bash) would silently drop a snippet from the runs above.
    assert len(PYTHON_SNIPPETS) >= 2 and len(COMMANDS) >= 5
    for page in PAGES:
        fences = re.findall(r"^```(\S*)$", page.read_text(), flags=re.M)
        assert set(fences) <= {"python", "sh", "text", ""}, (page.name, fences)
        assert all(lang for lang in fences[::2]), f"{page.name}: a code block without a language"


def test_the_api_reference_is_what_the_docstrings_make_and_names_everything(tmp_path):
    import dataclasses

    import materialize

    written = tmp_path / "api.md"
    done = subprocess.run([sys.executable, "-m", "tools.apiref", "--output", str(written)], cwd=ROOT,
                          capture_output=True, text=True)

    assert done.returncode == 0, done.stderr
    page = written.read_text()
    assert page == (ROOT / "docs" / "api.md").read_text(), "docs/api.md differs from the docstrings: make docs-api"
    assert set(re.findall(r"^### (?:class )?(\w+)$", page, flags=re.M)) == set(materialize.__all__)
    report = page.split("### class Report\n")[1].split("\n### ")[0]
    assert [f.name for f in dataclasses.fields(materialize.Report)] == re.findall(r"^\| `(\w+)` \| `", report, flags=re.M)
