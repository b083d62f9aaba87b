"""Where a benchmark result was measured: the one provenance record every result JSON carries.

Schema ``graphtune.provenance/1`` (:data:`SCHEMA`), every field present (``None`` when unknown):

* ``schema``: this schema's name and version;
* ``gpu``, ``gpu_slug`` (file-name form, ``"h200"``), ``compute_capability`` (``"9.0"``),
  ``gpu_memory_gib``, ``sm_count``, ``l2_cache_bytes``, ``gpu_count``: the device (GPU fields are
  ``None`` without CUDA);
* ``device``: the device measured on (``"cuda:0"``, ``"cpu"``);
* ``torch``, ``cuda``, ``triton``, ``transformers``, ``graphtune``, ``python``, ``platform``:
  the software;
* ``commit``: the source commit (:func:`git_commit`);
* ``command``: the command line that produced the result;
* ``utc``: when (ISO 8601, seconds).

Result values beside it: a non-finite float is written as ``null``, "not measured" (strict JSON
has no NaN), except in a correctness check (:data:`CHECK_FIELDS`: a largest logits difference),
where ``null`` would read as "not checked": there it is the text ``"nan"``, ``"inf"`` or
``"-inf"`` (:func:`graphtune.bench.results.json_safe`).
"""

from __future__ import annotations

import datetime as _dt
import platform
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from graphtune import env
from graphtune._version import __version__

SCHEMA = "graphtune.provenance/1"
#: The fields of a provenance record, in the order they are written.
FIELDS = (
    "schema",
    "gpu",
    "gpu_slug",
    "compute_capability",
    "gpu_memory_gib",
    "sm_count",
    "l2_cache_bytes",
    "gpu_count",
    "device",
    "torch",
    "cuda",
    "triton",
    "transformers",
    "graphtune",
    "python",
    "platform",
    "commit",
    "command",
    "utc",
)

#: Result fields holding a correctness check, whose non-finite value stays visible in the JSON.
CHECK_FIELDS = frozenset({"graph_max_abs_diff", "tuned_max_abs_diff", "hf_max_abs_diff"})


def gpu_slug(name: str) -> str:
    """File-name friendly GPU name: ``"NVIDIA H200"`` -> ``"h200"``."""
    text = re.sub(r"^\s*nvidia\s+", "", name, flags=re.IGNORECASE).lower()
    text = re.sub(r"[^a-z0-9]+", "-", text).strip("-")
    return text or "unknown"


def git_commit(explicit: str | None = None) -> str:
    """The commit a result belongs to.

    Order: ``explicit`` (for example a ``--commit`` flag), then ``GRAPHTUNE_COMMIT``
    (:func:`graphtune.env.source_commit`; the device copy of the tree may lack ``.git``), then
    ``git rev-parse HEAD`` in the source tree (with ``-dirty`` when tracked files have local
    changes) when that tree's repository tracks this file, then ``"unknown"``.
    """
    if explicit:
        return explicit
    named = env.source_commit()
    if named:
        return named
    source = Path(__file__).resolve()
    here = source.parent
    try:
        # An install inside another repository's work tree (a virtual environment in a project
        # folder) would record that project's commit: only a repository tracking this very file
        # is graphtune's source.
        tracked = subprocess.run(
            ["git", "ls-files", "--error-unmatch", source.name],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if tracked.returncode != 0:
            return "unknown"
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}-dirty" if head and dirty else (head or "unknown")


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def command_line() -> str:
    """This process's command line: ``graphtune bench ...``, ``python3 -m graphtune ...`` or
    ``python3 benchmarks/script.py ...``."""
    argv = sys.argv or [""]
    first = Path(argv[0])
    python = Path(sys.executable).name or "python"
    if first.name == "__main__.py":
        program = f"{python} -m {first.parent.name}"
    elif first.suffix == ".py":
        program = f"{python} {argv[0]}"
    else:
        program = first.name or python
    return " ".join([program, *argv[1:]])


def provenance(
    commit: str | None = None,
    device: torch.device | str | None = None,
    *,
    command: str | None = None,
) -> dict[str, Any]:
    """The provenance record (schema :data:`SCHEMA`, see the module docstring).

    Args:
        commit: Commit to record (see :func:`git_commit` for the fallbacks).
        device: The device measured on; default the current CUDA device when CUDA is available,
            else the CPU. GPU fields are filled for a CUDA device.
        command: The command line to record; default :func:`command_line`.

    Returns:
        A JSON-serialisable dict with every field of :data:`FIELDS`.
    """
    if device is None:
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu"
    device = torch.device(device)
    info: dict[str, Any] = dict.fromkeys(FIELDS)
    info.update(
        schema=SCHEMA,
        gpu_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        device=str(device),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        triton=_package_version("triton"),
        transformers=_package_version("transformers"),
        graphtune=__version__,
        python=platform.python_version(),
        platform=platform.platform(),
        commit=git_commit(commit),
        command=command if command is not None else command_line(),
        utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            gpu_slug=gpu_slug(props.name),
            compute_capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            sm_count=props.multi_processor_count,
            l2_cache_bytes=getattr(props, "L2_cache_size", None),
        )
    return info


def is_provenance(record: Any) -> bool:
    """Whether ``record`` is a provenance record of this schema (every field present)."""
    return (
        isinstance(record, dict) and record.get("schema") == SCHEMA and set(FIELDS) <= set(record)
    )
