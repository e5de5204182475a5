"""A front process runs no model: importing what it runs leaves the model stack unimported."""

from __future__ import annotations

import os
import subprocess
import sys

# What a front process imports first: the API over its engine core client, and the module
# `heron serve --api-server-count N` starts it as (beside the launcher's).
FRONT_MODULES = ["heron.server.front", "heron.server.api_server", "heron.server.api_servers"]
MODEL_CODE = ("heron.models", "heron.kernels", "heron.llm", "heron.engine.llm_engine")

CHECK = """
import sys
for name in {modules!r}:
    __import__(name)
print(sorted(m for m in sys.modules if m.startswith({model_code!r})))
"""


def test_a_front_imports_no_model_code():
    code = CHECK.format(modules=FRONT_MODULES, model_code=MODEL_CODE)
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert result.stdout.strip() == "[]"
