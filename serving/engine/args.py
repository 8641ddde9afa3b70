"""The engine's configuration, `EngineArgs`: one dataclass section per concern, and the command-line flags made
from the sections' fields. A knob is written once - its field, with its one default - and the server, the
offline `LLM`, the launcher and the benchmarks all read it from there.

A flag is named after its field (`max_num_seqs` -> `--max-num-seqs`) and typed by its annotation: `int`, `str`,
`X | None` (default None), `tuple[int, ...]` (comma-separated: `--token-buckets 8,16,32`) and `bool`
(`--flag` when the default is False, `--flag/--no-flag` when it is True). A field's `metadata` may add `help`,
`choices` (the section's `__post_init__` checks them too, for callers that skip the CLI), `aliases` (more
option strings, e.g. `("-tp",)`) and `flag` (an option string not derived from the name). Values are checked
where they are defined, in each section's `__post_init__`; on the command line such an error becomes a usage
error naming the flag.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from serving.engine.scheduler import SchedulerConfig
from serving.runtime.config import RuntimeConfig
from sharding.eplb import EplbConfig
from sharding.mesh import ParallelConfig


@dataclass(frozen=True)
class EngineArgs:
    """Every engine knob, by section; a new section is one more field here (its `title` heads its flags in
    `--help`). Flat: `EngineArgs.of(max_num_seqs=16, enable_eplb=True, ...)`."""

    runtime: RuntimeConfig = field(default_factory=RuntimeConfig, metadata={
        "title": "runtime: capacities and compiled shapes (per data-parallel rank), KV cache, kernels"})
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig, metadata={
        "title": "scheduling: batching policy, prefix cache, data-parallel routing"})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={
        "title": "parallelism: the device mesh"})
    eplb: EplbConfig = field(default_factory=EplbConfig, metadata={
        "title": "expert load balancing (EPLB)"})

    def __post_init__(self):
        if self.eplb.enable_eplb and not self.parallel.enable_expert_parallel:
            raise ValueError("enable_eplb needs enable_expert_parallel (experts split over the ranks)")


    @classmethod
    def sections(cls) -> dict[str, tuple[type, str]]:
        """name -> (section class, title), in flag order."""
        hints = typing.get_type_hints(cls)
        return {f.name: (hints[f.name], f.metadata["title"]) for f in dataclasses.fields(cls)}

    @classmethod
    def field_names(cls) -> set[str]:
        """The fields of every section (each name is in one section only)."""
        return {name for sec, _ in cls.sections().values() for name in field_names(sec)}

    @classmethod
    def of(cls, **flat) -> EngineArgs:
        """From flat keywords, each routed to the section that has a field of that name; an unknown name is a
        TypeError naming it."""
        secs = cls.sections()
        routed = route_keywords(flat, {name: field_names(sec) for name, (sec, _) in secs.items()}, "EngineArgs")
        return cls(**{name: sec(**routed[name]) for name, (sec, _) in secs.items()})

    def flat(self) -> dict[str, Any]:
        """Every field of every section by name (what `of` takes)."""
        return {name: getattr(getattr(self, sec), name) for sec in self.sections()
                for name in field_names(type(getattr(self, sec)))}

    def replace(self, **flat) -> EngineArgs:
        """A copy with some fields changed, named flat as in `of`."""
        return EngineArgs.of(**{**self.flat(), **flat})

    # ------------------------------------------------------------------ flags
    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser, *, exclude: tuple[str, ...] = ()) -> None:
        """One titled argument group per section."""
        for sec, title in cls.sections().values():
            add_flags(parser, sec, title, exclude=exclude)

    @classmethod
    def from_flags(cls, ns: argparse.Namespace) -> EngineArgs:
        """The sections from parsed flags; `FlagError` naming the flags when a value is refused."""
        secs = cls.sections()
        built = {name: from_flags(sec, ns) for name, (sec, _) in secs.items()}
        with _naming_flags([sec for sec, _ in secs.values()]):
            return cls(**built)

    def to_flags(self) -> list[str]:
        """Flags that give these values (defaults left out): `from_flags` of them equals `self`."""
        return [a for name in self.sections() for a in to_flags(getattr(self, name))]


class FlagError(ValueError):
    """A value given on the command line was refused; the message names its flag."""


def field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def route_keywords(flat: dict[str, Any], targets: dict[str, set[str]], owner: str) -> dict[str, dict[str, Any]]:
    """Split flat keywords over targets by field name (target -> its field names): {target: {name: value}}. A
    name no target has is a TypeError naming it, as a function's unexpected keyword argument."""
    owners = {name: t for t, names in targets.items() for name in names}
    routed: dict[str, dict[str, Any]] = {t: {} for t in targets}
    for name, value in flat.items():
        if name not in owners:
            raise TypeError(f"{owner} got an unexpected keyword argument {name!r}")
        routed[owners[name]][name] = value
    return routed


# ---------------------------------------------------------------------------------------------- fields -> flags
def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, cls: type, title: str, *, exclude: tuple[str, ...] = ()) -> None:
    """A titled argument group with one flag per field of the dataclass `cls` (but the fields in `exclude`)."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        kind = _kind(cls, f.name, hints[f.name])
        kw: dict[str, Any] = {"dest": f.name, "default": f.default}
        if kind is bool:
            # default on, or None (decided later: "auto"): --flag / --no-flag; default off: --flag
            kw["action"] = argparse.BooleanOptionalAction if f.default is not False else "store_true"
        elif kind is tuple:
            kw.update(type=_int_list, metavar="N,N,...")
        else:
            kw["type"] = kind
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
        action = group.add_argument(flag_name(f), *f.metadata.get("aliases", ()), **kw)
        action.help = _help(f)  # set after: some Python versions' BooleanOptionalAction append their own default


def _help(f: dataclasses.Field) -> str:
    """The field's help and, when it says something, its default ("%" escaped: argparse formats help text)."""
    text = f.metadata.get("help", "")
    if f.default is not None and f.default is not False and "default" not in text:
        shown = "on" if f.default is True else repr(f.default) if f.default == "" else _flag_value(f.default)
        text = f"{text} (default: {shown})".strip()
    return text.replace("%", "%%")


def from_flags(cls: type, ns: argparse.Namespace):
    """An instance of the dataclass `cls` from parsed flags (fields without a flag keep their defaults);
    `FlagError` naming the flags when a value is refused."""
    with _naming_flags([cls]):
        return cls(**{name: getattr(ns, name) for name in field_names(cls) if hasattr(ns, name)})


def to_flags(obj) -> list[str]:
    """The flags that set the fields of the dataclass `obj` that differ from their defaults."""
    out: list[str] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value == f.default:
            continue
        flag = flag_name(f)
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif value is None:
            raise ValueError(f"{f.name}=None has no flag (its default is {f.default!r})")
        else:
            out += [flag, _flag_value(value)]
    return out


def _flag_value(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


@contextlib.contextmanager
def _naming_flags(classes: list[type]):
    """A ValueError raised while building these dataclasses becomes a FlagError that also names the flags of the
    fields its message names, in the order it names them."""
    flags = {f.name: flag_name(f) for cls in classes for f in dataclasses.fields(cls)}
    try:
        yield
    except FlagError:
        raise
    except ValueError as err:
        named = list(dict.fromkeys(flags[w] for w in re.findall(r"\w+", str(err)) if w in flags))
        raise FlagError(f"argument {', '.join(named)}: {err}" if named else str(err)) from err


def _kind(cls: type, name: str, tp) -> type:
    """bool, int, str or tuple (of ints) from a field's annotation; `X | None` counts as X."""
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0] if len(args) == 1 else tp
    if tp in (bool, int, str):
        return tp
    if typing.get_origin(tp) is tuple and typing.get_args(tp) == (int, ...):
        return tuple
    raise TypeError(f"{cls.__name__}.{name}: no flag for the type {tp} (bool, int, str, tuple[int, ...])")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
