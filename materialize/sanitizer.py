"""Check mode (``check=True``, ``--check``): prove every tensor was materialized exactly once.

Fresh allocations are filled with poison (a NaN with a recognisable payload
for floats, the byte 0xA5 for integers) and every byte read from the files is
counted per tensor. After the load, an audit proves that no tensor is left on
meta, no poison remains, every loaded tensor received exactly its bytes once,
every tie group is still one tensor, and every tensor has the planned device
and dtype. Any violation is a :class:`SanitizerError` naming the tensors.

Integer tensors of one byte count as poisoned only if every element is 0xA5,
since a real int8/uint8 tensor may well hold that value somewhere.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .checkpoint import TensorInfo
from .sources.fileio import CountingFiles
from .skeleton.meta import is_lazy
from .planning.plan import Entry, Plan
from .integrations.sharded import local_of
from .checkpoint.pieces import Job, pieces_of
from .io.validate import distinct_elements

_FLOAT_POISON_BITS = {
    torch.float64: 0x7FF8A5A5A5A5A5A5,
    torch.float32: 0x7FC5A5A5,
    torch.float16: 0x7E5A,
    torch.bfloat16: 0x7FC5,
}
_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_FP8_NAN = 0x7F  # e4m3fn has a single NaN pattern (and e5m2 counts 0x7F as NaN too)


def _poison_bits(dtype: torch.dtype) -> int:
    if dtype in _FLOAT_POISON_BITS:
        return _FLOAT_POISON_BITS[dtype]
    if dtype.is_floating_point and dtype.itemsize == 1:
        return _FP8_NAN
    return int.from_bytes(b"\xa5" * dtype.itemsize, "little", signed=dtype.itemsize > 1)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(_INT_VIEW[flat.element_size()]) if flat.element_size() in _INT_VIEW else flat


def poison(tensor: torch.Tensor) -> None:
    """Fill a fresh tensor with its dtype's poison pattern."""
    if tensor.numel() == 0 or tensor.element_size() not in _INT_VIEW or tensor.is_complex():
        return
    pattern = _poison_bits(tensor.dtype)
    bits = _bits(tensor)
    if bits.dtype == torch.uint8:
        pattern &= 0xFF
    elif pattern >= 2 ** (8 * bits.element_size() - 1):
        pattern -= 2 ** (8 * bits.element_size())  # as the signed integer of the same bits
    bits.fill_(pattern)


def is_poisoned(tensor: torch.Tensor) -> bool:
    if tensor.numel() == 0 or tensor.element_size() not in _INT_VIEW or tensor.is_complex():
        return False
    probe = torch.empty(1, dtype=tensor.dtype, device=tensor.device)
    poison(probe)
    matches = _bits(tensor) == _bits(probe)[0]
    one_byte_int = tensor.element_size() == 1 and not tensor.dtype.is_floating_point
    return bool(matches.all() if one_byte_int else matches.any())


def audit(plan: Plan, registered: Iterable[tuple[Entry, torch.Tensor]], counts: CountingFiles, mapped: set[str]) -> list[str]:
    """Every violation of "materialized exactly once, as planned", one line each."""
    problems = []
    for entry, tensor in registered:
        name = entry.name
        for owner in entry.owners[1:]:
            registry = owner.module._parameters if owner.is_parameter else owner.module._buffers
            if registry[owner.attr] is not tensor:
                problems.append(f"{name}: tie broken, {owner.attr} of a {type(owner.module).__name__} is another tensor")
        tensor = local_of(tensor)  # a DTensor's values are checked where this rank holds them, with no collective
        if tensor.is_meta:
            problems.append(f"{name}: still on meta")
            continue
        if tensor.device != entry.device and not entry.on_disk:
            problems.append(f"{name}: on {tensor.device}, planned {entry.device}")
        if tensor.dtype != entry.dtype and entry.action != "keep":
            problems.append(f"{name}: {tensor.dtype}, planned {entry.dtype}")
        if entry.action == "load" and entry.source is not None and name not in mapped:
            source = entry.source
            # Counted by name: a shard's several boxes of one checkpoint tensor are one name's bytes.
            read = sum(counts.bytes_by_tensor.get(name, 0) for name in {piece.info.name for piece in pieces_of(source)})
            least, most = map(sum, zip(*(_bytes_expected(piece.info) for piece in pieces_of(source))))
            if not least <= read <= most:
                expected = str(most) if least == most else f"{least} to {most}"
                problems.append(f"{name}: {read} bytes written from the file, {expected} expected")
        if entry.action != "keep" and is_poisoned(tensor):
            problems.append(f"{name}: still holds poison: never written")
    return problems


def audit_plain(jobs: Iterable[Job], counts: CountingFiles) -> list[str]:
    """Every violation of "read exactly once" in a load of plain tensors (:func:`~materialize.load_tensors`):
    each tensor read (those mapped are the files' own bytes) received exactly its bytes and holds no poison.
    Views of one storage share their job: it is audited once, under the name the read counted."""
    problems = []
    for job in jobs:
        name = job.info.name
        wrong = []
        # Counted by name: the chunks of a DCP tensor (a stacked source) each count under their own.
        pieces = pieces_of(job.info)
        read = sum(counts.bytes_by_tensor.get(piece_name, 0) for piece_name in {piece.info.name for piece in pieces})
        least, most = map(sum, zip(*(_bytes_expected(piece.info) for piece in pieces)))
        if not least <= read <= most:
            wrong.append(f"{read} bytes written from the file, {str(most) if least == most else f'{least} to {most}'} expected")
        if is_poisoned(job.dest):
            wrong.append("still holds poison: never written")
        if wrong:
            problems.append(f"{name}: {', '.join(wrong)}")
    return problems


def _bytes_expected(info: TensorInfo) -> tuple[int, int]:
    """The least and most bytes a read of ``info`` writes.

    A strided view is read in blocks: the rows of each, not the gaps
    between them, so between its elements' bytes and its whole span.
    """
    if info.contiguous:
        return info.read_nbytes, info.read_nbytes
    return min(info.nbytes, info.read_nbytes), info.read_nbytes


def nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of floating tensors holding NaN or Inf."""
    return [
        name for name, tensor in named
        if not tensor.is_meta and not is_lazy(tensor) and tensor.is_floating_point() and tensor.numel()
        and not bool(torch.isfinite(distinct_elements(tensor)).all())
    ]
