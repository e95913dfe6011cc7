"""Every notebook in experiments/notebooks executes top to bottom on 8 CPU virtual devices without an error.

Each runs in a fresh kernel (nbclient) in a temporary directory (its PNGs land there; the setup cell finds
the checkout through the editable install); the kernel inherits this process's
XLA_FLAGS and gets the suite's persistent compile cache through SHARDKIT_JAX_CACHE.
"""

from __future__ import annotations

from pathlib import Path

import nbclient  # the dev extra installs nbclient, nbformat and ipykernel
import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "experiments" / "notebooks").glob("*.ipynb"))


def test_there_are_three_notebooks():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_long_context.ipynb", "03_planning_4d.ipynb"]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path, monkeypatch):
    import jax

    monkeypatch.setenv("SHARDKIT_JAX_CACHE", jax.config.jax_compilation_cache_dir or str(tmp_path / "jax"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    assert "REPO_URL" in nb.cells[1].source and "ON_COLAB" in nb.cells[1].source
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})  # fmt: skip
    client.execute()  # raises CellExecutionError (with the cell and traceback) on any error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
