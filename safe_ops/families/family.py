"""A kernel family as one object: everything SafeSage knows about one attention kernel.

Modelled on xformers' ``ops/fmha/`` (one module per backend, each operator declaring what it
supports, one dispatcher): here every family lives in one module of this package and declares

* its **envelope** (``Envelope``: the index terms with their source citations, shape rules, the
  temporary-memory model ``temp_bytes`` and whether it launches on the legacy stream);
* its **adapter** (``call``: how it is called through the installed package, ``(fn, fn_lse)``, and
  the ``function``/``arguments`` that names);
* its **accuracy facts** (``tolerance``: relative L2 vs float32 on in-envelope inputs, what the
  first-call verification compares with; ``drift_rank``: how far its error rises on H3's late-block
  outlier channels, which the quality guard's move order reads -- attention.move_order);
* the **arches** whose build carries its kernels (``runs_on``), how a runtime **detects** it, the
  **kind** of kernel ComfyUI's own flags would name (``sage``, ``ck``, ``sdpa``, or its own), and its
  **kernel-table entry** (``table_name``: families that run one kernel share one measurement).

``check()`` (envelope.py) is xformers' ``not_supported_reasons``: a family's violations for a call;
``planner.choose()`` is the dispatcher. The registry (registry.py) lists the families.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping

from .envelope import Envelope

if TYPE_CHECKING:
    import torch

# "Runtime" in the annotations below is facts.devices.Runtime (not imported: facts import families)

KernelFn = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", str, "float | None"], "torch.Tensor"]
KernelLseFn = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", str, "float | None"],
                       "tuple[torch.Tensor, torch.Tensor]"]

#: the verifier's tolerance for a kernel no family declares one for (relative L2 vs float32)
DEFAULT_TOLERANCE = 0.12


@dataclass
class Kernel:
    """An executable kernel family: its envelope and ``fn(q, k, v, layout, scale) -> out``.

    ``fn`` receives tensors in ``layout`` order (HND ``[B,H,S,D]`` or NHD
    ``[B,S,H,D]``) and returns the output in the same layout.

    ``fn_lse`` (optional, same arguments) returns ``(out, lse)``: ``lse`` float32
    ``[B,H,Sq]`` whatever the layout, the natural log of ``sum_j exp(scale * q.k_j)`` over
    the keys it was given, up to a per-row constant that is the same for every slice of
    the keys of one call (what key/value-chunked plans need to merge exactly). Without it
    the envelope's ``returns_lse`` is switched off, so the planner never makes kv_chunks.
    """
    envelope: Envelope
    fn: KernelFn
    tolerance: float = DEFAULT_TOLERANCE
    fn_lse: KernelLseFn | None = None
    #: a quality-guard move target only, never a planning candidate (registry.installed_kernels: sage's
    #: own fp16-PV kernel where the arch's dispatch family is fp8 PV; attention.move_order)
    move_only: bool = False
    #: the kernel's rel. L2 on random H3-shaped inputs (KernelFamily.benign_error); None: not measured
    benign_error: float | None = None

    def __post_init__(self):
        if self.fn_lse is None and self.envelope.returns_lse:
            self.envelope = replace(self.envelope, returns_lse=False)

    @property
    def family(self) -> str:
        return self.envelope.family


def _dispatched_here(rt: "Runtime", name: str) -> bool:
    return name in (rt.sage_family, rt.ck_family)


@dataclass(frozen=True)
class KernelFamily:
    """One kernel family (see the module docstring). ``name`` is its envelope's family name."""
    envelope: Envelope
    kind: str                                    # "sage" | "ck" | "sdpa" | the family's own kind
    tolerance: float                             # verification: relative L2 vs float32, with margin
    call: Callable[[], "tuple[KernelFn, KernelLseFn | None] | None"]   # None: not installed here
    function: str = ""                           # what ``call`` runs (package.function), for people
    arguments: Mapping[str, Any] = field(default_factory=dict)   # and with which arguments
    runs_on: tuple[tuple[int, int], ...] = ()    # arches whose build carries it, callable directly
    detect: Callable[["Runtime"], bool] = field(default=None)    # this runtime runs it (see detected)
    table_name: str = ""                         # its kernel_table.json entry (default: its name)
    #: how far its error rises on H3's late-block outlier channels (HAZARDS.md H-9), 0 = least; the quality
    #: guard moves a block only to a family of a lower rank than the one it planned (attention.move_order:
    #: DRIFT_RANKS says what each rank is and what measured it). None: not known -- an extra family, always
    #: measured as a move target, and every family is one for it.
    drift_rank: int | None = None
    #: its rel. L2 on random H3-shaped inputs (24 heads x 128, bf16; the stress bench vs float32, flat
    #: in the sequence length from 38k to 305k tokens): its worst benign case -- flat attention --, from
    #: which the quality guard's ceiling is made (quality.targets.family_ceiling). None: not measured.
    benign_error: float | None = None

    @property
    def name(self) -> str:
        return self.envelope.family

    @property
    def table_entry(self) -> str:
        return self.table_name or self.name

    def detected(self, rt: "Runtime") -> bool:
        """Whether ``rt`` runs this family as an installed kernel: its own ``detect``, else the family
        the runtime's sageattention dispatches to or its comfy-kitchen version's family."""
        return (self.detect or (lambda r: _dispatched_here(r, self.name)))(rt)

    def runs_here(self, arch: "tuple[int, int] | None") -> bool:
        """Whether a build of the package carries this family's kernels on ``arch`` (callable directly,
        whatever the package's own dispatcher picks there)."""
        return arch is not None and tuple(arch) in self.runs_on

    def kernel(self) -> Kernel | None:
        """This family as an executable Kernel, or None when the installed package lacks it."""
        fns = self.call()
        if fns is None:
            return None
        fn, fn_lse = fns
        return Kernel(self.envelope, fn, self.tolerance, fn_lse, benign_error=self.benign_error)
