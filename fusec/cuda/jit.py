"""Compile CUDA C++ source to a CUBIN with NVRTC, with a disk cache.

NVRTC comes through cuda-python (``cuda.bindings.nvrtc``); each call returns ``(err, ...)`` and
each ``err`` is checked. Header folders for the CUDA runtime (``cuda_bf16.h``) and CCCL (which
``cuda_bf16.h`` includes) come from ``cuda.pathfinder.find_nvidia_header_directory``.
Per the NVRTC docs ("Supported Compile Options"), a real ``--gpu-architecture=sm_XX[a]`` makes
NVRTC run ptxas and emit a CUBIN, and ``--ptxas-options=-v`` puts the ptxas resource report into
the program log (NVRTC 13 rejects ``--resource-usage``).

Cache entries (``<key>.cubin`` + ``<key>.json`` with log, resources and the cubin's sha256) are
written to a temp file in the cache folder then ``os.replace``d, so concurrent processes see only
whole files; an entry that fails to load or verify is ignored and recompiled.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import struct
import tempfile
from pathlib import Path

from cuda.bindings import nvrtc

from fusec.errors import JitError

log = logging.getLogger("fusec.cuda.jit")

CACHE_FORMAT = 1
ELF_MAGIC = b"\x7fELF"
_BASE_OPTIONS = ("-std=c++17", "--ptxas-options=-v", "-default-device", "-lineinfo")


@dataclasses.dataclass
class CompiledKernel:
    """A CUBIN (ELF bytes, for ``cuModuleLoadData``) and what NVRTC/ptxas said about it.

    ``log`` is the NVRTC program log; ``resources`` is :func:`parse_ptxas_resources` output keyed
    by function name as ptxas prints it (mangled unless ``extern "C"``); ``nvrtc_version`` is
    ``(major, minor)``; ``cache_hit`` is True when NVRTC did not run.
    """

    cubin: bytes
    log: str
    resources: dict
    nvrtc_version: tuple[int, int]
    cache_hit: bool
    source: str

    def assert_no_spills(self) -> None:
        """Raise :class:`JitError` if any function spills or has a stack frame."""
        assert_no_spills(self)


def _check(result: tuple, what: str, name: str, prog_log: str = ""):
    """Unpack a cuda-bindings ``(err, *values)`` tuple; raise JitError unless err is SUCCESS."""
    err, rest = result[0], result[1:]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, text = nvrtc.nvrtcGetErrorString(err)
        msg = f"NVRTC {what} failed for {name!r}: {text.decode(errors='replace')}"
        raise JitError(msg + (f"\n{prog_log}" if prog_log else ""))
    return rest[0] if len(rest) == 1 else rest


def nvrtc_version() -> tuple[int, int]:
    """Return the NVRTC library version as ``(major, minor)``."""
    major, minor = _check(nvrtc.nvrtcVersion(), "nvrtcVersion", "<version>")
    return int(major), int(minor)


def include_dirs() -> list[str]:
    """Return the CUDA runtime and CCCL header folders (JitError if either is missing)."""
    from cuda import pathfinder

    dirs = {lib: pathfinder.find_nvidia_header_directory(lib) for lib in ("cudart", "cccl")}
    if missing := [lib for lib, d in dirs.items() if not d]:
        raise JitError(f"CUDA headers not found for {missing} (install nvidia-cuda-runtime/-cccl)")
    return [str(d) for d in dirs.values()]


_RE_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_RE_PROPS = re.compile(r"Function properties for (\S+)")
_RE_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_RE_USED = re.compile(r"Used (\d+) registers")
_RE_BARRIERS = re.compile(r"used (\d+) barriers")
_RE_BYTES = re.compile(r"(\d+) bytes (smem|lmem|cumulative stack size|cmem\[(\d+)\])")
_RE_CONST_SEC = re.compile(r"\.nv\.constant(\d+)(?:\.(.+))?")
_COUNTS = ("registers", "barriers", "stack_frame_bytes", "spill_store_bytes", "spill_load_bytes",
           "cumulative_stack_bytes", "smem_bytes", "lmem_bytes", "cmem_bytes")


def _empty_resources(entry: bool) -> dict:
    return {"entry": entry, **dict.fromkeys(_COUNTS, 0), "cmem_banks": {}}


def parse_ptxas_resources(text: str, cubin: bytes | None = None) -> dict:
    """Parse a ptxas ``-v`` report into ``{function: resources}``.

    Lines recognised (NVRTC 13 for sm_90a; the older ``cmem[N]``/``lmem`` forms too)::

        ptxas info    : Compiling entry function 'k' for 'sm_90a'
        ptxas info    : Function properties for k
        ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Used 10 registers, used 1 barriers, 512 bytes smem

    Values: ``entry`` (bool: a ``__global__``), ``registers``, ``barriers`` and byte counts
    ``stack_frame_bytes``, ``spill_store_bytes``, ``spill_load_bytes``,
    ``cumulative_stack_bytes``, ``smem_bytes`` (static shared), ``lmem_bytes``, ``cmem_bytes``
    (sum) and ``cmem_banks`` (``{"<bank>": bytes}``, str keys to survive JSON); absent = 0.
    NVRTC 13 prints no ``cmem``; when ``cubin`` is given, entries without it get it from the
    ELF sections ``.nv.constant<bank>.<fn>`` (bank 0: params) and ``.nv.constant<bank>``.
    """
    out: dict[str, dict] = {}
    cur = None
    for line in text.splitlines():
        if m := _RE_ENTRY.search(line):
            cur = m.group(1)
            out.setdefault(cur, _empty_resources(True))["entry"] = True
        elif m := _RE_PROPS.search(line):
            cur = m.group(1)
            out.setdefault(cur, _empty_resources(False))
        elif cur is not None and (m := _RE_FRAME.search(line)):
            res = out[cur]
            res["stack_frame_bytes"], res["spill_store_bytes"], res["spill_load_bytes"] = (
                int(g) for g in m.groups())
        elif cur is not None and (m := _RE_USED.search(line)):
            res = out[cur]
            res["registers"] = int(m.group(1))
            if b := _RE_BARRIERS.search(line):
                res["barriers"] = int(b.group(1))
            for num, kind, bank in _RE_BYTES.findall(line):
                if bank:
                    res["cmem_banks"][bank] = int(num)
                else:
                    res["cumulative_stack_bytes" if kind[0] == "c" else f"{kind}_bytes"] = int(num)
    sections = _elf_section_sizes(cubin) if cubin else {}
    for fn, res in out.items():
        if res["entry"] and not res["cmem_banks"]:
            for sec, size in sections.items():
                if (m := _RE_CONST_SEC.fullmatch(sec)) and m.group(2) in (None, fn) and size:
                    res["cmem_banks"][m.group(1)] = size
        res["cmem_bytes"] = sum(res["cmem_banks"].values())
    return out


def _elf_section_sizes(elf: bytes) -> dict[str, int]:
    """Return ``{section name: size in bytes}`` of a little-endian ELF64 image ({} if not one)."""
    try:
        if elf[:5] != ELF_MAGIC + b"\x02":
            return {}
        shoff, = struct.unpack_from("<Q", elf, 0x28)
        entsize, num, strndx = struct.unpack_from("<HHH", elf, 0x3A)
        heads = [struct.unpack_from("<IIQQQQ", elf, shoff + i * entsize) for i in range(num)]
        names = heads[strndx][4]
        return {elf[names + h[0]:elf.index(b"\0", names + h[0])].decode(): h[5] for h in heads}
    except (struct.error, ValueError, IndexError, UnicodeDecodeError):
        return {}


def assert_no_spills(kernel: CompiledKernel) -> None:
    """Raise :class:`JitError` naming every function with spills or a nonzero stack frame.

    A stack frame means local memory (a runtime-indexed local array or a spill), which the
    megakernel must not have: it is slow and its size scales with the resident threads.
    """
    fields = ("stack_frame_bytes", "spill_store_bytes", "spill_load_bytes",
              "cumulative_stack_bytes", "lmem_bytes")
    bad = [f"  {fn}: " + ", ".join(f"{f}={res[f]}" for f in fields if res.get(f))
           for fn, res in sorted(kernel.resources.items()) if any(res.get(f) for f in fields)]
    if bad:
        raise JitError("kernel uses local memory (spills or stack frame); reduce register "
                       "pressure or avoid runtime-indexed local arrays:\n" + "\n".join(bad))


def cache_folder(cache_dir: str | None = None) -> Path:
    """Return ``cache_dir``, else env ``FUSEC_CACHE_DIR``, else ``~/.cache/fusec``."""
    return Path(cache_dir or os.environ.get("FUSEC_CACHE_DIR") or Path.home() / ".cache" / "fusec")


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder and ``os.replace``: a
    concurrent reader sees the old file or the whole new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)   # mkstemp makes 0600: other users of a shared cache folder read it too
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load_cached(folder: Path, key: str) -> dict | None:
    """Return the cached ``{cubin, log, resources}`` or None if absent, partial or corrupt."""
    try:
        meta = json.loads((folder / f"{key}.json").read_text())
        cubin = (folder / f"{key}.cubin").read_bytes()
        if (meta.get("format") != CACHE_FORMAT or not cubin.startswith(ELF_MAGIC)
                or hashlib.sha256(cubin).hexdigest() != meta["cubin_sha256"]):
            raise ValueError("format, magic or checksum mismatch")
        return {"cubin": cubin, "log": meta["log"], "resources": meta["resources"]}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring corrupt cache entry %s in %s: %s", key, folder, exc)
        return None


def _nvrtc_compile(source: str, name: str, opts: list[str], ptx: bool = False) -> tuple[bytes, str]:
    """NVRTC's CUBIN of ``source`` (``ptx``: its PTX, for a virtual arch) and the program log."""
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []),
                  "nvrtcCreateProgram", name)
    try:
        encoded = [o.encode() for o in opts]
        compile_result = nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded)
        # A bytearray, never ``b" " * n``: NVRTC writes into it, and short bytes are interned.
        buf = bytearray(_check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize", name))
        _check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog", name)
        prog_log = bytes(buf).rstrip(b"\x00").decode(errors="replace").rstrip()
        _check(compile_result, "compilation", name, f"options: {' '.join(opts)}\n{prog_log}")
        size, get = ((nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX) if ptx
                     else (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN))
        out = bytearray(_check(size(prog), size.__name__, name))
        _check(get(prog, out), get.__name__, name)
        cubin = bytes(out)
    finally:
        if nvrtc.nvrtcDestroyProgram(prog)[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            log.warning("nvrtcDestroyProgram failed for %s", name)
    if ptx:
        return cubin.rstrip(b"\0"), prog_log
    if not cubin.startswith(ELF_MAGIC):
        raise JitError(f"NVRTC returned no CUBIN for {name!r} (is the arch a real sm_XX?)")
    return cubin, prog_log


def compile_ptx(source: str, name: str = "kernel.cu", arch: str = "compute_90a") -> str:
    """NVRTC's PTX of CUDA C++ ``source`` for the virtual ``arch`` (no cache, no ptxas): for
    reading which loads a device function issues before it uses them (tools/kernel_ptx.py).

    Raises:
        JitError: compilation failed (message: name, options, full NVRTC log).
    """
    opts = [f"--gpu-architecture={arch}", "-std=c++17", "-default-device", *(f"-I{d}" for d in include_dirs())]
    return _nvrtc_compile(source, name, opts, ptx=True)[0].decode()


def compile_cuda(source: str, name: str = "kernel.cu", arch: str = "sm_90a",
                 options: tuple[str, ...] = (), cache_dir: str | None = None) -> CompiledKernel:
    """Compile CUDA C++ ``source`` to a CUBIN for ``arch``, using the disk cache.

    ``name`` is the file name in diagnostics (``name(line): error: ...``); ``arch`` must be a
    real arch (``sm_90a``), a virtual one yields no CUBIN; ``options`` are appended after the
    defaults (``-DN=4``, ``--maxrregcount=128``); ``cache_dir`` defaults to env
    ``FUSEC_CACHE_DIR`` or ``~/.cache/fusec``.

    Raises:
        JitError: compilation failed (message: name, options, full NVRTC log), a header
            folder is missing, or no CUBIN was produced.
    """
    version = nvrtc_version()
    opts = [f"--gpu-architecture={arch}", *_BASE_OPTIONS,
            *(f"-I{d}" for d in include_dirs()), *options]
    # name is in the key: it appears in diagnostics and in the -lineinfo tables of the CUBIN.
    key_blob = json.dumps([CACHE_FORMAT, source, name, arch, opts, list(version)])
    key = hashlib.sha256(key_blob.encode()).hexdigest()
    folder = cache_folder(cache_dir)
    cached = _load_cached(folder, key)
    if cached is not None:
        log.debug("cache hit %s for %s", key[:12], name)
        return CompiledKernel(cached["cubin"], cached["log"], cached["resources"], version,
                              True, source)
    log.debug("compiling %s with NVRTC %d.%d: %s", name, *version, " ".join(opts))
    cubin, prog_log = _nvrtc_compile(source, name, opts)
    resources = parse_ptxas_resources(prog_log, cubin)
    log.debug("ptxas resources for %s: %s", name, resources)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        meta = {"format": CACHE_FORMAT, "name": name, "options": opts, "log": prog_log,
                "cubin_sha256": hashlib.sha256(cubin).hexdigest(), "resources": resources}
        atomic_write(folder / f"{key}.cubin", cubin)  # sidecar last: it vouches for the cubin
        atomic_write(folder / f"{key}.json", json.dumps(meta).encode())
    except OSError as exc:
        log.warning("could not write cache entry in %s: %s", folder, exc)
    return CompiledKernel(cubin, prog_log, resources, version, False, source)
