"""One check: the ``fusec`` that Python imported is this package, not a folder that shadows it.

A folder named ``fusec`` without an ``__init__.py`` on ``sys.path`` before the installed package
(a clone of the repository in the directory a script runs from: its root is such a folder)
makes ``import fusec`` a namespace package. Its submodules still load from the installed
package, so ``torch.compile(backend="fusec")`` starts, but ``fusec/__init__.py`` never ran: no
``__version__``, no HF generate() hooks, and the first failure comes from deep inside a compile.
"""
from __future__ import annotations

import sys


def check_package() -> None:
    """Raise where ``sys.modules["fusec"]`` is not this package.

    Raises:
        ImportError: ``import fusec`` found a namespace package (the message names its folders
            and what to do).
    """
    pkg = sys.modules.get("fusec")
    if pkg is None or getattr(pkg, "__file__", None) is not None:
        return
    where = ", ".join(str(p) for p in getattr(pkg, "__path__", [])) or "?"
    raise ImportError(f"'import fusec' found the folder {where}, not the fusec package: a folder named "
                      f"fusec without __init__.py (for example a clone of the fusec repository) lies on "
                      f"sys.path before the installed package, usually in the directory the script runs "
                      f"from. Run from another directory or rename that folder.")
