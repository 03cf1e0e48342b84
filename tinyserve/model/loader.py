"""Checkpoint loading: safetensors shards -> canonical weight names (specs/qwen35_moe.md §3-§4).

`CheckpointReader` reads headers up front and tensors one at a time; `iter_weights` yields
`(canonical_name, Tensor | LinearWeight)` after checking the whole checkpoint
(`loader_plan.plan_weights`). Every problem raises `CheckpointError` with one line naming the
file and the tensor.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from tinyserve.core import LinearWeight
from tinyserve.model.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
_TORCH_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
FLOAT_DTYPES = ("BF16", "F16", "F32")


class CheckpointError(ValueError):
    """A checkpoint's files or tensors do not match what its config describes."""


class TensorInfo(NamedTuple):  # where one tensor lives; dtype: the safetensors name
    name: str
    file: Path
    file_index: int
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class CheckpointReader:
    """Lazy reader over a directory of safetensors files (or one file): headers at
    construction, `get(name)` one tensor through a memory map. Raises CheckpointError."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.files = self._find_files()
        infos = [t for i, file in enumerate(self.files) for t in _read_header(file, i)]
        self._infos = {t.name: t for t in sorted(infos, key=lambda t: (t.file_index, t.offset))}
        self._handles: dict[Path, Any] = {}

    def _find_files(self) -> list[Path]:
        if self.path.is_file():
            return [self.path]
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: checkpoint directory not found")
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
            files = [self.path / f for f in sorted(set(weight_map.values()))]
            for f in files:
                if not f.is_file():
                    raise CheckpointError(f"{index}: shard file '{f.name}' is missing")
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path}: no .safetensors files found")
        return files

    def names(self) -> list[str]:
        """Every tensor name, in file order (shard, then byte offset)."""
        return list(self._infos)

    def info(self, name: str) -> TensorInfo:
        return self._infos[name]

    def tensor_info(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:  # from the header
        t = self._infos[name]
        return _TORCH_DTYPES.get(t.dtype, torch.uint8), t.shape

    def get(self, name: str, index: int | None = None) -> torch.Tensor:
        """Read one tensor (or its `index`-th row along dim 0) on CPU. FP8 comes back as uint8."""
        t = self._infos[name]
        try:
            handle = self._handle(t.file)
            tensor = handle.get_tensor(name) if index is None else handle.get_slice(name)[index]
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{t.file}: cannot read tensor '{name}' ({exc})") from None
        if t.dtype.startswith("F8_"):
            tensor = tensor.view(torch.uint8)
        return tensor

    def _handle(self, file: Path) -> Any:
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return self._handles[file]

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_header(file: Path, file_index: int) -> list[TensorInfo]:
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: file is truncated ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                raise CheckpointError(f"{file}: file is truncated ({size} bytes, its header "
                                      f"alone needs {8 + n})")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: not a valid safetensors file ({exc})") from None
    infos, end, base = [], 0, 8 + n
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = meta["data_offsets"]
            infos.append(TensorInfo(name, file, file_index, meta["dtype"], tuple(meta["shape"]),
                                    base + start, stop - start))
            end = stop if stop > end else end
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: tensor '{name}' has a malformed header") from None
    if 8 + n + end > size:
        raise CheckpointError(f"{file}: file is truncated ({size} bytes, its header needs "
                              f"{8 + n + end})")
    return infos


_SKIP_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
_HEAD_PREFIXES = ("lm_head.", "language_model.lm_head.")
_LM_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_EXPERT_RE = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")


def strip_prefix(raw: str) -> str | None:
    """Raw checkpoint key -> key without the language-model prefix; None for skipped keys
    (vision tower, MTP head). Unknown prefixes come back unchanged."""
    if raw.startswith(_SKIP_PREFIXES):
        return None
    for prefixes, new in ((_HEAD_PREFIXES, "lm_head."), (_LM_PREFIXES, "")):
        p = next((p for p in prefixes if raw.startswith(p)), None)
        if p is not None:
            return new + raw[len(p):]
    return raw


def parse_expert_name(name: str) -> tuple[int, int, str] | None:
    """'layers.3.mlp.experts.5.up_proj' -> (3, 5, 'up_proj'); None for other names."""
    m = _EXPERT_RE.match(name)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def iter_weights(
    path_or_reader: str | Path | CheckpointReader,
    config: ModelConfig,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    include_experts: bool = True,
    fuse: bool = True,
    on_entry: Callable[[int], None] | None = None,
) -> Iterator[tuple[str, torch.Tensor | LinearWeight]]:
    """Yield `(canonical_name, Tensor | LinearWeight)` for every weight, in file order.

    Dense weights and norms in `dtype` (default: float32 on CPU, else bfloat16), GDN
    A_log / dt_bias / norm in float32, `conv1d` as [C, K]; NVFP4 and FP8 stay packed. `fuse`:
    each `FUSED_LINEARS` group is concatenated on the host before it goes to `device`.
    `on_entry(nbytes)`: progress after each checkpoint entry. Raises CheckpointError.
    """
    from tinyserve.model.loader_plan import fused_group, plan_weights

    reader = path_or_reader if isinstance(path_or_reader, CheckpointReader) else \
        CheckpointReader(path_or_reader)
    device = torch.device(device)
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    pending: dict[str, dict[str, Any]] = {}  # fused name -> its parts read so far (host)
    try:
        for entry in plan_weights(reader, config):
            if not include_experts and entry.is_expert:
                continue
            group = fused_group(entry.name) if fuse else None
            if group is None:
                yield from entry.load(reader, dtype, device)
            else:
                got = pending.setdefault(group[0], {})
                got.update(entry.load(reader, dtype, torch.device("cpu")))
            if on_entry is not None:
                on_entry(entry.nbytes)
            if group is not None and len(got) == len(group[1]):
                del pending[group[0]]
                yield from _fuse(group[0], [(p, got.pop(p)) for p in group[1]], dtype, device)
        assert not pending, f"incomplete fused linears {sorted(pending)}"  # the plan has all
    finally:
        if reader is not path_or_reader:
            reader.close()


def _fuse(name: str, parts: list[tuple[str, LinearWeight]], dtype: torch.dtype,
          device: torch.device) -> Iterator[tuple[str, LinearWeight]]:
    """The host parts as one weight `name` on `device`, or each part when they cannot be."""
    from tinyserve.model.linear import concat_rows, to_device

    fused = concat_rows(*(w for _, w in parts))
    if fused is None:
        for part, w in parts:
            yield part, to_device(w, device, dtype)
    else:
        parts.clear()  # NOTE: the host parts go before the fused copy moves to the device
        yield name, to_device(fused, device, dtype)


def load_weights(path_or_reader: str | Path | CheckpointReader, config: ModelConfig,
                 **kwargs: Any) -> dict[str, torch.Tensor | LinearWeight]:
    return dict(iter_weights(path_or_reader, config, **kwargs))


def resolve_model_path(model: str) -> Path:
    """A local checkpoint directory, or a Hugging Face repo id downloaded to the local cache
    (CheckpointError when it is neither or the download fails)."""
    local = Path(model).expanduser()
    if local.is_dir():
        return local
    looks_local = model.startswith(("/", ".", "~")) or local.exists() or model.count("/") != 1
    if looks_local or not re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        raise CheckpointError(f"{model}: no such checkpoint directory")
    try:
        from huggingface_hub import snapshot_download

        got = snapshot_download(repo_id=model, allow_patterns=[
            "*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"])
    except Exception as exc:  # offline, 404, 401, network: all one message
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(f"{model}: not a local directory, and fetching it from the "
                              f"Hugging Face Hub failed ({type(exc).__name__}: {first})") from None
    return Path(got)
