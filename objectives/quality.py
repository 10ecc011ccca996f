"""What a precision costs in accuracy: a trial's quality figure, and the quality tables that
supply it where no runner measures it.

Every figure is relative to the reference config of the same model (bf16 weights, KV-cache
compression off) and says where it comes from, with the hardware profiles' vocabulary
(`published`, `measured`, `assumed`, `calibrated`) and a note.

A table lists, per model, entries per (quantization, kv_compression). A pair the table does
not list is combined from the precision's entry at KV 1.0 and bf16's entry at that KV setting
by adding the accuracy drops (an assumption, said in the figure's note); KL and top-1
agreement are not combined: they are known only where an entry gives them.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from objectives.userfile import InputError, load_yaml

# The weights precisions a quality figure can be for; the knob of that name (search_spaces.knobs)
# takes its values from here, so a table and a search space speak one vocabulary.
Quantization = Literal["bf16", "fp16", "w8a8", "w8a16", "w4a16"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
Source = Literal["published", "measured", "assumed", "calibrated"]
REFERENCE = ("bf16", 1.0)  # (quantization, kv_compression) every figure is relative to
# The figures a quality SLO can bound, in the order they are shown.
FIGURES = ("accuracy_drop", "kl", "top1_agreement")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class QualityFigure(_Strict):
    """One config's quality against the reference; a figure left None is not known."""

    # benchmark points below the reference (bf16 weights, KV 1.0)
    accuracy_drop: Annotated[float, Field(ge=0)] | None = None
    # mean KL divergence from the reference's next-token distribution (nats)
    kl: Annotated[float, Field(ge=0)] | None = None
    # share of positions whose top token matches the reference
    top1_agreement: Annotated[float, Field(ge=0, le=1)] | None = None
    source: Source
    note: str  # where the figure comes from (paper, table, command), or why it was not measured
    # token positions a measured figure stands on
    samples: Annotated[int, Field(ge=0)] | None = None

    def values(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in FIGURES if getattr(self, name) is not None}


class TableEntry(_Strict):
    quantization: Quantization
    kv_compression: Annotated[float, Field(ge=0.05, le=1.0)] = 1.0
    accuracy_drop: Annotated[float, Field(ge=0)] | None = None
    kl: Annotated[float, Field(ge=0)] | None = None
    top1_agreement: Annotated[float, Field(ge=0, le=1)] | None = None
    source: Source  # required: a figure without its source cannot be weighed
    note: Annotated[str, Field(min_length=1)]  # required: the paper, table or command it comes from
    # The quantization methods the figure was measured with (GPTQ-Int4 is not llama.cpp's Q4_0,
    # nor INT8 SmoothQuant vLLM's fp8): an engine whose method is not listed runs on a borrowed
    # figure, which the note then says.
    methods: list[Annotated[str, Field(min_length=1)]] = []

    @model_validator(mode="after")
    def _has_a_figure(self):
        if self.accuracy_drop is None and self.kl is None and self.top1_agreement is None:
            raise ValueError("an entry needs at least one of accuracy_drop, kl, top1_agreement")
        return self

    @property
    def pair(self) -> tuple[str, float]:
        return self.quantization, float(self.kv_compression)

    def figure(self) -> QualityFigure:
        return QualityFigure(
            accuracy_drop=self.accuracy_drop,
            kl=self.kl,
            top1_agreement=self.top1_agreement,
            source=self.source,
            note=f"{self.note} (covers: {', '.join(self.methods)})" if self.methods else self.note,
        )


class ModelQuality(_Strict):
    names: Annotated[
        list[Annotated[str, Field(min_length=1)]], Field(min_length=1)
    ]  # model names and aliases
    reference: str = ""  # what the reference config scores, for the reader
    entries: Annotated[list[TableEntry], Field(min_length=1)]

    @model_validator(mode="after")
    def _one_entry_per_pair(self):
        seen = set()
        for entry in self.entries:
            if entry.pair in seen:
                raise ValueError(
                    f"two entries for quantization {entry.quantization} at kv_compression "
                    f"{entry.kv_compression:g}; keep one"
                )
            seen.add(entry.pair)
        return self

    def entry(self, quantization: str, kv: float) -> TableEntry | None:
        return next((e for e in self.entries if e.pair == (quantization, float(kv))), None)

    def figure(self, quantization: str, kv: float) -> QualityFigure | None:
        """The pair's figure: its own entry, else the precision's KV-1.0 entry plus bf16's entry
        at that KV setting (accuracy drops added, marked assumed); None when neither is there."""
        exact = self.entry(quantization, kv)
        if exact is not None:
            return exact.figure()
        weights, cache = self.entry(quantization, 1.0), self.entry(REFERENCE[0], kv)
        if (
            weights is None
            or cache is None
            or weights.accuracy_drop is None
            or cache.accuracy_drop is None
        ):
            return None
        return QualityFigure(
            accuracy_drop=round(weights.accuracy_drop + cache.accuracy_drop, 6),
            source="assumed",
            note=(
                f"assumed additive: the {quantization} entry's {weights.accuracy_drop:g} "
                f"({weights.source}) + the bf16 kv_compression {kv:g} entry's "
                f"{cache.accuracy_drop:g} ({cache.source})"
            ),
        )

    def missing(self, quantization: str, kv: float) -> str | None:
        """Why the table has no figure for the pair (None when it has one)."""
        if self.figure(quantization, kv) is not None:
            return None
        if self.entry(quantization, 1.0) is None:
            return f"no entry for precision {quantization}"
        return (
            f"no entry for precision {quantization} at kv_compression {kv:g} "
            f"(nor bf16 at kv_compression {kv:g} to add to its kv_compression 1 entry)"
        )


class QualityTable(_Strict):
    models: Annotated[list[ModelQuality], Field(min_length=1)]

    def for_model(self, name: str) -> tuple[int, ModelQuality] | None:
        wanted = name.lower()
        return next(
            ((i, m) for i, m in enumerate(self.models) if wanted in (n.lower() for n in m.names)),
            None,
        )


SHIPPED = resources.files("objectives") / "quality_tables"


def load_table(path: Path) -> QualityTable:
    """A user's table (`--quality FILE`), read and checked like every user file."""
    return load_yaml(path, QualityTable)


def find_shipped(model: str) -> tuple[str, QualityTable] | None:
    """The shipped table that names `model` (and what to call it in messages), if any."""
    for item in sorted(SHIPPED.iterdir(), key=lambda p: p.name):
        if item.name.endswith(".yaml"):
            with resources.as_file(item) as path:
                table = load_yaml(path, QualityTable)
            if table.for_model(model) is not None:
                return f"shipped quality table {item.name}", table
    return None


def describe_missing_model(source: str, table: QualityTable, model: str) -> InputError:
    names = sorted({n for m in table.models for n in m.names})
    return InputError(
        f"{source}: models: no entry names the model {model!r} (it names: {', '.join(names)}); "
        "add its name to `names`"
    )
