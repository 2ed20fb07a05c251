"""The README's Python snippets run as written (executed in order, sharing one namespace)."""

from __future__ import annotations

import re

from tests.conftest import REPO


def test_readme_python_snippets_run() -> None:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 3
    namespace: dict[str, object] = {}
    for block in blocks:
        if block.startswith("# multi-process example"):
            continue  # would re-launch this process; tests/recipes run the same code paths
        exec(compile(block, "README.md", "exec"), namespace)
    assert "result" in namespace and "trainer" in namespace
