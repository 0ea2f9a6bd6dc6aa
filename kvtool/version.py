"""kvtool's version and the git revision it runs from (recorded in every report)."""

import subprocess
from pathlib import Path

__version__ = "0.1.0"


def git_revision() -> str:
    """Short git revision of the source tree, with '+dirty' for local changes; 'unknown' outside git.

    Changes under results/ do not count: benchmark runs rewrite the committed results there while
    they run, and the code that produced them is what the revision names."""
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)results"], cwd=root,
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")
