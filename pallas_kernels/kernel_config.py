"""Which kernels a model's fused ops run, as configuration: the implementation (`impl`, see `dispatch`) and the
routed experts' form for each small step on the XLA path (`moe_xla.xla`'s `small_steps`).

A `KernelConfig` is frozen and hashable: the model's modules hold it as a static attribute (part of the graph
definition, so a program is traced for the kernels it names), given when the model is built
(`dsv41.Model(..., kernels=...)`, `Model.with_kernels`). Nothing here chooses anything: the serving runtime times the
small-step forms (`serving.runtime.moe_tuning`) before it traces, and writes its choice here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pallas_kernels.dispatch import IMPLS, resolve_impl
from pallas_kernels.moe_xla import SMALL_STEP_FORMS, SMALL_STEPS
from pallas_kernels.tile_table import KernelChoice, KernelShape, check_entry, choose


class MoeStep(NamedTuple):
    """The shape of one routed-experts call: rows (the step's padded tokens), choices per row, experts, intermediate
    and model width, the float experts' dtype name."""

    rows: int
    top_k: int
    n_experts: int
    inter: int
    dim: int
    dtype: str

    def shape(self) -> str:
        """The layer's shape, without the rows."""
        return f"top-{self.top_k} of {self.n_experts} experts {self.inter}x{self.dim} {self.dtype}"


@dataclass(frozen=True)
class KernelConfig:
    """impl: "auto" (Pallas on a GPU, XLA elsewhere) | "reference" | "xla" | "pallas".
    moe_small_step_form: the XLA path's form for small steps (`moe_xla.is_small_step`) not listed in
    `moe_small_steps`: "rule" (batched, weights right) or one of SMALL_STEP_FORMS.
    moe_small_steps: ((MoeStep, form), ...) the form of each listed small step (e.g. the serving runtime's tuned
    choices); a dict is accepted and stored as a sorted tuple.
    tuned: ((KernelShape, KernelChoice), ...) a device's stored tile table (`tile_table`): under "auto" on a GPU a
    listed GEMM runs the implementation and tiles tuned for it."""

    impl: str = "auto"
    moe_small_step_form: str = "rule"
    moe_small_steps: tuple[tuple[MoeStep, str], ...] = ()
    tuned: tuple[tuple[KernelShape, KernelChoice], ...] = ()

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
        if self.moe_small_step_form not in SMALL_STEPS:
            raise ValueError(f"moe_small_step_form must be one of {SMALL_STEPS}, got {self.moe_small_step_form!r}")
        entries = self.moe_small_steps.items() if isinstance(self.moe_small_steps, dict) else self.moe_small_steps
        table = []
        for entry in entries:
            try:
                step, form = entry
                step = MoeStep(*step)
            except (TypeError, ValueError):
                raise ValueError(f"moe_small_steps: expected (MoeStep(rows, top_k, n_experts, inter, dim, dtype), "
                                 f"form) pairs, got {entry!r}") from None
            if form not in SMALL_STEP_FORMS:
                raise ValueError(f"moe_small_steps: the form of {step} must be one of {SMALL_STEP_FORMS}, got {form!r}")
            table.append((step, form))
        if len({s for s, _ in table}) != len(table):
            raise ValueError("moe_small_steps: a step is listed twice")
        object.__setattr__(self, "moe_small_steps", tuple(sorted(table)))
        tuned = [check_entry(KernelShape(*s), KernelChoice(*c)) for s, c in self.tuned]
        if len({s for s, _ in tuned}) != len(tuned):
            raise ValueError("tuned: a kernel shape is listed twice")
        object.__setattr__(self, "tuned", tuple(sorted(tuned, key=lambda entry: entry[0])))

    def choice(self, call: KernelShape) -> KernelChoice | None:
        """The tuned choice for a GEMM call (`tile_table.choose`) where the Pallas path is taken (auto on a GPU, or
        pallas) and a table lists the call's shape; else None (the kernel's own rule). Under "pallas" the dispatch
        takes only a choice's tiles, never its "xla"."""
        if not self.tuned or resolve_impl(self.impl) != "pallas":
            return None
        return choose(self.tuned, call)

    def small_step_form(self, step: MoeStep) -> str:
        """The form `moe_xla.xla` takes for a call of this shape (used only where it is a small step)."""
        return dict(self.moe_small_steps).get(step, self.moe_small_step_form)

    def describe(self) -> str:
        """One line (for a banner): the implementation and the MoE small-step forms."""
        impl = self.impl if self.impl != "auto" else f"auto ({resolve_impl('auto')})"
        if self.tuned:
            impl += f", {len(self.tuned)} tuned GEMM shapes"
        if not self.moe_small_steps:
            return f"{impl}; MoE small steps: {self.moe_small_step_form}"
        shapes: dict[str, list[str]] = {}
        for step, form in self.moe_small_steps:
            shapes.setdefault(step.shape(), []).append(f"{step.rows} rows {form}")
        listed = "; ".join(f"{shape}: {', '.join(forms)}" for shape, forms in shapes.items())
        return f"{impl}; MoE small steps ({listed}; others {self.moe_small_step_form})"
