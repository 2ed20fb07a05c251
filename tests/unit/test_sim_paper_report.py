"""The side-by-side with the paper: the summary arithmetic on hand-made cells, and the
``+report=paper`` recipe run end to end (structure, not the paper's numbers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_moe_ckpt.errors import ConfigError
from moe_recipes.sim import paper_values as paper
from moe_recipes.sim.paper_report import Cell, _ordering, _summary, compare_with_paper
from tests.conftest import REPO


def cell(row: str, policy: str, published: float, simulated: float,
         quantity: str = "ettr") -> Cell:
    return Cell("table3", row, 60.0, policy, quantity, published, simulated)


def test_summary_is_mean_and_max_absolute_ettr_deviation_in_points() -> None:
    cells = [cell("a", "gemini", 0.90, 0.93), cell("b", "gemini", 0.80, 0.79),
             cell("a", "moevement", 0.95, 0.95),
             cell("a", "gemini", 57, 70, quantity="interval")]  # not an ETTR: left out
    summary = _summary(cells)["table3"]
    assert summary["gemini"]["mean_abs_points"] == pytest.approx(2.0)  # (3 + 1) / 2
    assert summary["gemini"]["max_abs_points"] == pytest.approx(3.0)
    assert summary["gemini"]["cells"] == 2
    assert summary["moevement"]["max_abs_points"] == 0.0
    assert cells[0].deviation == pytest.approx(0.03)


def test_ordering_compares_the_ranking_of_policies_per_row_and_mtbf() -> None:
    same = [cell("a", "gemini", 0.90, 0.80), cell("a", "moevement", 0.95, 0.97)]
    swapped = [cell("b", "gemini", 0.90, 0.99), cell("b", "moevement", 0.95, 0.97)]
    assert _ordering(same + swapped)["table3"] == {"a@60min": True, "b@60min": False}


def test_published_tables_are_complete() -> None:
    for rows, minutes in ((paper.TABLE3, paper.TABLE3_MTBF_MINUTES),
                          (paper.TABLE7, paper.TABLE7_MTBF_MINUTES)):
        for row in rows.values():
            assert set(row.ettr) == set(paper.POLICIES)
            assert all(len(values) == len(minutes) for values in row.ettr.values())
            assert all(0 < v < 1 for values in row.ettr.values() for v in values)
    assert all(len(row.gemini_interval) == 3 for row in paper.TABLE7.values())


def run(out_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(REPO / "src")}
    return subprocess.run(
        [sys.executable, str(REPO / "recipes/simulate.py"), f"out_dir={out_dir}",
         "sim.monte_carlo.runs=4", *overrides],
        cwd=out_dir, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_report_paper_prints_the_side_by_side_and_writes_json(tmp_path: Path) -> None:
    done = run(tmp_path, "+report=paper")
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "paper_comparison.json").read_text())
    tables = {c["table"] for c in data["cells"]}
    assert tables == {"table3", "table7", "fig11"}
    table3 = [c for c in data["cells"] if c["table"] == "table3" and c["quantity"] == "ettr"]
    assert len(table3) == 4 * 5 * 4  # models x MTBFs x policies
    for c in data["cells"]:
        assert c["deviation"] == pytest.approx(c["sim"] - c["paper"])
    assert set(data["summary"]["table3"]) == set(paper.POLICIES)
    assert "ranking as in the paper" in done.stdout and "table7:" in done.stdout
    # The ordinary outputs keep their shape alongside.
    simulated = json.loads((tmp_path / "simulate.json").read_text())
    outcome = simulated["rows"][0]["outcomes"]["moevement"]
    assert {"ettr", "overhead", "total_recovery_s", "interval"} <= set(outcome)
    assert {"label", "gpus", "mtbf_minutes", "ettr"} <= set(simulated["scale"][0])


def test_unknown_report_is_refused_naming_the_key(tmp_path: Path) -> None:
    done = run(tmp_path, "+report=tables")
    assert done.returncode != 0 and "report='tables'" in done.stderr


def test_report_without_the_papers_plans_says_which_to_set() -> None:
    sim = OmegaConf.to_container(OmegaConf.load(REPO / "conf/sim/paper.yaml"), resolve=True)
    assert isinstance(sim, dict)
    del sim["plans"]["qwen_moe"]
    with pytest.raises(ConfigError, match=r"sim\.plans\.qwen_moe"):
        compare_with_paper({"sim": sim}, REPO / "conf")


def test_one_parser_reads_both_tables_layouts() -> None:
    text = """
    # comment lines and blank lines are skipped
a   57  3   2 - 8 1
    60  0.90 0.91 0.40 0.98  -  -  -
    10  0.70 0.72 0.15 0.95  -  -  -
b   77  4   3 - - 2   # Table 7 style: per-MTBF Gemini interval and overheads
    60  0.80 0.81 0.50 0.97  71  -  39
    10  0.60 0.62 0.30 0.96  27  10 117
"""
    minutes, rows = paper.parse_table(text)
    assert minutes == (60.0, 10.0)
    a, b = rows["a"], rows["b"]
    assert a.ettr["moc"] == (0.40, 0.15) and a.checkfreq_interval == 57 and a.window == 3
    assert a.overhead == pytest.approx({"checkfreq": 0.02, "moc": 0.08, "moevement": 0.01})
    assert a.gemini_interval == () and a.mtbf_overhead is None
    assert b.gemini_interval == (71, 27)
    assert b.mtbf_overhead is not None
    assert b.mtbf_overhead["gemini"] == (None, pytest.approx(0.10))
    assert b.mtbf_overhead["moc"] == (pytest.approx(0.39), pytest.approx(1.17))


@pytest.mark.parametrize(("text", "message"), [
    ("a 1 2 3 4 5\n", "row line needs 7 fields"),
    ("    60 1 1 1 1 - - -\n", "MTBF line needs 8 fields after a row line"),
    ("a 1 2 - - - -\n  60 .9 .9 .9 .9 - - -\nb 1 2 - - - -\n  30 .9 .9 .9 .9 - - -\n",
     "row b lists MTBFs"),
    ("a 1 2 - - - -\n  60 .9 .9 .9 .9 5 - -\n  30 .9 .9 .9 .9 - - -\n",
     "Gemini's interval for some MTBFs only"),
])
def test_the_parser_refuses_a_malformed_table(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        paper.parse_table(text)
