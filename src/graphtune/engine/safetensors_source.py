"""Reading a checkpoint folder's files: its JSON files (:func:`read_json`) and its named tensors
from the safetensors files transformers' ``from_pretrained`` reads (:class:`TensorSource`): the
file ``config.json``'s ``transformers_weights`` names, else ``model.safetensors``, else the shards
of ``model.safetensors.index.json``, never another ``*.safetensors`` file; each failure a
:class:`~graphtune.errors.CheckpointError` that names the file."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import torch

from graphtune.errors import CheckpointError
from graphtune.finite_json import NonFiniteNumber, parse_json

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_INDEX_SUFFIX = ".safetensors.index.json"

# safetensors' dtype codes of the floating-point dtypes transformers' dtype="auto" can pick
# (it skips float8 and float4 tensors); other codes stay strings.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}

# Elements of each tensor's first row in the checkpoint's mark (:meth:`TensorSource.mark`).
_MARK_ELEMENTS = 64


class TensorSource:
    """Reads named tensors from one or more safetensors files, checking names and shapes: the
    files of ``folder`` that transformers reads for the parsed ``config.json`` ``config_doc``."""

    def __init__(self, folder: Path, config_doc: dict[str, Any]) -> None:
        try:
            from safetensors import safe_open
        except ImportError as exc:
            raise CheckpointError(
                "loading a checkpoint needs the 'safetensors' package: "
                "pip install 'graphtune[models]'"
            ) from exc
        self._safe_open = safe_open
        self._handles: dict[Path, Any] = {}
        self.read: set[str] = set()
        self._mark = hashlib.sha256()
        files, self.index_metadata = _shard_files(_weights_file(folder, config_doc), folder)
        self.shards = files
        ignored = sorted(f.name for f in set(folder.glob("*.safetensors")) - set(files))
        if ignored:
            logger.info(
                "%s: not reading %s (transformers reads only %s)",
                folder,
                ", ".join(ignored),
                ", ".join(sorted({f.name for f in files})),
            )
        self.files: dict[str, Path] = {}
        for file in files:
            handle = self._handles[file] = self._open(file)
            for name in handle.keys():
                if name in self.files:
                    logger.warning(
                        "%s: tensor %r is in both %s and %s; using %s's, as transformers does",
                        folder,
                        name,
                        self.files[name].name,
                        file.name,
                        file.name,
                    )
                self.files[name] = file

    def _open(self, file: Path) -> Any:
        try:
            return self._safe_open(str(file), framework="pt")
        except Exception as exc:  # safetensors raises its own error types; keep the cause.
            raise CheckpointError(
                f"{file} is not a readable safetensors file ({exc}); it may be truncated or "
                "corrupt: download it again"
            ) from None

    def _handle(self, file: Path) -> Any:
        if file not in self._handles:
            self._handles[file] = self._open(file)
        return self._handles[file]

    def has(self, name: str) -> bool:
        return name in self.files

    def auto_dtype(self) -> tuple[Any, str]:
        """The dtype transformers' ``dtype="auto"`` takes from the weights when ``config.json``
        names none, and where it came from: the index's ``metadata.dtype`` (a name, as written),
        else the first floating-point tensor, float8 and float4 aside, of the first file in the
        file's key order, else that file's first tensor (``torch.float32`` for an empty file).
        Only the files' headers are read."""
        if isinstance(self.index_metadata, dict) and "dtype" in self.index_metadata:
            return self.index_metadata["dtype"], "the index's metadata.dtype"
        file = self.shards[0]
        handle = self._handle(file)
        first = None
        for name in handle.keys():
            try:
                code = handle.get_slice(name).get_dtype()
            except Exception as exc:  # safetensors raises its own error types; keep the cause.
                raise CheckpointError(f"could not read tensor {name!r} from {file}: {exc}") from exc
            dtype = _SAFETENSORS_DTYPES.get(code, code)
            if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
                return dtype, f"{file.name}'s first floating-point tensor {name!r}"
            if first is None:
                first = dtype, f"{file.name}'s first tensor {name!r} (none is floating-point)"
        return first or (torch.float32, f"{file.name}, which has no tensor")

    def mark(self) -> str:
        """A digest of a sample of every tensor read so far: the first elements of its first
        row, which every tensor-parallel rank reads whatever its shard (so ranks that loaded
        different checkpoints of one shape are told apart, :mod:`graphtune.engine.arguments`)."""
        return self._mark.hexdigest()

    def unread(self) -> list[str]:
        """Tensors of the checkpoint that no :meth:`get` call read."""
        return sorted(set(self.files) - self.read)

    def get(
        self, name: str, shape: tuple[int, ...], part: tuple[int, int, int] | None = None
    ) -> torch.Tensor:
        """Returns tensor ``name`` after checking it exists and has ``shape``.

        With ``part = (dim, rank, parts)`` only slice ``rank`` of ``parts`` equal slices along
        ``dim`` (0 or 1) is read from the file (tensor-parallel loading).
        """
        file = self.files.get(name)
        if file is None:
            raise CheckpointError(f"checkpoint is missing the tensor {name!r} (expected {shape})")
        handle = self._handle(file)
        self.read.add(name)
        try:
            if part is None:
                tensor = handle.get_tensor(name)
                actual = tuple(tensor.shape)
            else:
                lazy = handle.get_slice(name)
                actual = tuple(lazy.get_shape())
        except Exception as exc:  # safetensors raises its own error types; keep the cause.
            raise CheckpointError(f"could not read tensor {name!r} from {file}: {exc}") from exc
        if actual != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {actual} but config.json implies "
                f"{tuple(shape)}; the config and the weights do not belong together"
            )
        if part is not None:
            dim, rank, parts = part
            size = shape[dim] // parts
            index = slice(rank * size, (rank + 1) * size)
            sample = lazy[0:1]
            tensor = lazy[index] if dim == 0 else lazy[:, index]
        else:
            sample = tensor[:1] if tensor.dim() > 1 else tensor
        sample = sample.reshape(-1)[:_MARK_ELEMENTS].contiguous()
        self._mark.update(name.encode() + sample.view(torch.uint8).numpy().tobytes())
        return tensor


def _weights_file(folder: Path, config_doc: dict[str, Any]) -> Path:
    """The file transformers' ``from_pretrained`` reads weights from, in its order: the file
    ``config.json``'s (``config_doc``) ``transformers_weights`` names, else
    ``model.safetensors``, else ``model.safetensors.index.json``; never any other
    ``*.safetensors`` file."""
    config = folder / "config.json"
    explicit = config_doc.get("transformers_weights")
    if explicit is not None:
        where = f"{config}: transformers_weights={explicit!r}"
        if not isinstance(explicit, str) or not explicit.endswith((".safetensors", _INDEX_SUFFIX)):
            raise CheckpointError(
                f"{where} must name a *.safetensors or *{_INDEX_SUFFIX} file in the folder "
                "(graphtune does not read .bin files); fix the file"
            )
        base = os.path.abspath(folder)
        try:
            inside = os.path.commonpath([base, os.path.abspath(folder / explicit)]) == base
        except ValueError:
            inside = False
        if not inside:
            raise CheckpointError(f"{where} must name a file inside the folder; fix the file")
        if not (folder / explicit).is_file():
            raise CheckpointError(f"{where} names a file the folder lacks; download it again")
        return folder / explicit
    for name in (WEIGHTS_NAME, INDEX_NAME):
        if (folder / name).is_file():
            return folder / name
    if (folder / "pytorch_model.bin").is_file() or (
        folder / "pytorch_model.bin.index.json"
    ).is_file():
        raise CheckpointError(
            f"{folder} has PyTorch .bin weights, which graphtune does not read; re-save the "
            "checkpoint with save_pretrained(safe_serialization=True)"
        )
    stray = sorted(f.name for f in folder.glob("*.safetensors"))
    also = f" (transformers does not read {', '.join(stray)} either)" if stray else ""
    raise CheckpointError(
        f"{folder} has no {WEIGHTS_NAME} or {INDEX_NAME}{also}; download the whole checkpoint"
    )


def _shard_files(chosen: Path, folder: Path) -> tuple[list[Path], Any]:
    """``[chosen]``, or the shards the index ``chosen`` lists, sorted by name as transformers
    reads them (a tensor in two shards takes the later one's copy there); and the index's
    ``metadata`` (``None`` without an index)."""
    if not chosen.name.endswith(_INDEX_SUFFIX):
        return [chosen], None
    index = read_json(chosen)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{chosen} has no 'weight_map' object; re-save the checkpoint with "
            "save_pretrained(safe_serialization=True)"
        )
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file or Path(file).anchor or ".." in Path(file).parts:
            raise CheckpointError(
                f"{chosen}: weight_map[{name!r}]={file!r} must be the name of a shard file in "
                "the folder; fix the index or download the checkpoint again"
            )
    # Shard names are relative to the model folder, as in transformers, wherever the index is.
    files = [folder / file for file in sorted(set(weight_map.values()))]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(
            f"{chosen} lists shard files that are not in the folder: {missing[:3]}; "
            "download the whole checkpoint"
        )
    return files, index.get("metadata")


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``.

    Raises:
        CheckpointError: The file cannot be read, is not valid JSON (``NaN`` and ``Infinity``,
            which Python's ``json`` accepts, are not JSON), holds a number too large for a
            float, or is not a JSON object.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} cannot be read ({exc})") from None
    try:
        doc = parse_json(text)
    except NonFiniteNumber as exc:
        where = f"{exc.field}={exc.constant}" if exc.field is not None else exc.constant
        raise CheckpointError(f"{path}: {where} {exc.problem}; fix the file") from None
    except ValueError as exc:
        raise CheckpointError(
            f"{path} is not valid JSON ({exc}); it may be truncated: download it again"
        ) from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path} holds a JSON {type(doc).__name__}, not an object")
    return doc
