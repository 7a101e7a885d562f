"""docs/library.md's ``group=`` recipe, as written, on one rank a torchrun launcher started (test_group_loads.py).

Usage (cwd holding checkpoints/llama/): torchrun ... group_recipe.py OUT_FOLDER. Without CUDA the recipe's
``cpu:gloo,cuda:nccl`` becomes ``gloo`` and ``device="cuda"`` ``"cpu"``, as tests/test_docs.py runs snippets.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from bench.models.transformer import DecoderLM  # noqa: E402
from conftest import TINY, reference_model  # noqa: E402


def recipe() -> str:
    page = (ROOT / "docs" / "library.md").read_text()
    blocks = [textwrap.dedent(code) for _, code in re.findall(r"^( *)```python\n(.*?)^\1```", page, flags=re.S | re.M)]
    [code] = [block for block in blocks if "group=dist.group.WORLD" in block]
    if not torch.cuda.is_available():
        code = code.replace('"cpu:gloo,cuda:nccl"', '"gloo"').replace('device="cuda"', 'device="cpu"')
    return code


def main() -> None:
    out = Path(sys.argv[1])
    namespace: dict = {"MyModel": DecoderLM, "cfg": dict(TINY)}
    exec(compile(recipe(), "docs/library.md: the group= recipe", "exec"), namespace)
    dist, model, report = namespace["dist"], namespace["model"], namespace["report"]
    expected = reference_model().state_dict()
    result = {"rank": dist.get_rank(), "world": dist.get_world_size(), "node": os.environ.get("GROUP_NODE"),
              "equal": all(torch.equal(t, expected[n]) for n, t in model.state_dict().items()),
              "bytes_read": report.bytes_read, "received": report.bytes_received}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo's teardown at exit aborts now and then on its own; the result is written


if __name__ == "__main__":
    main()
