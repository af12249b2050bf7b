"""Searches over plans: the token chunk that fits a device (``--token-chunk auto``), how many
block inputs may stay on the device (``--offload-keep auto``), the longest clip that fits
(``--max-frames``), and ``config_for``, the config of a preset at a clip size."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megaslide_ray.config import Config, ConfigError, build_config
from megaslide_ray.planning.estimate import Plan, plan
from megaslide_ray.planning.terms import MIN_SUB_SLICE_CHUNK, check_shape, fmt_bytes, padded_clip


def chunk_candidates(cfg: Config) -> list[int]:
    """Token chunks ``--token-chunk auto`` tries, ascending: halves of one time slice (down to
    ``MIN_SUB_SLICE_CHUNK``), then 1, 2, ... whole time slices up to the whole clip."""
    T, H, W = cfg.token_grid
    S = H * W
    subs = []
    c = S // 2
    while c >= MIN_SUB_SLICE_CHUNK:
        subs.append(c)
        c //= 2
    return sorted(set(subs)) + [k * S for k in range(1, T + 1)]


def _with(cfg: Config, **runtime: Any) -> Config:
    out = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, **runtime))
    return out


def auto_token_chunk(cfg: Config, gpu_gb: float, **kw: Any) -> tuple[int, Plan] | None:
    """The largest candidate token chunk whose plan fits ``gpu_gb`` of device memory, with that
    plan; None when even the smallest does not fit. Device memory grows with the chunk."""
    cands = chunk_candidates(cfg)
    lo, hi, best = 0, len(cands) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        p = plan(_with(cfg, token_chunk=cands[mid]), gpu_gb=gpu_gb, **kw)
        if p.fits_device:
            best, lo = (cands[mid], p), mid + 1
        else:
            hi = mid - 1
    return best


def plan_with_chunk(cfg: Config, token_chunk: int | str | None, **kw: Any) -> Plan:
    """``plan`` with ``token_chunk`` = an int (set on the config), ``auto`` (``auto_token_chunk``;
    the smallest chunk's plan when none fits, to show by how much), or None: the config's
    ``runtime.token_chunk``, except that a config without chunking whose whole-clip plan does not
    fit ``gpu_gb`` gets ``auto`` (and a note saying so)."""
    if token_chunk is None:
        p = plan(cfg, **kw)
        if cfg.runtime.token_chunk or p.fits_device is not False:
            return p
        chosen = plan_with_chunk(cfg, "auto", **kw)
        why = (f"runtime.token_chunk = 0 (the whole clip at once) needs {fmt_bytes(p.device_required_bytes)} "
               f"on the device; ")
        why += (f"the planner chose token_chunk {chosen.token_chunk:,} (--token-chunk auto: the largest that fits; "
                f"--token-chunk 0 shows the unchunked plan)" if chosen.fits_device else
                f"no token chunk fits either; shown with the smallest, {chosen.token_chunk:,}")
        return dataclasses.replace(chosen, notes=(why,) + chosen.notes)
    if token_chunk == "auto":
        if kw.get("gpu_gb") is None:
            raise ConfigError("--token-chunk auto needs --gpu-gb (the device it must fit)")
        found = auto_token_chunk(cfg, **kw)
        if found is not None:
            return _with_partial_offload_note(cfg, found[1], kw)
        return plan(_with(cfg, token_chunk=chunk_candidates(cfg)[0]), **kw)
    if int(token_chunk) < 0:
        raise ConfigError(f"--token-chunk {token_chunk} must be >= 0 (0: whole clip) or auto")
    return plan(_with(cfg, token_chunk=int(token_chunk)), **kw)


def _with_partial_offload_note(cfg: Config, p: Plan, kw: dict) -> Plan:
    """A plan short of host RAM with offloaded block inputs, whose device fits: would keeping
    (more of) them on the device (``runtime.offload_keep``, with a smaller token chunk to make
    room) close the gap? Adds a note naming the count and the chunk when it would."""
    if not (p.fits_host is False and p.fits_device and cfg.runtime.offload_activations and p.token_chunk
            and p.host_offloaded_bytes):
        return p
    L, k0 = cfg.model.depth, p.offload_keep
    ND = p.host_offloaded_bytes // (L - k0)
    need = k0 + -(-p.host_shortfall_bytes // ND)
    if need > L:
        return p
    for c in reversed(chunk_candidates(cfg)):
        if c > p.token_chunk:
            continue
        q = plan(_with(cfg, token_chunk=c, offload_keep=need), **kw)
        if q.fits:
            note = (f"runtime.offload_keep = {need} (--offload-keep {need}, or auto) keeps the last {need} of the "
                    f"{L} block inputs on the device instead of offloading them, {fmt_bytes((need - k0) * ND)} off "
                    f"the host, which closes the gap; with token_chunk {c:,} the device then needs "
                    f"{fmt_bytes(q.device_required_bytes)}")
            return dataclasses.replace(p, notes=p.notes + (note,))
    return p


def plan_with_keep(cfg: Config, token_chunk: int | str | None, keep: int | str | None, **kw: Any) -> Plan:
    """``plan_with_chunk`` with ``runtime.offload_keep`` = ``keep``: an int (set on the config),
    None (the config's), or ``auto``: the smallest k whose host fits ``ram_gb``, then the token
    chunk for that k as ``plan_with_chunk`` picks it (docs/planner.md, "Searches"). A note says
    what was chosen."""
    if keep is None:
        return plan_with_chunk(cfg, token_chunk, **kw)
    if not cfg.runtime.offload_activations or kw.get("generate"):
        raise ConfigError("--offload-keep plans block inputs kept on the device instead of offloaded: it needs "
                          "--offload-activations (and a training plan, not --generate)")
    if keep != "auto":
        if int(keep) < 0:
            raise ConfigError(f"--offload-keep {keep} must be >= 0 or auto")
        return plan_with_chunk(_with(cfg, offload_keep=int(keep)), token_chunk, **kw)
    if kw.get("gpu_gb") is None or kw.get("ram_gb") is None:
        raise ConfigError("--offload-keep auto needs --gpu-gb and --ram-gb (the machine it must fit)")
    L = cfg.model.depth
    # The host terms do not depend on the chunk: plan one (the smallest: cheapest to fit) unkept.
    probe = _with(cfg, offload_keep=0, token_chunk=chunk_candidates(cfg)[0] if token_chunk == "auto"
                  else cfg.runtime.token_chunk if token_chunk is None else int(token_chunk))
    full = plan(probe, **kw)
    ND = full.host_offloaded_bytes // L
    k = min(L, -(-full.host_shortfall_bytes // ND)) if ND else 0
    while k < L and plan(_with(probe, offload_keep=k), **kw).fits_host is False:
        k += 1  # (the division above is exact; this guards the rounding of --ram-gb)
    p = plan_with_chunk(_with(cfg, offload_keep=k), token_chunk, **kw)
    if p.fits_host is False:
        why = (f"--offload-keep auto: even keeping all {L} block inputs on the device leaves the host short by "
               f"{fmt_bytes(p.host_shortfall_bytes)}")
    elif not k:
        why = "--offload-keep auto: the host fits with every block input offloaded (k = 0)"
    else:
        why = (f"--offload-keep auto: k = {k}, the fewest block inputs kept on the device that make the host fit "
               f"(short by {fmt_bytes(full.host_shortfall_bytes)} with all {L} offloaded, {fmt_bytes(ND)} each)")
        if not p.fits_device:
            why += f"; the device does not fit with k = {k}, and a larger k only needs more there"
        elif token_chunk == "auto":
            why += f"; token chunk {p.token_chunk:,}, the largest that then fits the device"
    return dataclasses.replace(p, notes=(why,) + p.notes)


def plan_with_resident(cfg: Config, token_chunk: int | str | None, keep: int | str | None,
                       resident: float | str | None, **kw: Any) -> Plan:
    """``plan_with_keep`` with ``runtime.resident_gb`` = ``resident``: GB (set on the config), None
    (the config's), or ``auto`` (needs ``gpu_gb``): the device left after the token chunk and the
    kept block inputs are chosen goes to resident shards (blocks nearest the turn first), so the
    weights they hold cross the link once per step instead of twice."""
    if resident is None:
        return plan_with_keep(cfg, token_chunk, keep, **kw)
    if resident != "auto":
        return plan_with_keep(_with(cfg, resident_gb=float(resident)), token_chunk, keep, **kw)
    if kw.get("gpu_gb") is None:
        raise ConfigError("--resident-gb auto needs --gpu-gb (the device the resident shards must fit)")
    first = plan_with_keep(_with(cfg, resident_gb=0.0), token_chunk, keep, **kw)
    spare = kw["gpu_gb"] * 1e9 - first.device_required_bytes
    if spare <= 0:
        return first
    fixed = _with(cfg, resident_gb=spare / 1e9, token_chunk=first.token_chunk, offload_keep=first.offload_keep)
    p = plan(fixed, **kw)
    why = (f"--resident-gb auto: {len(p.resident_shards)} shard(s) kept on the device from forward to backward "
           f"({fmt_bytes(p.resident_bytes)} of the {fmt_bytes(spare)} left): runtime.resident_gb = "
           f"{spare / 1e9:.1f}; host -> device {fmt_bytes(first.h2d_bytes)} -> {fmt_bytes(p.h2d_bytes)} per step")
    return dataclasses.replace(p, notes=first.notes + (why,))


def frame_candidates(cfg: Config, limit: int) -> list[int]:
    """Valid clip lengths in pixel frames, ascending, up to ``limit``: 4k+1 (whose latent frames the
    temporal patch divides) in latent space, multiples of the temporal patch in pixel space; only
    those whose token grid holds the attention window."""
    m = cfg.model
    if cfg.latent_space:
        ct, pt = m.latent_compression[0], m.patch_size[0]
        frames = [k * ct + 1 for k in range(0, (limit - 1) // ct + 1) if (k + 1) % pt == 0]
    else:
        frames = list(range(m.patch_size[0], limit + 1, m.patch_size[0]))
    out = []
    for f in frames:
        probe = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, num_frames=f))
        if probe.token_grid[0] >= (cfg.attention.window[0] if cfg.attention.kind != "dense" else 1):
            out.append(f)
    return out


@dataclass(frozen=True)
class FrameSearch:
    best_frames: int | None        # the longest clip that fits (None: not even the shortest)
    best: Plan | None              # its plan
    next_frames: int | None        # the next valid length (None: the search limit was reached)
    next: Plan | None              # its plan: what binds, by how much
    tried: int                     # plans evaluated


def max_frames(cfg: Config, token_chunk: int | str | None = None, limit: int = 4097,
               keep: int | str | None = None, **kw: Any) -> FrameSearch:
    """The longest clip (pixel frames, at ``cfg``'s height and width) whose plan fits the machine in
    ``kw`` (``ram_gb`` and/or ``gpu_gb``), by binary search over ``frame_candidates``: memory grows
    with the clip. ``token_chunk`` as in ``plan_with_chunk``, ``keep`` (``runtime.offload_keep``) as
    in ``plan_with_keep`` (``auto`` re-picks them at each length)."""
    if kw.get("gpu_gb") is None and kw.get("ram_gb") is None:
        raise ConfigError("--max-frames needs the machine: --gpu-gb and/or --ram-gb")
    if not kw.get("generate") and (kw.get("gpu_gb") is None or kw.get("ram_gb") is None):
        raise ConfigError("--max-frames for training needs both --gpu-gb and --ram-gb")
    cands = frame_candidates(cfg, limit)
    if not cands:
        raise ConfigError(f"no clip of at most {limit} frames holds the attention window {cfg.attention.window}")
    tried = 0
    cache: dict[int, Plan] = {}

    def at(i: int) -> Plan:
        nonlocal tried
        if i not in cache:
            tried += 1
            f = cands[i]
            c = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, num_frames=f))
            cache[i] = plan_with_keep(c, token_chunk, keep, **kw)
        return cache[i]

    if not at(0).fits:
        return FrameSearch(None, None, cands[0], at(0), tried)
    lo, hi = 0, len(cands) - 1
    while lo < hi:  # invariant: cands[lo] fits
        mid = (lo + hi + 1) // 2
        if at(mid).fits:
            lo = mid
        else:
            hi = mid - 1
    nxt = lo + 1 if lo + 1 < len(cands) else None
    return FrameSearch(cands[lo], at(lo), None if nxt is None else cands[nxt], None if nxt is None else at(nxt),
                       tried)


def config_for(preset: str = "tiny", frames: int | None = None, height: int | None = None,
               width: int | None = None, batch_size: int | None = None, attention: str | None = None,
               config_file: str | None = None, pad: bool = True) -> Config:
    """The preset (or config file) with the shape / attention overrides of the CLI. In latent
    space the clip is padded to the next valid size (``padded_clip``) unless ``pad`` is False;
    ``requested_clip`` then tells what was asked."""
    overrides: dict[str, Any] = {}
    for key, value in (("data.num_frames", frames), ("data.height", height), ("data.width", width),
                       ("data.batch_size", batch_size), ("attention.kind", attention)):
        if value is not None:
            overrides[key] = value
    # check the shape first so the message names the CLI flag rather than the config key
    probe = build_config(preset, config_file)
    for key in ("data.num_frames", "data.height", "data.width"):
        if key in overrides:
            setattr(probe.data, key.split(".", 1)[1], overrides[key])
    if pad and probe.latent_space:
        f, h, w = padded_clip(probe, probe.data.num_frames, probe.data.height, probe.data.width)
        overrides.update({"data.num_frames": f, "data.height": h, "data.width": w})
        probe.data.num_frames, probe.data.height, probe.data.width = f, h, w
    check_shape(probe)
    return build_config(preset, config_file, overrides)


def requested_clip(preset: str, frames: int | None, height: int | None, width: int | None,
                   config_file: str | None = None) -> tuple[int, int, int]:
    base = build_config(preset, config_file).data
    return (frames or base.num_frames, height or base.height, width or base.width)
