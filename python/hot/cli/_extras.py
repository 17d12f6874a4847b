"""What a command needs beyond hot's own dependencies, checked before it starts any work: a missing package is named
with the pip command and the extra of pyproject.toml ([project.optional-dependencies]) that installs it."""
from __future__ import annotations

import importlib.util

#: module -> (its PyPI package, the extra that installs it)
PACKAGES = {"torch": ("torch", "torch"), "sklearn": ("scikit-learn", "demo"), "matplotlib": ("matplotlib", "analysis")}


def require(cmd: str, extras: str, *modules: str) -> None:
    """Raise ImportError naming the packages among ``modules`` that are not installed, for ``hot <cmd>``, whose
    requirements the extras ``extras`` (e.g. "demo,analysis") install. The CLI prints it as
    ``hot <cmd>: error: ...``."""
    missing = [PACKAGES[m][0] for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise ImportError(f"needs {' and '.join(missing)}, which {verb} not installed: pip install {' '.join(missing)} "
                          f"(or pip install 'hot[{extras}]')")
