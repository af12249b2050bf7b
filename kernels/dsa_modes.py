"""Which Triton kernels a 3D-DSA call runs: ``KernelModes``, an explicit argument of the kernels'
entry points (``dsa_triton``, ``deformable_slide_attention``, the planner's ``scratch_bytes``).

The product always runs ``AUTO`` (the cost model's pick per call, logged once). The other modes
force one kernel family, for the GPU check's measurements and the tests that hold each family to
the reference. No module state: a mode is passed with the call it applies to."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KernelModes", "AUTO"]

HALO_MODES = ("auto", "halo", "gather", "fused")
DKV_MODES = ("auto", "atomic")


@dataclass(frozen=True)
class KernelModes:
    halo: str = "auto"
    """Which kernels take the forward and the backward's query side: ``auto`` -- per pass, the halo
    kernels (tensor cores) for bf16 and fp16 when the offsets' bound allows them and the cost model
    predicts them faster there, else the gather kernels; ``halo`` -- the halo kernels whenever the
    bound allows them, fp32 too; ``gather`` -- always the gather kernels; ``fused`` -- the forward and
    the backward each on the fused halo-dense kernel (``dsa_gluon_halo``: Gluon, Triton >= 3.8, sm_90)
    where it can run and its first-use check against the reference passed, else as ``auto`` (the
    reason logged once per pass). A call with an explicit ``block_m`` takes the gather kernels."""
    dkv: str = "auto"
    """How the backward sums dk and dv: ``auto`` -- the key-side pass (deterministic, no float
    atomics) when the offsets' bound allows it; past its cap, or with no bound, the split mode (the
    key-side pass at its cap for the queries within it, atomics for the rest); ``atomic`` -- always
    fp32 atomics."""
    keep_walks: bool = True
    """With ``halo="fused"``: the fused forward's sample order and records (``dsa_gluon_halo.sample_walks``)
    kept for its backward, which then writes none (2.5 KB a query and head held from the forward to the
    backward); False: the backward writes them again (one more order kernel a step, nothing held)."""

    def __post_init__(self):
        if self.halo not in HALO_MODES:
            raise ValueError(f"KernelModes(halo={self.halo!r}): choose one of {', '.join(HALO_MODES)}")
        if self.dkv not in DKV_MODES:
            raise ValueError(f"KernelModes(dkv={self.dkv!r}): choose one of {', '.join(DKV_MODES)}")
        if not isinstance(self.keep_walks, bool):
            raise ValueError(f"KernelModes(keep_walks={self.keep_walks!r}): True (keep the fused forward's "
                             f"sample order for its backward) or False (write it again)")


AUTO = KernelModes()
