"""The ``fusec`` command line.

``fusec compile model.py [-o DIR] [--num-sms N] [--simulate] [--emit-cuda] [--run] [-v]`` loads
``model.py``, calls its ``build()`` (which returns ``(model, args)`` or ``(model, args, kwargs)``
for one decode step), compiles that step and writes the artifacts to ``DIR`` (default
``build/<model file stem>``): ``graph.txt`` (the fused op graph) and ``schedule.json`` (the
per-SM schedule). The human summary goes to stdout; stage lines go to stderr through
``logging``. ``--run`` (with a CUDA device) then builds the model on the GPU and prints the
compiled step's median time next to eager's (:mod:`fusec.runtime.timing`).

A problem with the model file or a :class:`fusec.errors.FusecError` while compiling is one line
on stderr (``fusec: error: ...``) and exit status 2, with no traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fusec.errors import FusecError, ModelFileError

log = logging.getLogger("fusec")

#: SM count assumed when none is given: the H200 / H100 SXM (the CLI may run with no GPU).
DEFAULT_NUM_SMS = 132

EXIT_USAGE = 2

#: ``--run``: timed steps (default of ``--run-steps``) and untimed warm-up steps per engine
RUN_STEPS = 20
RUN_WARMUP = 3
#: ``--run``: a larger relative error of the compiled step's logits against eager's is a failure.
#: A gross-error bound: two correct bf16 implementations of the 1B differ by ~3.5e-2
#: (benchmarks/decode.py, CHECK_TOL), a wrong kernel by order 1.
RUN_MAX_REL_ERR = 0.1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fusec",
        description="Compile one transformer decode step into a persistent megakernel.",
    )
    p.add_argument("-v", "--verbose", dest="verbose_top", action="store_true",
                   help="debug logging (also after the command)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    c = sub.add_parser(
        "compile",
        help="compile the decode step that model.py's build() returns",
        description=(
            "Load MODEL_PY, call its build() -> (model, args) or (model, args, kwargs) for one "
            "decode step, compile it and write graph.txt and schedule.json to the output folder."
        ),
    )
    c.add_argument("model_py", metavar="MODEL_PY", help="Python file defining build()")
    c.add_argument(
        "-o", "--out-dir", metavar="DIR", default=None,
        help="output folder (default: build/<model file stem>)",
    )
    c.add_argument(
        "--num-sms", metavar="N", type=_positive_int, default=None,
        help=f"number of SMs to schedule for (default: $FUSEC_NUM_SMS, else {DEFAULT_NUM_SMS})",
    )
    c.add_argument(
        "--simulate", action="store_true",
        help="run the schedule in the CPU simulator: deadlock and hazard check, plus a numeric "
             "check against eager for models that fit the simulator (see README)",
    )
    c.add_argument(
        "--numeric-limit-mib", metavar="MIB", type=_positive_float, default=None,
        help="--simulate compares values with eager for models with at most this many MiB of "
             "weights (default 256; larger ones get the structure-only check)",
    )
    c.add_argument(
        "--emit-cuda", action="store_true",
        help="also render the CUDA kernel and compile it with NVRTC (kernel.cu, kernel.cubin)",
    )
    c.add_argument(
        "--run", action="store_true",
        help="with a CUDA device: build the model again on it (build(device='cuda')), run it under "
             "torch.compile(backend='fusec') and print its median step time next to eager's; "
             "without one, print that it was skipped",
    )
    c.add_argument("--run-steps", metavar="N", type=_positive_int, default=None,
                   help=f"timed decode steps of --run, for fusec and for eager (default {RUN_STEPS})")
    c.add_argument(
        "--option", metavar="NAME=VALUE", action="append", type=_option, default=[],
        help="a fusec option, as options={NAME: VALUE} of torch.compile takes it (repeatable; VALUE a "
             "Python literal or a word: --option query_tokens=4 --option max_fusions=0); the flags "
             "above own num_sms, simulate, emit_cuda, out_dir and numeric_limit_bytes",
    )
    c.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    t = sub.add_parser(
        "timeline",
        help="draw the per-SM Gantt chart of a recorded step (timeline.json -> PNG)",
        description=(
            "Read a timeline.json written by a profiled step (option profile=True or "
            "FUSEC_PROFILE=dir) and draw SMs over time, coloured by instruction kind (needs matplotlib)."
        ),
    )
    t.add_argument("timeline_json", metavar="TIMELINE_JSON", help="timeline.json of a profiled step")
    t.add_argument("-o", "--out", metavar="PNG", default=None,
                   help="output PNG (default: next to the input, timeline.png)")
    t.add_argument("--title", default="", help="chart title")
    t.add_argument("--layer", type=int, default=None, metavar="N",
                   help="also print when each op of decoder layer N ran (its critical path)")
    t.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.set_defaults(subparsers={"compile": c, "timeline": t})
    return p


#: --numeric-limit-mib's default
NUMERIC_LIMIT_MIB = 256.0


def _positive_float(text: str) -> float:
    """argparse type: a number above 0 (a clear one-line error otherwise)."""
    try:
        v = float(text)
    except ValueError:
        v = 0.0
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
    return v


#: options the compile command's own flags set (--option cannot: one way to say each)
_FLAG_OPTIONS = {"simulate": "--simulate", "emit_cuda": "--emit-cuda", "out_dir": "-o/--out-dir",
                 "numeric_limit_bytes": "--numeric-limit-mib"}


def _option(text: str) -> tuple[str, Any]:
    """argparse type of ``--option NAME=VALUE``: (NAME, VALUE), VALUE a Python literal
    (``ast.literal_eval``: 4, 0.5, False, None, {'A': '1'}) or else the word itself."""
    import ast
    name, eq, value = text.partition("=")
    name = name.strip()
    if not eq or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    if name in _FLAG_OPTIONS:
        raise argparse.ArgumentTypeError(f"{name}: set it with {_FLAG_OPTIONS[name]}")
    try:
        return name, ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        return name, value.strip()


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value}")
    return value


class _Prefixed(logging.Formatter):
    """``fusec: <message>``, without a second prefix on messages that already start with one."""

    def format(self, record: logging.LogRecord) -> str:
        msg = super().format(record)
        return msg if msg.startswith("fusec: ") else "fusec: " + msg


@contextlib.contextmanager
def _cli_logging(verbose: bool) -> Iterator[None]:
    """Send the ``fusec`` loggers to stderr as ``fusec: <message>`` (INFO, or DEBUG with -v).

    The logger's previous state is restored on exit, so calling :func:`main` in-process (tests)
    leaves no handler bound to a stream that may since have been closed.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Prefixed())
    saved = (log.level, log.propagate)
    log.addHandler(handler)
    log.setLevel(logging.DEBUG if verbose else logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]


def _at(e: BaseException, p: Path) -> str:
    """`` (at file:line)`` for the deepest frame of ``e`` inside model file ``p``, or ""."""
    import traceback
    line = None
    for fr in traceback.extract_tb(e.__traceback__):
        if Path(fr.filename).resolve() == p.resolve():
            line = fr.lineno
    return f" (at {p.name}:{line})" if line else ""


def _where(e: BaseException, p: Path) -> str:
    """``Type: message (at file:line)`` for the deepest frame of ``e`` inside model file ``p``."""
    return f"{type(e).__name__}: {e}{_at(e, p)}"


def _check_out_dir(out_dir: Path) -> None:
    """Fail now, before the model is built and compiled, if ``out_dir`` cannot become the output
    folder: it is a file, a path under a file, or its nearest existing folder is read-only.

    Raises:
        FusecError: naming the folder and what is wrong.
    """
    where = f"output folder {str(out_dir)!r} (-o)"
    if out_dir.exists() and not out_dir.is_dir():
        raise FusecError(f"{where} is an existing file; give a folder (it is created if missing)")
    parent = out_dir
    while not parent.exists():
        if parent.parent == parent:
            break
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise FusecError(f"{where}: {str(parent)!r} is a file, so the folder cannot be created there")
    if parent.is_dir() and not os.access(parent, os.W_OK | os.X_OK):
        raise FusecError(f"{where}: {str(parent)!r} is not writable")


def load_model_file(path: str | os.PathLike, device: str | None = None) -> tuple[Any, tuple, dict]:
    """Run the model file ``path`` and return what its ``build()`` returns, normalized.

    With ``device``, calls ``build(device=device)`` (``--run``); ``build`` must then take a
    ``device`` argument.

    The file's folder is on ``sys.path`` while the file runs and while ``build()`` runs, so it
    can import helpers beside it. An exception raised by the file's own code becomes a
    ModelFileError naming the exception and the deepest line of the model file (-v: traceback).

    Returns:
        ``(model, args, kwargs)`` with ``args`` a tuple and ``kwargs`` a dict.

    Raises:
        ModelFileError: the file is missing, defines no callable ``build``, or ``build()``
            returns something other than ``(model, args)`` / ``(model, args, kwargs)`` with
            ``model`` an ``nn.Module``, ``args`` a tuple or list and ``kwargs`` a dict.
    """
    import runpy

    p = Path(path)
    if not p.is_file():
        what = "is a folder, not a file" if p.is_dir() else "does not exist"
        raise ModelFileError(f"model file {str(path)!r} {what}")
    folder = str(p.resolve().parent)
    sys.path.insert(0, folder)
    try:
        try:
            ns = runpy.run_path(str(p), run_name="__fusec_model__")
        except SyntaxError as e:
            raise ModelFileError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
        except SystemExit as e:   # sys.exit() in the file: an error, never the CLI's exit status
            raise ModelFileError(f"{path}: the file called sys.exit({e.code!r}) while it ran"
                                 f"{_at(e, p)}; a model file defines build() and must not exit "
                                 f"(put a script's main code under `if __name__ == '__main__':`)") from None
        except Exception as e:
            raise ModelFileError(f"{path}: running the file failed: {_where(e, p)}") from e
        build = ns.get("build")
        if not callable(build):
            raise ModelFileError(
                f"{path}: no build() function; it must define build() returning "
                "(model, args) or (model, args, kwargs) for one decode step"
            )
        if device is not None and not _takes_device(build):
            raise ModelFileError(
                f"{path}: build() takes no device argument; --run needs build(device=...) to build "
                "the model, its KV cache and inputs on the GPU (see examples/tiny_llama.py)"
            )
        t0 = time.perf_counter()
        try:
            result = build() if device is None else build(device=device)
        except SystemExit as e:
            raise ModelFileError(f"{path}: build() called sys.exit({e.code!r}){_at(e, p)}; it must "
                                 f"return (model, args) or (model, args, kwargs)") from None
        except Exception as e:
            raise ModelFileError(f"{path}: build() failed: {_where(e, p)}") from e
        log.debug("build() took %.1f s", time.perf_counter() - t0)
    finally:
        try:
            sys.path.remove(folder)
        except ValueError:
            pass
    return _check_build_result(path, result)


def _takes_device(fn: Any) -> bool:
    import inspect
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "device" and p.kind != p.POSITIONAL_ONLY or p.kind == p.VAR_KEYWORD
               for p in params)


def _check_build_result(path: str | os.PathLike, result: Any) -> tuple[Any, tuple, dict]:
    import torch

    expected = (
        "expected (model, args) or (model, args, kwargs) with model a torch.nn.Module, "
        "args a tuple or list and kwargs a dict"
    )
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        got = type(result).__name__
        if isinstance(result, (tuple, list)):
            got = f"a {got} of length {len(result)}"
        raise ModelFileError(f"{path}: build() returned {got}; {expected}")
    model, args = result[0], result[1]
    kwargs = result[2] if len(result) == 3 else {}
    if not isinstance(model, torch.nn.Module):
        raise ModelFileError(
            f"{path}: build() returned a {type(model).__name__} as model; {expected}"
        )
    if not isinstance(args, (tuple, list)):
        raise ModelFileError(f"{path}: build() returned a {type(args).__name__} as args; {expected}")
    if not isinstance(kwargs, dict):
        raise ModelFileError(
            f"{path}: build() returned a {type(kwargs).__name__} as kwargs; {expected}"
        )
    return model, tuple(args), kwargs


def cmd_compile(ns: argparse.Namespace) -> int:
    """Run ``fusec compile``: load the model file, compile, write artifacts, print the summary."""
    from fusec.config import Options
    # a bad FUSEC_* environment value, --option, --num-sms or output folder fails here, before
    # build() runs
    extra = dict(ns.option)
    if ns.num_sms:
        extra["num_sms"] = ns.num_sms
    Options.from_dict(extra)
    out_dir = Path(ns.out_dir) if ns.out_dir else Path("build") / Path(ns.model_py).stem
    _check_out_dir(out_dir)
    log.info("loading %s", ns.model_py)
    t0 = time.perf_counter()
    model, args, kwargs = load_model_file(ns.model_py)
    log.info("build() returned %s in %.1f s", type(model).__name__, time.perf_counter() - t0)

    from fusec.api import compile_model  # imported late: the checks above need none of the compiler

    num_sms = Options.from_dict(extra).num_sms or DEFAULT_NUM_SMS
    options = {
        **extra,
        "num_sms": num_sms,
        "simulate": ns.simulate,
        "numeric_limit_bytes": int((ns.numeric_limit_mib or NUMERIC_LIMIT_MIB) * (1 << 20)),
        "emit_cuda": ns.emit_cuda,
        "out_dir": str(out_dir),
    }
    log.info("compiling for %d SMs%s", num_sms, " and simulating" if ns.simulate else "")
    t0 = time.perf_counter()
    result = compile_model(model, args, kwargs, options=options)
    log.info("compiled in %.1f s", time.perf_counter() - t0)

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "graph.txt").write_text(result.graph_text())
        from fusec import jsonfmt   # compact: one line per instruction, op, buffer and SM queue
        (out_dir / "schedule.json").write_text(jsonfmt.dumps(result.schedule_json()) + "\n")
        if result.kernel is not None:
            (out_dir / "kernel.cu").write_text(result.cuda_source)
            (out_dir / "kernel.cubin").write_bytes(result.kernel.cubin)
        else:   # a kernel of an earlier --emit-cuda run would not match this schedule
            for stale in ("kernel.cu", "kernel.cubin"):
                if (out_dir / stale).is_file():
                    (out_dir / stale).unlink()
                    log.info("removed %s of an earlier --emit-cuda run", out_dir / stale)
    except OSError as e:
        raise ModelFileError(f"cannot write the output folder {str(out_dir)!r}: {e}") from None
    log.info("wrote %s%s", out_dir, " (graph.txt, schedule.json, kernel.cu, kernel.cubin)"
             if result.kernel is not None else " (graph.txt, schedule.json)")

    summary = result.format_summary()
    sys.stdout.write(summary if summary.endswith("\n") else summary + "\n")
    if ns.run:
        import torch
        if not torch.cuda.is_available():
            sys.stdout.write("no CUDA device: --run skipped\n")
        else:
            del model, args, kwargs, result    # the CPU copy (the 1B: 2.5 GB) is not needed
            run_step_timing(ns.model_py, "cuda", steps=ns.run_steps or RUN_STEPS, options=dict(ns.option) or None)
    return 0


def run_step_timing(model_py: str | os.PathLike, device: str, *, steps: int = RUN_STEPS,
                    warmup: int = RUN_WARMUP, options: dict[str, Any] | None = None) -> None:
    """``--run``: build the model on ``device``, time it under fusec and eager, print one line.

    Builds ``build(device=device)``, then :func:`fusec.runtime.timing.time_decode` (``warmup`` untimed
    and ``steps`` timed steps per engine, from the same KV state) with ``options`` (default:
    none, as ``torch.compile(model, backend="fusec")``; tests pass ``{"target": "sim"}``).

    Raises:
        ModelFileError: build() takes no device.
        FusecError: fusec fell back to another backend (the times would not be fusec's), or the
            compiled step's output is not within :data:`RUN_MAX_REL_ERR` of eager's.
    """
    from fusec.runtime.timing import time_decode
    log.info("--run: building %s on %s", model_py, device)
    model, args, kwargs = load_model_file(model_py, device=device)
    log.info("--run: %d warm-up and %d timed decode steps, fusec then eager", warmup, steps)
    t = time_decode(model, args, kwargs, steps=steps, warmup=warmup, options=options)
    if t.fallbacks:
        raise FusecError(
            f"--run: FUSEC FELL BACK, the compiled step did not run the fusec kernel "
            f"({len(t.fallbacks)} fallback line(s)): {t.fallbacks[0]}")
    if t.rel_err is not None and not t.rel_err <= RUN_MAX_REL_ERR:
        raise FusecError(f"--run: the compiled step's output differs from eager's on the same step: "
                         f"relative error {t.rel_err:.3g} (bound {RUN_MAX_REL_ERR:g})")
    sys.stdout.write(t.line() + "\n")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fusec`` console script; returns the process exit status.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).
    """
    parser = _parser()
    ns, extra = parser.parse_known_args(argv)
    sub = ns.subparsers[ns.command]
    if extra:   # the subcommand's usage, not the top-level one, for a misspelt flag
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
    if ns.command == "compile" and ns.run_steps is not None and not ns.run:
        sub.error("--run-steps needs --run (it sets how many steps --run times)")
    if ns.command == "compile" and ns.numeric_limit_mib is not None and not ns.simulate:
        sub.error("--numeric-limit-mib needs --simulate (it bounds the simulator's numeric check)")
    ns.verbose = ns.verbose or ns.verbose_top   # `fusec -v compile ...` as `fusec compile -v ...`
    with _cli_logging(ns.verbose):
        try:
            return _dispatch(ns)
        except FusecError as e:
            first, *rest = (str(e) or type(e).__name__).split("\n")
            if rest and not ns.verbose:
                first += f" (-v shows {len(rest)} more lines)"
            sys.stderr.write(f"fusec: error: {first}\n")
            if rest:
                log.debug("%s", "\n".join(rest))
            return EXIT_USAGE


def cmd_timeline(ns: argparse.Namespace) -> int:
    """``fusec timeline``: draw a saved timeline as a PNG and print its summary line."""
    from fusec.runtime.profile import MatplotlibMissing, render
    src = Path(ns.timeline_json)
    if not src.exists():
        raise FusecError(f"{src}: no such timeline file")
    if not src.is_file():
        raise FusecError(f"{src}: not a file (give the timeline.json a profiled step wrote)")
    out = Path(ns.out) if ns.out else src.with_name("timeline.png")
    rows = None
    if ns.layer is not None:      # check the layer before writing anything
        from fusec.runtime.profile import Timeline
        try:
            rows = Timeline.load(src).op_windows(ns.layer)
        except json.JSONDecodeError as e:
            raise FusecError(f"{src}: not valid JSON ({e})") from None
        except ValueError as e:
            raise FusecError(f"{src}: {e}") from None
        if not rows:
            raise FusecError(f"{src}: no instructions in layer {ns.layer}")
    try:
        s = render(src, out, title=ns.title)
    except MatplotlibMissing as e:
        raise FusecError(str(e)) from None
    except json.JSONDecodeError as e:
        raise FusecError(f"{src}: not valid JSON ({e})") from None
    except ValueError as e:
        raise FusecError(f"{src}: {e}") from None
    sys.stdout.write(f"{out}: {s['instructions']} instructions on {s['num_sms']} SMs, span {s['span_us']:.1f} us, "
                     f"mean idle share {s['idle_share_mean']:.1%}\n")
    if rows:
        sys.stdout.write(f"{'op':<28} {'kind':<20} {'tiles':>5} {'SMs':>4} {'ready us':>9} "
                         f"{'end us':>9} {'window':>7} {'busy':>6} {'GB/s':>7}  "
                         f"marks: median us after each tile's ready\n")
        for r in rows:
            marks = " ".join("-" if m is None else f"{m:.2f}" for m in r["marks_us"])
            sys.stdout.write(f"{r['op'][:28]:<28} {r['kind'][:20]:<20} {r['tiles']:>5} {r['sms']:>4} "
                             f"{r['first_ready']:>9.1f} {r['last_end']:>9.1f} {r['window_us']:>7.1f} "
                             f"{r['mean_busy_us']:>6.2f} {r['gbps_window']:>7.0f}  {marks}\n")
    return 0


def _dispatch(ns: argparse.Namespace) -> int:
    if ns.command == "compile":
        return cmd_compile(ns)
    if ns.command == "timeline":
        return cmd_timeline(ns)
    raise AssertionError(f"unhandled command {ns.command!r}")


if __name__ == "__main__":
    sys.exit(main())
