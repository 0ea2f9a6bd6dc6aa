"""The report code imports without kvtool's C++ extension or torch: the peers' venvs run it
(bench/peers/common.py) with only the repository on their path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# A None entry in sys.modules makes `import X` fail as if X were not installed.
SCRIPT = """
import sys
sys.modules["kvtool._core"] = None
sys.modules["torch"] = None
from kvtool.workloads.datasets import load_dataset
from kvtool.reports.metrics import RequestMetrics, summarize
from kvtool.reports.csv_report import RequestCsvWriter, write_summary_csv
from kvtool.reports.compare_table import load_variants
from kvtool.runtime.request import Request
from kvtool.errors import DatasetError
print("imported")
"""


def test_report_code_imports_without_the_extension_or_torch():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "imported"
