"""The lessons as modules: where the repository is, and how one lesson loads another.

Lesson files start with a digit so that they sort in reading order (NN_name.py), which makes
them impossible to import with an ``import`` statement; importlib takes any module name. The package itself loads no lesson (tests/test_lesson_imports.py).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def load_lesson(name: str):
    """Import a lesson by its file name, with or without ".py"."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    return importlib.import_module(name.removesuffix(".py"))
