"""fusec: compile the PyTorch graph of a transformer decode step into one persistent
megakernel (CUDA on Hopper) or run its schedule on the CPU simulator.

Use it as ``torch.compile(model, backend="fusec")`` or through the CLI ``fusec compile``.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

__version__ = "0.1.0"

_HERE = Path(__file__).resolve().parent


def _load_tree_passes() -> None:
    """In a source checkout the passes live in the top-level ``passes/`` folder; an installed
    wheel ships them as ``fusec/passes``. Make ``fusec.passes`` importable either way.

    The checkout's own ``passes/`` wins over an editable install's mapping, so a second
    checkout run with ``PYTHONPATH`` uses its passes with its own ``fusec/`` and templates."""
    if "fusec.passes" in sys.modules or (_HERE / "passes" / "__init__.py").is_file():
        return
    init = _HERE.parent / "passes" / "__init__.py"
    if init.is_file():
        spec = importlib.util.spec_from_file_location("fusec.passes", init,
                                                      submodule_search_locations=[str(init.parent)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["fusec.passes"] = mod
        spec.loader.exec_module(mod)


_load_tree_passes()


def _after_transformers() -> None:
    """Install :func:`fusec.frontend.hf_generate.install` (HF generate() through one precompiled
    step), :func:`fusec.frontend.hf_device_loop.install` (its greedy search as fusec.generate's
    device loop) and :func:`fusec.frontend.hf_beam.install` (its beam search through the compiled
    step) now if transformers' ``modeling_utils`` is imported, else right after its import
    (a meta-path finder that wraps that one module's loader): ``import fusec`` stays light."""
    name = "transformers.modeling_utils"

    def install() -> None:
        try:
            from fusec.frontend import hf_beam, hf_device_loop, hf_generate
            hf_generate.install()
            hf_device_loop.install()
            hf_beam.install()
        except Exception:   # noqa: BLE001 - never break the user's import over this
            import logging
            logging.getLogger("fusec").debug("fusec: HF generate() hook not installed", exc_info=True)

    if name in sys.modules:
        install()
        return
    import importlib.abc

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)   # one shot: find the real spec with the other finders
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                install()
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())


_after_transformers()


def template_dir() -> Path:
    """Folder of the Jinja templates (package data when installed, ``templates/`` in a checkout)."""
    inside = _HERE / "templates"
    return inside if inside.is_dir() else _HERE.parent / "templates"


#: submodules a user reaches as attributes after ``import fusec`` (``fusec.fallbacks.FallbackWatch``)
_LAZY_MODULES = ("fallbacks", "config", "errors")


def __getattr__(name: str):
    """Lazy exports: ``fusec.generate`` (imports torch and transformers on first use),
    ``fusec.check_weights_at_next_call`` (:func:`fusec.frontend.value_snapshot.check_at_next_call`), and the
    submodules of :data:`_LAZY_MODULES` (imported on first use)."""
    if name == "generate":
        from fusec.generate import generate
        globals()["generate"] = generate
        return generate
    if name == "check_weights_at_next_call":
        from fusec.frontend.value_snapshot import check_at_next_call
        globals()[name] = check_at_next_call
        return check_at_next_call
    if name in _LAZY_MODULES:
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
