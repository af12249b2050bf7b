"""Ahead-of-time compilation of the product's Triton kernels for a GPU that need not be there.

    python -m benchmarks.gpu_check --compile-only --arch sm_90 [--arch sm_100] [--full] [--json FILE]

``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` runs the whole Triton
pipeline and Triton's bundled ``ptxas`` on a CPU machine. For every kernel, shape and autotune
config the product may launch (``kernels.aot_variants``: the kernel modules say what they launch),
this module compiles once per target and records, from ``ptxas -v`` and the PTX:

- registers per thread, spill stores / loads and stack frame (bytes per thread);
- shared memory per block against the target's per-block limit (232,448 bytes on sm_90 and
  sm_100), and how many blocks fit on one multiprocessor by shared memory and by registers;
- warps and pipeline stages;
- what the ``tl.dot`` calls became (``wgmma`` = Hopper warpgroup MMA, ``tcgen05`` = Blackwell's
  tensor-core MMA, ``mma.sync`` =
  Ampere-style tensor cores, ``-`` = no dot in the kernel) and how many fp32 global atomics
  (``atom`` / ``red`` ``.global`` ``.f32``) the PTX issues;
- the compile time (a config whose ``ptxas`` runs for minutes is a config that spills);
- the PTX instructions per loop depth, and of them the code a loop runs only under a condition
  (``guarded_regions``), and each loop's own code (``loop_bodies``): the cost model's issue table.

A record fails (``ok`` false) when the config cannot launch (shared memory over the limit, or
more than 255 registers), spills, times out or does not compile, or when a kernel whose design
puts its products on tensor cores got ``mma.sync`` or no MMA at all instead of the target's own
(``wgmma`` on sm_90, ``tcgen05`` on sm_100).
Every compile runs in a forked child with its own Triton cache (a real compile, timed; a hung
``ptxas`` is killed at ``timeout_s``).
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import multiprocessing
import os
import re
import shutil
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field

ARCHS = {"sm_90": 90, "sm_100": 100}
SMEM_PER_BLOCK = {90: 232_448, 100: 232_448}
"""Largest dynamic shared memory one block may opt into (bytes): ``sharedMemPerBlockOptin``."""
SMEM_PER_SM = {90: 233_472, 100: 233_472}
REGS_PER_SM = 65_536
MAX_REGS_PER_THREAD = 255
COMPILE_TIMEOUT_S = 600.0
"""A hang guard, not a speed check: one compile takes 1-40 s on 2 quiet cores and several times that
beside CI's other test groups; spills, the thing a slow ``ptxas`` used to signal, are checked directly."""


@dataclass(frozen=True)
class AotShape:
    """One shape the product runs the kernels at: dtype, head dim, window, token grid, and the offset
    bound the model passes (``attention.max_offset``; the halo radius is its ceiling)."""

    dtype: str  # "bf16" | "fp32"
    head_dim: int
    window: tuple[int, int, int]
    grid: tuple[int, int, int]
    max_offset: float | None  # None: unbounded (``attention.max_offset`` 0), measured per call
    label: str = ""
    presets: tuple = ()  # the presets that run at this shape (none: a shape users may configure)


@dataclass
class Variant:
    """One compile: a ``@triton.jit`` function with a full signature, constexprs and launch options.
    ``tensor_cores``: the design puts its products on tensor cores (a target with wgmma must use it).
    ``may_pick``: the dispatcher can launch this config at this shape (a failure then fails the
    check); False for configs listed for information only."""

    kernel: str
    fn: object
    signature: dict
    constexprs: dict
    num_warps: int
    num_stages: int
    config: str
    tensor_cores: bool
    may_pick: bool = True
    note: str = ""
    attrs: dict | None = None  # (arg index,) -> [["tt.divisibility", 16]]: what the launcher's JIT would see
    archs: tuple | None = None  # the targets whose launcher picks this config ("sm_90", ...); None: every target
    maxnreg: int | None = None  # the launch's register limit per thread (None: ptxas chooses)


@dataclass
class Record:
    kernel: str
    arch: str
    shape: str
    dtype: str
    head_dim: int
    window: list
    grid: list
    max_offset: float | None
    config: str
    num_warps: int
    num_stages: int
    may_pick: bool
    regs: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack: int | None = None
    smem: int | None = None
    smem_limit: int | None = None
    blocks_per_sm: int | None = None
    dot: str = "-"
    wgmma: int = 0
    tt_dots: int = 0  # the kernel's dots (``tt.dot`` in its TTIR)
    mma_dots: int = 0  # of them, those lowered to the target's MMA (``ttng.warp_group_dot``, ``ttng.tc_gen5_mma``)
    wgmma_not_16bit: int = 0  # wgmma instructions whose operands are not bf16 or fp16 (tf32, fp8, ...)
    mma_serialized: str = ""  # ptxas's warning that it serialized the wgmma instructions, if any
    mma_sync: int = 0
    atomics_f32: int = 0
    compile_s: float | None = None
    loop_instr: dict = field(default_factory=dict)  # PTX instructions by loop depth (``loop_instructions``)
    guarded: dict = field(default_factory=dict)  # of them, each conditional region's, by depth (``guarded_regions``)
    loops: dict = field(default_factory=dict)  # of them, each loop's own, by depth (``loop_bodies``)
    mma_groups: list = field(default_factory=list)  # each wgmma group's [depth, overlapped instructions, flops, loops]
    outer_walks: list = field(default_factory=list)  # loops at depth 1 holding none (``inner_loops``)
    barriers: dict = field(default_factory=dict)  # the ``bar.sync`` among them, counted as they are (``barriers``)
    constexprs: dict = field(default_factory=dict)  # the compile's constexprs (tile sizes, window, ...)
    ok: bool = False
    problems: list = field(default_factory=list)
    note: str = ""
    presets: list = field(default_factory=list)  # the presets that run at this shape


_REGS = re.compile(r"Used (\d+) registers")
_SERIALIZED = re.compile(r"^.*wgmma[^\n]*serializ[^\n]*$", re.M | re.I)
_WGMMA = re.compile(r"wgmma\.mma_async[\w.]*")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_ATOMIC = re.compile(r"^\s*(?:@%p\d+\s+)?(?:atom|red)\.(?:\w+\.)*global\.(?:\w+\.)*f32", re.M)


def parse_ptxas_log(log: str) -> dict:
    out = {}
    if m := _REGS.search(log):
        out["regs"] = int(m.group(1))
    if m := _SPILL.search(log):
        out["stack"], out["spill_stores"], out["spill_loads"] = (int(g) for g in m.groups())
    if m := _SERIALIZED.search(log):
        out["mma_serialized"] = m.group(0).strip()[:300]
    return out


def count_dots(ttir: str | None, ttgir: str) -> dict:
    """The kernel's dots (``tt.dot`` in the TTIR) and how many the TTGIR lowered to the target's
    tensor-core MMA (Hopper's ``warp_group_dot``, Blackwell's ``tc_gen5_mma``): each dot, not just one.
    A Gluon kernel has no TTIR: its dots are the MMA ops it wrote (each counted in the TTGIR)."""
    mma = len(re.findall(r"\bttng\.(?:warp_group_dot|tc_gen5_mma)\b", ttgir))
    return {"tt_dots": mma if ttir is None else len(re.findall(r"\btt\.dot\b", ttir)), "mma_dots": mma}


_BLOCK = re.compile(r"^(?:\$L__BB\d+_\d+:|// %bb\.\d+:)")
_DEPTH = re.compile(r"Depth=(\d+)")


def loop_instructions(ptx: str) -> dict:
    """The PTX's instructions by loop depth, ``{depth: count}`` (depth 0: outside every loop). LLVM
    heads each basic block with a label (``$L__BB0_4:``) or, for a block entered by falling
    through, a ``// %bb.3:`` comment, and its comment lines name the innermost loop holding it
    (``in Loop: Header=BB0_6 Depth=4``, ``This Inner Loop Header: Depth=4``). A block's count times
    its loops' trip counts is what one thread issues: the cost model (``kernels.dsa_cost``) reads
    these counts for the issue slots a kernel needs. Directives, labels and comments are not
    counted; every instruction is one, predicated or not."""
    out: dict[int, int] = {}
    depth, heading = 0, False
    for line in ptx.splitlines():
        s = line.strip()
        if _BLOCK.match(s):
            depth, heading = 0, True
        elif not (heading and s.startswith("//")):
            heading = False
        if heading:
            depth = max([depth, *map(int, _DEPTH.findall(s))])
            continue
        if not s or s.startswith(("//", ".", "$", "{", "}")):
            continue
        out[depth] = out.get(depth, 0) + 1
    return out


_BRANCH = re.compile(r"^(@!?%p\d+\s+)?bra(?:\.uni)?\s+(\$L__BB\d+_\d+);")


def _blocks(ptx: str) -> list[dict]:
    """The PTX's basic blocks in order: label (``None`` for a fall-through ``// %bb.N:``), innermost loop
    ``(header, depth)`` (``("", 0)`` outside every loop), whether it heads its loop, its instructions."""
    blocks: list[dict] = []
    heading = False
    for line in ptx.splitlines():
        s = line.strip()
        if _BLOCK.match(s):
            label = s.split(":")[0] if s.startswith("$") else None
            blocks.append({"label": label, "loop": ("", 0), "header": False, "inner": False, "instr": []})
            heading = True
        elif not (heading and s.startswith("//")):
            heading = False
        if heading and blocks:
            b = blocks[-1]
            for depth in map(int, _DEPTH.findall(s)):  # one a comment line; the innermost wins
                if depth >= b["loop"][1]:
                    own = "Loop Header:" in s  # "=>This Inner Loop Header: Depth=2": the block heads its loop
                    m = re.search(r"Header=(BB\d+_\d+)", s)
                    head = (b["label"] or "")[len("$L__"):] if own else (m.group(1) if m else "")
                    b["loop"], b["header"], b["inner"] = (head, depth), own, "Inner Loop Header:" in s
            continue
        if blocks and s and not s.startswith(("//", ".", "$", "{", "}")):
            blocks[-1]["instr"].append(s)
    return blocks


def _skipped_blocks(blocks: list[dict]) -> set[int]:
    """The ``id`` of every block inside a loop that a forward branch may jump over (to a later block of the
    same loop; ``blocks`` in ``_iteration_order``; an unconditional one skips an ``else``): code that does
    not run on every iteration (the fused kernels' window layers, walked only in the frames they reach,
    and the walks of no sample)."""
    at = {b["label"]: i for i, b in enumerate(blocks) if b["label"]}
    out: set[int] = set()
    for i, b in enumerate(blocks):
        for ins in b["instr"]:
            m = _BRANCH.match(ins)
            if not m or b["loop"][1] == 0 or m.group(2) not in at:
                continue
            j = at[m.group(2)]
            if j > i and blocks[j]["loop"] == b["loop"]:
                out.update(id(x) for x in blocks[i + 1:j])
    return out


def guarded_regions(ptx: str) -> dict:
    """The code a loop body runs only when a condition holds: ``{depth: [instructions of each region, in
    order]}``. A region is the fall-through blocks after a conditional branch ``@%p bra L`` at the end of
    a block inside a loop, up to ``L`` (reached by falling through or by ``bra.uni L``), all in the same
    loop and branch-free: an ``if`` without ``else`` (the fused halo kernels' window layers: a layer's
    samples are walked only in the frames they can reach, ``kernels.dsa_fused_cost``). Its instructions are
    in ``loop_instructions``'s count of that depth too; they issue only where the condition holds."""
    blocks = _blocks(ptx)
    at = {b["label"]: i for i, b in enumerate(blocks) if b["label"]}
    out: dict[int, list[int]] = {}
    for i, b in enumerate(blocks):
        m = _BRANCH.match(b["instr"][-1]) if b["instr"] else None
        loop = b["loop"]
        if not m or not m.group(1) or loop[1] == 0 or m.group(2) not in at or blocks[at[m.group(2)]]["loop"] != loop:
            continue
        size, j = 0, i + 1
        while j < len(blocks):
            r = blocks[j]
            if r["label"] == m.group(2):
                break
            if r["loop"] != loop or r["header"]:
                size = 0
                break
            jumps = [_BRANCH.match(x) for x in r["instr"]]
            last = jumps[-1] if jumps else None
            if any(jumps[:-1]) or (last and (last.group(1) or last.group(2) != m.group(2))):
                size = 0
                break
            size += len(r["instr"])
            if last:
                break
            j += 1
        if size:
            out.setdefault(loop[1], []).append(size)
    return out


def loop_bodies(ptx: str) -> dict:
    """Each loop's own instructions (its blocks', not those of loops nested in it), by depth and in the
    order the loops first appear: ``{depth: [instructions, ...]}``. The fused halo kernels' sample walks
    are loops inside the frame loops, one per window layer and pass, their trips data-dependent (the
    samples that touch the frame, ``kernels.dsa_fused_cost``)."""
    out: dict[int, list[int]] = {}
    for (_, depth), n in _loop_sizes(_blocks(ptx)).items():
        out.setdefault(depth, []).append(n)
    return out


def _loop_sizes(blocks: list[dict]) -> dict[tuple, int]:
    """Each loop's own instructions, keyed by its ``(header, depth)``, in the order the loops first appear
    (``loop_bodies``' order within a depth)."""
    sizes: dict[tuple, int] = {}
    for b in blocks:
        if b["loop"][1]:
            sizes[b["loop"]] = sizes.get(b["loop"], 0) + len(b["instr"])
    return sizes


_MMA_SHAPE = re.compile(r"^wgmma\.mma_async\S*\.m(\d+)n(\d+)k(\d+)\.")


def _iteration_order(blocks: list[dict]) -> list[dict]:
    """``blocks`` with each loop's (contiguous) range rotated to start at its header: LLVM may place a
    loop's latch before its header, so text order is not the order one iteration runs in."""
    blocks = list(blocks)
    for b in sorted((b for b in blocks if b["header"]), key=lambda b: -b["loop"][1]):  # innermost first
        own = [i for i, x in enumerate(blocks) if x["loop"] == b["loop"]]
        lo, hi, head = own[0], own[-1], blocks.index(b)
        while hi + 1 < len(blocks) and blocks[hi + 1]["loop"][1] > b["loop"][1]:  # its nested loops' blocks
            hi += 1
        blocks[lo:hi + 1] = blocks[head:hi + 1] + blocks[lo:head]
    return blocks


def mma_groups(ptx: str) -> list[list]:
    """The asynchronous dots' overlap with the instructions around them, ``[depth, between, flops, loops]``
    per ``wgmma.wait_group`` that retires groups (those it retires run back to back on the tensor cores
    while the instructions after the first one's commit issue): ``between`` the instructions the warps
    issue in the commit's loop, past the first group's ``wgmma.commit_group`` (or the previous wait, if
    later: what came before it was counted for the groups that wait retired) and before the wait, that
    run on every path (none a forward branch may skip), ``loops`` the loops nested there (their places in
    ``loop_bodies``' list of their depth; their trips are data-dependent: the cost model counts them),
    ``flops`` the groups' ``mma_async`` work per warpgroup (``2 m n k`` each), ``depth`` the commit's loop
    depth. A synchronous dot overlaps nothing; groups retired in another loop than their commit's
    overlap nothing here (the count would not be per iteration)."""
    blocks = _blocks(ptx)
    index: dict[tuple, int] = {}  # each loop's place among those of its depth, as ``loop_bodies`` lists them
    for loop in _loop_sizes(blocks):
        index[loop] = sum(1 for k in index if k[1] == loop[1])
    order = _iteration_order(blocks)
    skipped = _skipped_blocks(order)
    out: list[list] = []
    open_: list[list] = []  # groups committed and not yet retired, oldest first: [depth, between, flops, loops, loop]
    pending = 0
    for b in order:
        for ins in b["instr"]:
            if m := _MMA_SHAPE.match(ins):
                pending += 2 * math.prod(map(int, m.groups()))
            elif ins.startswith("wgmma.commit_group"):
                open_.append([b["loop"][1], 0, pending, {}, b["loop"]])
                pending = 0
            elif ins.startswith("wgmma.wait_group"):
                keep = int(re.findall(r"\d+", ins.split()[-1])[0])
                done, open_ = open_[:max(0, len(open_) - keep)], open_[max(0, len(open_) - keep):]
                if done:
                    first = done[0]
                    mine = all(g[4] == b["loop"] for g in done)
                    out.append([first[0], first[1] if mine else 0, sum(g[2] for g in done),
                                [index[k] for k in first[3]] if mine else []])
                for g in open_:  # what follows overlaps them: what came before was counted for the retired
                    g[1], g[3] = 0, {}
            else:
                for g in open_:
                    if b["loop"] == g[4] and id(b) not in skipped:
                        g[1] += 1
                    elif b["loop"][1] > g[0]:
                        g[3][b["loop"]] = g[3].get(b["loop"], 0) + 1
    return out


def inner_loops(ptx: str, depth: int = 1) -> list[int]:
    """The own instructions of the loops at ``depth`` that hold no loop (LLVM heads them "This Inner Loop
    Header"), in ``loop_bodies``' order: at depth 1 in the fused halo kernels, the sample walks outside
    the frame loops (a pass's first frame, walked before its loop: ``kernels.dsa_fused_cost``)."""
    blocks = _blocks(ptx)
    inner = {b["loop"] for b in blocks if b["header"] and b["inner"]}
    return [n for key, n in _loop_sizes(blocks).items() if key[1] == depth and key in inner]


_BARRIER = ("bar.sync", "barrier.sync", "bar.red", "barrier.red")


def barriers(ptx: str) -> dict:
    """The block-wide barriers (``bar.sync`` and kin: Triton puts one wherever warps hand data over in shared
    memory, and after each ``wgmma.wait_group``) counted as the instructions are: ``{"depths": {depth:
    count}, "loops": {depth: [each loop's own]}, "outer_walks": [each depth-1 loop holding none]}``, in
    ``loop_instructions``', ``loop_bodies``' and ``inner_loops``' order (the PTX with every other
    instruction left out). The cost model prices each as a stall of the block's SM."""
    kept = [line for line in ptx.splitlines()
            if not (s := line.strip()) or s.startswith(("//", ".", "$", "{", "}", *_BARRIER)) or _BLOCK.match(s)]
    only = "\n".join(kept)
    return {"depths": loop_instructions(only), "loops": {k: v for k, v in loop_bodies(only).items() if k >= 2},
            "outer_walks": inner_loops(only, 1)}


def count_ptx(ptx: str) -> dict:
    wgmma = len(re.findall(r"wgmma\.mma_async", ptx))
    tcgen05 = len(re.findall(r"\btcgen05\.mma", ptx))  # Blackwell's (sm_100) tensor-core MMA
    mma = len(re.findall(r"\bmma\.sync", ptx))
    dot = "tcgen05" if tcgen05 else "wgmma" if wgmma else ("mma.sync" if mma else "-")
    not_16bit = sum(1 for w in _WGMMA.findall(ptx) if not w.endswith((".bf16.bf16", ".f16.f16")))
    return {"wgmma": wgmma, "mma_sync": mma, "dot": dot, "wgmma_not_16bit": not_16bit,
            "atomics_f32": len(_ATOMIC.findall(ptx)),
            "loop_instr": loop_instructions(ptx), "guarded": guarded_regions(ptx), "loops": loop_bodies(ptx),
            "mma_groups": mma_groups(ptx), "outer_walks": inner_loops(ptx, 1), "barriers": barriers(ptx)}


def _compile_in_child(variant: Variant, cc: int, conn, cache: str) -> None:
    """Child: compile with a private cache (``cache``, which the parent removes) and ptxas's log
    on stdout; send back what we measured."""
    try:
        os.environ["TRITON_CACHE_DIR"] = cache
        os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
        os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        import triton  # lazy: a forked child, after the cache and log variables are set
        from triton.backends.compiler import GPUTarget  # lazy: as above

        try:  # the knob is read at import in some versions, at use in others
            triton.knobs.nvidia.dump_ptxas_log = True
        except AttributeError:
            pass
        if getattr(variant.fn, "is_gluon", lambda: False)():  # a Gluon kernel (kernels/dsa_gluon_halo.py)
            from triton.experimental.gluon._runtime import GluonASTSource  # lazy: as above

            src = GluonASTSource(variant.fn, variant.signature, constexprs=variant.constexprs, attrs=variant.attrs)
        else:
            src = triton.compiler.ASTSource(fn=variant.fn, signature=variant.signature, constexprs=variant.constexprs,
                                            attrs=variant.attrs)
        buf = io.StringIO()
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(buf):
            k = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                               options={"num_warps": variant.num_warps, "num_stages": variant.num_stages,
                                                            **({"maxnreg": variant.maxnreg} if variant.maxnreg else {})})
        seconds = time.perf_counter() - t0
        res = {"compile_s": round(seconds, 2), "smem": int(k.metadata.shared), **parse_ptxas_log(buf.getvalue()),
               **count_ptx(k.asm["ptx"]), **count_dots(k.asm["ttir"] if "ttir" in k.asm else None, k.asm["ttgir"])}
        conn.send(("ok", res))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent as a problem
        conn.send(("error", f"{type(e).__name__}: {str(e)[:800]}\n{traceback.format_exc()[-1500:]}"))
    finally:
        conn.close()


def _record(variant: Variant, arch: str, shape: AotShape) -> Record:
    """A record of ``variant`` compiled for ``arch`` at ``shape``, before the compile."""
    return Record(kernel=variant.kernel, arch=arch, shape=shape.label, dtype=shape.dtype, head_dim=shape.head_dim,
                  window=list(shape.window), grid=list(shape.grid), max_offset=shape.max_offset,
                  presets=list(shape.presets), config=variant.config, num_warps=variant.num_warps,
                  num_stages=variant.num_stages, may_pick=variant.may_pick, note=variant.note,
                  smem_limit=SMEM_PER_BLOCK[ARCHS[arch]],
                  constexprs={k: v for k, v in variant.constexprs.items() if isinstance(v, (bool, int, str))})


def compile_variant(variant: Variant, arch: str, shape: AotShape, timeout_s: float = COMPILE_TIMEOUT_S) -> Record:
    cc = ARCHS[arch]
    rec = _record(variant, arch, shape)
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    cache = tempfile.mkdtemp(prefix="megaslide-aot-")
    proc = ctx.Process(target=_compile_in_child, args=(variant, cc, child, cache))
    t0 = time.perf_counter()
    try:
        proc.start()
        child.close()
        got = parent.recv() if parent.poll(timeout_s) else None
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if got is None:
        rec.compile_s = round(time.perf_counter() - t0, 1)
        rec.problems.append(f"compile did not finish in {timeout_s:.0f} s")
        return rec
    status, res = got
    if status != "ok":
        rec.problems.append(f"compile failed: {res.splitlines()[0]}")
        rec.note = (rec.note + "\n" + res).strip()
        return rec
    for k, v in res.items():
        setattr(rec, k, v)
    judge(rec, variant.tensor_cores, cc)
    return rec


def blocks_per_sm(regs: int, warps: int, smem: int, cc: int) -> int:
    """Resident blocks per multiprocessor allowed by registers (allocated per warp in units of 256)
    and by shared memory (1 KiB reserved per block)."""
    per_warp = math.ceil(regs * 32 / 256) * 256
    by_regs = REGS_PER_SM // (per_warp * warps) if regs else 32
    by_smem = SMEM_PER_SM[cc] // (smem + 1024)
    return max(0, min(by_regs, by_smem, 32))


def judge(rec: Record, tensor_cores: bool, cc: int) -> None:
    problems = rec.problems
    if rec.smem is not None and rec.smem > SMEM_PER_BLOCK[cc]:
        problems.append(f"shared memory {rec.smem} B > {SMEM_PER_BLOCK[cc]} B per block: cannot launch")
    if rec.regs is not None and rec.regs > MAX_REGS_PER_THREAD:
        problems.append(f"{rec.regs} registers per thread > {MAX_REGS_PER_THREAD}")
    if rec.regs is None:
        problems.append("no ptxas register report")
    if rec.spill_stores or rec.spill_loads:
        problems.append(f"spills {rec.spill_stores} B stores / {rec.spill_loads} B loads per thread")
    want = "tcgen05" if cc >= 100 else "wgmma"  # the target's own tensor-core MMA
    if tensor_cores and cc >= 90:
        if rec.dot != want:
            problems.append(f"products on {rec.dot if rec.dot != '-' else 'no MMA'}, not {want}")
        if rec.mma_dots < rec.tt_dots:  # every dot, not one: a dot left on CUDA cores costs its FMAs
            problems.append(f"{rec.tt_dots - rec.mma_dots} of {rec.tt_dots} dots not lowered to {want}")
        if rec.wgmma_not_16bit:
            problems.append(f"{rec.wgmma_not_16bit} wgmma instructions without bf16/fp16 operands")
        if rec.mma_serialized:
            problems.append(f"ptxas: {rec.mma_serialized}")
    if rec.regs is not None and rec.smem is not None:
        rec.blocks_per_sm = blocks_per_sm(rec.regs, rec.num_warps, rec.smem, cc)
    rec.ok = not problems


# -----------------------------------------------------------------------------
# Shapes


def gpu_preset_shapes() -> dict[tuple, tuple[str, ...]]:
    """The shapes the GPU presets (those on VAE latents: the paper's and Wan's) run DSA at, bf16:
    ``(head dim, window, token grid, max_offset or None) -> preset names``."""
    from megaslide_ray.config.presets import PRESETS

    out: dict[tuple, tuple[str, ...]] = {}
    for name, make in PRESETS.items():
        cfg = make()
        if cfg.model.inputs != "latents" or cfg.attention.kind != "dsa":
            continue
        a = cfg.attention
        key = (cfg.model.hidden_size // cfg.model.num_heads, tuple(a.window), cfg.token_grid, a.max_offset or None)
        out[key] = (*out.get(key, ()), name)
    return out


def preset_shapes(full: bool = False) -> list[AotShape]:
    """The shapes the GPU presets run DSA at (``gpu_preset_shapes``: head dim 128; windows 3x5x5,
    the paper's, and 3x7x7, Wan's; the 480p grid 21x30x52, Wan2.2 TI2V-5B's 21x15x26 through its
    16x VAE, Wan2.1 14B's 720p 21x45x80; offsets clamped at 1.5, halo radius 2), then shapes users
    may configure: head dim 64 (videodit widths such as 512/8) at both windows, and unbounded
    offsets (``attention.max_offset 0``) at d 128, 3x7x7 (every bound a call may run at: the
    atomic and split backward modes past the key-side pass's cap). ``full`` adds fp32 and zero
    offsets (neighborhood attention, radius 0)."""
    grid = (21, 30, 52)
    presets = gpu_preset_shapes()
    shapes = [AotShape("bf16", d, w, g, m, presets=names) for (d, w, g, m), names in presets.items()]
    shapes += [AotShape("bf16", 64, w, grid, 1.5) for w in ((3, 5, 5), (3, 7, 7))]
    shapes.append(AotShape("bf16", 128, (3, 7, 7), grid, None))
    if full:
        shapes += [AotShape("fp32", d, w, grid, 1.5) for d in (64, 128) for w in ((3, 5, 5), (3, 7, 7))]
        shapes += [AotShape("bf16", 128, w, grid, 0.0) for w in ((3, 5, 5), (3, 7, 7))]
    return [AotShape(s.dtype, s.head_dim, s.window, s.grid, s.max_offset,
                     f"{s.dtype} d{s.head_dim} w{'x'.join(map(str, s.window))} "
                     f"{'x'.join(map(str, s.grid))} "
                     + ("unbounded" if s.max_offset is None else f"off{s.max_offset:g}"), s.presets) for s in shapes]


def _compile_key(variant: Variant, arch: str) -> tuple:
    """What a compile depends on: the same key, the same kernel binary (the grid and the bound are
    run-time arguments: the fused kernels compile the same at every Wan grid)."""
    return (variant.kernel, arch, getattr(variant.fn, "__qualname__", repr(variant.fn)),
            repr(sorted(variant.signature.items())), repr(sorted((k, repr(v)) for k, v in variant.constexprs.items())),
            variant.num_warps, variant.num_stages, repr(variant.attrs), variant.maxnreg)


_MEASURED = ("regs", "spill_stores", "spill_loads", "stack", "smem", "blocks_per_sm", "dot", "wgmma", "tt_dots",
             "mma_dots", "wgmma_not_16bit", "mma_serialized", "mma_sync", "atomics_f32", "compile_s", "loop_instr",
             "guarded", "loops", "mma_groups", "outer_walks", "barriers", "ok", "problems")


def run(archs: list[str], shapes: list[AotShape], kernels: tuple[str, ...] | None = None,
        timeout_s: float = COMPILE_TIMEOUT_S, progress=print) -> list[Record]:
    """Compile every variant the kernel modules list for ``shapes`` (``kernels.aot_variants``), for
    each target; ``kernels``: only these kernel names. A variant listed again at another shape with
    the same compile (``_compile_key``) is not compiled again: its record repeats the first one's
    measurements at the new shape (``note`` says so)."""
    from kernels import (
        aot_variants,  # lazy: imports triton (a CPU machine without it can still --help)
    )

    records, done = [], {}
    for shape in shapes:
        for spec in aot_variants(shape):
            variant = Variant(**spec)
            if kernels and variant.kernel not in kernels:
                continue
            for arch in archs:
                if variant.archs is not None and arch not in variant.archs:
                    continue  # another target's launch configuration
                key = _compile_key(variant, arch)
                if key in done:
                    first = done[key]
                    rec = _record(variant, arch, shape)
                    for name in _MEASURED:
                        setattr(rec, name, copy.deepcopy(getattr(first, name)))
                    rec.note = (rec.note + f" (the compile of {first.shape}: the same binary)").strip()
                else:
                    rec = done[key] = compile_variant(variant, arch, shape, timeout_s)
                records.append(rec)
                if progress:
                    progress(table_line(rec))
    return records


# -----------------------------------------------------------------------------
# Report

HEADER = ("| kernel | arch | shape | config | warps/stages | regs | spills (B st/ld) | smem (B) | blocks/SM "
          "| dot | dots on MMA | f32 atomics | compile (s) | ok | problems |")
RULE = "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"


def table_line(r: Record) -> str:
    def f(x):
        return "-" if x is None else str(x)

    spills = "-" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}"
    ok = ("yes" if r.ok else "NO") + ("" if r.may_pick else " (not picked)")
    return (f"| {r.kernel} | {r.arch} | {r.shape} | {r.config} | {r.num_warps}/{r.num_stages} | {f(r.regs)} | "
            f"{spills} | {f(r.smem)} | {f(r.blocks_per_sm)} | {r.dot} | {r.mma_dots}/{r.tt_dots} | {r.atomics_f32} | "
            f"{f(r.compile_s)} | "
            f"{ok} | {'; '.join(r.problems)} |")


def table(records: list[Record]) -> list[str]:
    return [HEADER, RULE, *(table_line(r) for r in records)]


def verdict(records: list[Record]) -> tuple[bool, list[str]]:
    """(every config the product may pick passed, the failures)."""
    bad = [f"{r.kernel} {r.arch} {r.shape} {r.config}: {'; '.join(r.problems)}"
           for r in records if r.may_pick and not r.ok]
    return not bad, bad


def picked_cores(records: list[Record]) -> str:
    """Where the configs the product may pick run: at the presets' shapes and at the others, how
    many on each target's tensor cores, and which (kernel and shape) on CUDA cores."""

    def line(recs, where):
        picked = [r for r in recs if r.may_pick]
        mma = [r for r in picked if r.dot in ("wgmma", "tcgen05")]
        cuda = sorted({f"{r.kernel} ({r.shape})" for r in picked if r.dot not in ("wgmma", "tcgen05")})
        return (f"{len(picked)} configs the product may pick {where}: {len(mma)} on tensor cores, "
                f"{len(picked) - len(mma)} on CUDA cores" + (": " + ", ".join(cuda) if cuda else ""))

    return "\n".join([line([r for r in records if r.presets], "at the presets' shapes"),
                      line([r for r in records if not r.presets], "at the other shapes")])


def as_json(records: list[Record]) -> list[dict]:
    return [asdict(r) for r in records]
