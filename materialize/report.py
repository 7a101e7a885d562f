"""What a load did: counts, bytes, time and memory, as a table or as JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .sizes import format_bytes
from .text import printable


@dataclass
class Report:
    """The outcome of one load (:func:`load`, :func:`load_model`, :func:`load_tensors`). ``str(report)`` is
    a table, its names and paths escaped (see :func:`~materialize.text.printable`); :meth:`to_dict` is
    JSON-ready, with them exact. Tensor names are the model's (the checkpoint's, for a plain dict of tensors).

    Fields:
        checkpoint: the checkpoint's path (a file, an index, a folder).
        format: the checkpoint's format: ``safetensors``, ``torch``, ``torch-module``, ``dcp``, or a sharded
            one (``safetensors-sharded``, ``torch-sharded``, ``mixed-sharded``).
        device: where the tensors went (a sharded model's: its mesh's device).
        state_dict_key: the entry of a training checkpoint the model state was taken from; ``None`` where
            the saved object is the state itself.
        loaded: the tensors read from the checkpoint.
        initialized: the tensors the load made without reading them (missing with ``strict=False``, or
            reinitialized), by their module's init, ``init``, or a recorded construction.
        replayed: of ``initialized``, those made by replaying a construction :func:`deferred_init` recorded.
        kept: real buffers the checkpoint lacks, kept as they were (moved to ``device``).
        mapped: the tensors that are zero-copy views of the checkpoint files (``mmap``, disk offload).
        nonfinite: the tensors holding NaN or Inf (filled by ``check_finite=True`` only).
        missing: the model's tensors the checkpoint lacks (``strict=False``).
        unexpected: the checkpoint's tensors the model lacks, skipped (``strict=False``).
        ignored: checkpoint tensors left unread: declared by the model as not loaded, ignored as asked
            (``ignore_unexpected``), or inside a submodule registered as ``None``.
        reinitialized: tensors the checkpoint holds in another shape, initialized instead
            (``ignore_mismatched_sizes``).
        not_from_checkpoint: the model's tensors the checkpoint gave no value (each tie once): missing from
            it (initialized, or kept as a real model held them) or reinitialized. Computed buffers, never
            saved, are not among them (see ``Plan.not_from_checkpoint``).
        fed_to_load_code: checkpoint entries that are no tensor of the model, read for the model's own load
            code (a saved version number).
        filled_by_load_code: the model's tensors that load code made from checkpoint values (torch's
            ``CustomState``).
        key_map: how checkpoint names were renamed (a wrapper's ``module.`` stripped, say), in words; ``""``
            for none.
        tied: the groups of names that share one tensor.
        untied: groups the model ties that were loaded apart, the checkpoint's values differing.
        dtypes: how many tensors of each dtype the model holds (``{"bfloat16": 290}``).
        bytes_by_device: the bytes placed on each device (``"disk"``: left mapped).
        bytes_read: the bytes read from the checkpoint files into memory (this rank's, for a sharded model),
            not those left mapped (``mmap``, a device map's disk: ``mapped`` names those tensors).
        bytes_received: with ``group=``, the bytes this rank received from the group's other ranks (read from
            storage by them); ``bytes_read`` is then what this rank read from storage for the group. 0 otherwise.
        model_bytes: the memory the tensors hold, each storage counted once (this rank's share, for a
            sharded model: ``rank_share``).
        rank_share: the model is sharded over ranks (DTensors: FSDP2, tensor parallel): ``model_bytes``,
            ``bytes_by_device`` and ``bytes_read`` are this rank's, not the whole model's. The table says so
            in its labels.
        read_beyond_model: where ``bytes_read`` exceeds ``model_bytes``, why, in words, each with the bytes it
            accounts for where they are known: whole rows read around the columns a shard (or a strided view)
            takes, a tied tensor's other copies read to compare with the first, casts to a narrower dtype,
            reads for a group's other ranks, values read for the model's load code. Empty otherwise.
        seconds: how long the load took.
        peak_host_bytes: the process's peak anonymous resident memory during the load, sampled every 50 ms
            and at the load's steps, a lower bound (``None`` off Linux).
        host_growth_bytes: how much that peak exceeds the process's memory when the load began.
        peak_device_bytes: the most the load added on any one GPU; ``None`` where no GPU was used.
        peak_device_bytes_by_device: that growth on each GPU the load wrote to.
    """

    checkpoint: str
    format: str
    device: str
    state_dict_key: Optional[str] = None
    loaded: list[str] = field(default_factory=list)
    initialized: list[str] = field(default_factory=list)
    replayed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    mapped: list[str] = field(default_factory=list)
    nonfinite: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    reinitialized: list[str] = field(default_factory=list)
    not_from_checkpoint: list[str] = field(default_factory=list)
    fed_to_load_code: list[str] = field(default_factory=list)
    filled_by_load_code: list[str] = field(default_factory=list)
    key_map: str = ""
    tied: list[list[str]] = field(default_factory=list)
    untied: list[list[str]] = field(default_factory=list)
    dtypes: dict[str, int] = field(default_factory=dict)
    bytes_by_device: dict[str, int] = field(default_factory=dict)
    bytes_read: int = 0
    bytes_received: int = 0
    model_bytes: int = 0
    rank_share: bool = False
    read_beyond_model: list[str] = field(default_factory=list)
    seconds: float = 0.0
    peak_host_bytes: Optional[int] = None
    host_growth_bytes: Optional[int] = None
    peak_device_bytes: Optional[int] = None
    peak_device_bytes_by_device: dict[str, int] = field(default_factory=dict)

    @property
    def mostly_not_loaded(self) -> bool:
        """More of the model's tensors got no value from the checkpoint than got one (loaded, or made from
        checkpoint values by the model's own load code): a load that is mostly initialized (a
        ``MostlyInitializedWarning`` said so)."""
        return len(self.not_from_checkpoint) > len(self.loaded) + len(self.filled_by_load_code)

    @property
    def gb_per_second(self) -> Optional[float]:
        """``bytes_read`` over ``seconds``, in GB (10^9 bytes) a second: ``None`` where nothing was read (a load
        that only mapped has no rate, and 0 GB/s would read as a stall), shown as ``-`` in the table and
        ``null`` in JSON."""
        return self.bytes_read / self.seconds / 1e9 if self.bytes_read > 0 and self.seconds > 0 else None

    def to_dict(self) -> dict:
        """Every field, and ``gb_per_second``, as JSON-ready values: what ``materialize --json`` prints."""
        return {
            "checkpoint": self.checkpoint,
            "format": self.format,
            "state_dict_key": self.state_dict_key,
            "device": self.device,
            "loaded": self.loaded,
            "initialized": self.initialized,
            "replayed": self.replayed,
            "kept": self.kept,
            "mapped": self.mapped,
            "nonfinite": self.nonfinite,
            "missing": self.missing,
            "unexpected": self.unexpected,
            "ignored": self.ignored,
            "reinitialized": self.reinitialized,
            "not_from_checkpoint": self.not_from_checkpoint,
            "mostly_not_loaded": self.mostly_not_loaded,
            "fed_to_load_code": self.fed_to_load_code,
            "filled_by_load_code": self.filled_by_load_code,
            "key_map": self.key_map,
            "tied": self.tied,
            "untied": self.untied,
            "dtypes": self.dtypes,
            "bytes_by_device": self.bytes_by_device,
            "bytes_read": self.bytes_read,
            "bytes_received": self.bytes_received,
            "model_bytes": self.model_bytes,
            "rank_share": self.rank_share,
            "read_beyond_model": self.read_beyond_model,
            "seconds": round(self.seconds, 6),
            "gb_per_second": None if self.gb_per_second is None else round(self.gb_per_second, 3),
            "peak_host_bytes": self.peak_host_bytes,
            "host_growth_bytes": self.host_growth_bytes,
            "peak_device_bytes": self.peak_device_bytes,
            "peak_device_bytes_by_device": self.peak_device_bytes_by_device,
        }

    def __str__(self) -> str:
        rows = [
            ("checkpoint", f"{self.checkpoint} ({self.format})"),
            *((("state dict", f"entry {self.state_dict_key!r} of the saved dict"),) if self.state_dict_key is not None else ()),
            ("device", self.device),
            ("tensors loaded", str(len(self.loaded))),
            ("tensors initialized", str(len(self.initialized))),
            ("buffers kept", str(len(self.kept))),
            ("zero-copy views", str(len(self.mapped))),
            ("tied groups", str(len(self.tied))),
            *((("untied (checkpoint differs)", str(len(self.untied))),) if self.untied else ()),
            ("unexpected (skipped)", str(len(self.unexpected))),
            *((("ignored (left unread)", str(len(self.ignored))),) if self.ignored else ()),
            *((("reinitialized (other shape)", str(len(self.reinitialized))),) if self.reinitialized else ()),
            *((("not from the checkpoint", f"{len(self.not_from_checkpoint)}"
                + (": more than loaded, the model is mostly initialized" if self.mostly_not_loaded else "")),)
              if self.not_from_checkpoint else ()),
            *((("read for the model's load code", str(len(self.fed_to_load_code))),) if self.fed_to_load_code else ()),
            *((("made by the model's load code", str(len(self.filled_by_load_code))),) if self.filled_by_load_code else ()),
            *((("names renamed", self.key_map),) if self.key_map else ()),
            ("dtypes", ", ".join(f"{name} x{count}" for name, count in sorted(self.dtypes.items())) or "-"),
            ("model size" + (" (this rank's share)" if self.rank_share else ""), format_bytes(self.model_bytes)),
            *((f"  on {place}", format_bytes(n)) for place, n in self.bytes_by_device.items() if len(self.bytes_by_device) > 1),
            ("bytes read" + (" (by this rank)" if self.rank_share else ""), format_bytes(self.bytes_read)
             + (f" (more than the model size: {'; '.join(self.read_beyond_model)})" if self.read_beyond_model else "")),
            ("time", f"{self.seconds:.3f} s"),
            ("throughput", "-" if self.gb_per_second is None else f"{self.gb_per_second:.2f} GB/s"),
            ("peak host memory", format_bytes(self.peak_host_bytes)),
            ("host memory growth", format_bytes(self.host_growth_bytes)),
        ]
        if self.peak_device_bytes is not None:
            rows.append(("peak device memory", format_bytes(self.peak_device_bytes)))
            if len(self.peak_device_bytes_by_device) > 1:
                rows += [(f"  on {place}", format_bytes(n)) for place, n in self.peak_device_bytes_by_device.items()]
        width = max(len(label) for label, _ in rows)
        lines = [f"{label.ljust(width)}  {printable(value)}" for label, value in rows]
        if self.initialized:
            lines.append(f"{'initialized'.ljust(width)}  {_first_names(self.initialized)}"
                         + (" (replayed as eager construction made them)" if self.replayed else ""))
        if self.nonfinite:
            lines.append(f"{'NaN/Inf in'.ljust(width)}  {_first_names(self.nonfinite)}")
        if self.untied:
            groups = "; ".join(" / ".join(map(printable, group)) for group in self.untied[:3])
            lines.append(f"{'untied'.ljust(width)}  {groups}")
        if self.unexpected:
            lines.append(f"{'unexpected'.ljust(width)}  {_first_names(self.unexpected)}")
        return "\n".join(lines)


def _first_names(names: list[str], shown: int = 6) -> str:
    """The first ``shown`` names, escaped, and how many more there are."""
    return ", ".join(map(printable, names[:shown])) + (f" (+{len(names) - shown})" if len(names) > shown else "")
