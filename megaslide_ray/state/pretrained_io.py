"""Pretrained weights in and out: ``--init-from`` and the standard-named export.

Sources ``--init-from`` accepts:

* one of our checkpoints (``RUN/checkpoints/step_N/``): each shard's ``master`` is taken (the
  fp32 weights; ``w`` is rebuilt from it), the moments are not;
* a ``.safetensors`` file, or a directory of them, with the names of
  ``VideoDiT(cfg).state_dict()``: ``embed.*``, ``blocks.{i}.*``, ``head.*``. Floating-point
  tensors of any dtype are accepted and converted to fp32.

Everything goes through safetensors (no pickle is ever loaded); our checkpoints are read through
``megaslide_ray.state.checkpoint``, which owns their format. Only file headers are read to
check a source (``check_pretrained``): every missing name, unexpected name and wrong shape is
listed in ONE error before any actor starts. Loading then streams shard by shard: one shard's
tensors are read straight into the store's ``master`` segment, so a 105B model never exists
whole in one process's memory. Moments start at zero and the step at 0.

``export_state_dict`` writes a checkpoint's weights back out under the standard names, one
file (``OUT.safetensors``) or one file per shard (``OUT/`` directory):

    python -m megaslide_ray.pretrained RUN/checkpoints/step_30 weights.safetensors
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megaslide_ray.config import PRESETS, Config, ConfigError, build_config, config_from_dict
from megaslide_ray.config import preset as make_preset
from megaslide_ray.config.wan_folders import describe_wan_folder, refuse_unsupported
from megaslide_ray.models.diffusers_dsa import CONFIG_KEY as DSA_CONFIG_KEY
from megaslide_ray.models.diffusers_dsa import export_settings
from megaslide_ray.models.registry import build_shard, initialize_shard, num_experts, num_shards
from megaslide_ray.models.shards import ShardLayout
from megaslide_ray.models.wan_diffusers import check_against, diffusers_config, diffusers_overrides, transformer_dir
from megaslide_ray.state.checkpoint import CheckpointReader, check_checkpoint, is_checkpoint_dir, safetensors_problem

log = logging.getLogger(__name__)

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


class PretrainedMismatchError(ValueError):
    """The pretrained weights do not fit the configured model."""


EXPERT_2_PREFIX = "transformer_2."
"""The standard names of a two-expert model's second expert (``transformer_2/``) start with this;
the first expert's (``transformer/``) are the plain names."""


def shard_prefix(index: int, shards: int, arch: str = "videodit", experts: int = 1) -> str:
    """Standard state-dict prefix of shard ``index`` in a model of ``shards`` shards (``experts``
    transformers of ``shards / experts`` each; the second's names start with ``EXPERT_2_PREFIX``).
    ``wan``: the diffusers names, whose input side (``patch_embedding.*``,
    ``condition_embedder.*``) and head (``scale_shift_table``, ``proj_out.*``) sit at the top level."""
    per = shards // experts
    expert, index = divmod(index, per)
    first = EXPERT_2_PREFIX if expert else ""
    if 0 < index < per - 1:
        return f"{first}blocks.{index - 1}."
    if arch == "wan":
        return first
    return first + ("embed." if index == 0 else "head.")


def is_diffusers_dir(path: str | Path) -> bool:
    """A diffusers model directory (with ``transformer/config.json``) or its ``transformer/``
    folder (a ``config.json`` naming a diffusers transformer class)."""
    p = Path(path)
    if (p / "transformer" / "config.json").is_file():
        return True
    cfg = p / "config.json"
    if not cfg.is_file():
        return False
    try:
        return "Transformer" in str(json.loads(cfg.read_text()).get("_class_name", ""))
    except (OSError, ValueError, AttributeError):
        return False


def config_for_diffusers_dir(path: str | Path, preset_name: str | None, config_file: str | None,
                             overrides: dict) -> Config:
    """The run's config when ``--init-from`` is a diffusers Wan directory: the model section comes
    from its ``config.json`` (and ``vae/config.json``). With no ``--preset``/``--config`` the
    rest starts from the ``wan`` preset of the same shape and the same number of experts (a
    Wan2.2 A14B folder: ``wan2.2-t2v-a14b``, both experts; else ``wan2.1-t2v-1.3b``); flags apply
    on top. Anything the preset, the file or a flag sets that contradicts the directory is
    listed in one ``ConfigError``, and so is a folder that is not a text-to-video Wan model
    (``check_init_folder``)."""
    experts = expert_overrides(path)  # first: it names what an unsupported folder is
    model = {**diffusers_overrides(path), **experts}
    source = f"--init-from {path}"
    if preset_name is None and config_file is None:
        base = "wan2.1-t2v-1.3b"
        for name in PRESETS:  # the first preset of the same shape and the same number of experts
            p = make_preset(name)
            m = p.model
            shape = ("hidden_size", "depth", "in_channels", "image_dim", "pos_embed_seq_len")
            if m.arch == "wan" and all(getattr(m, k) == model[f"model.{k}"] for k in shape) and \
                    not m.clean_first_frame and \
                    bool(p.training.boundary_ratio) == ("training.boundary_ratio" in experts):
                base = name  # (image-to-video from TI2V-5B is asked for: --model.clean_first_frame true)
                break
        cfg = build_config(base, None, {**model, **overrides})
    else:
        cfg = build_config(preset_name, config_file, overrides)
    check_against(cfg, model, source)
    return cfg


def check_init_folder(path: str | Path) -> None:
    """Refuse (``ConfigError``, naming what it is) a diffusers folder given to ``--init-from`` that
    is neither a text-to-video nor an image-to-video Wan model: VACE, Animate, S2V, unknown classes."""
    refuse_unsupported(describe_wan_folder(path), "--init-from", image_to_video=True)


def expert_overrides(path: str | Path) -> dict:
    """What a two-expert folder sets (refusing any other model ``check_init_folder`` refuses):
    ``training.boundary_ratio`` from its ``model_index.json``, and ``training.expert`` when ``path``
    is one expert's folder (``transformer/``: high, ``transformer_2/``: low). The model folder of
    a two-expert model must hold two transformers of the same config. Empty for one transformer."""
    check_init_folder(path)
    folder = describe_wan_folder(path)
    if not folder.two_experts:
        return {}
    if folder.boundary_ratio is None:
        raise ConfigError(f"--init-from {str(path)!r}: {folder.name} without a boundary_ratio in "
                          f"{folder.root}/model_index.json; diffusers' pipeline would run transformer/ alone")
    out = {"training.boundary_ratio": folder.boundary_ratio}
    if folder.given is not None:
        out["training.expert"] = "high" if folder.given == "transformer" else "low"
        return out
    first, second = (diffusers_overrides(folder.root / name) for name in ("transformer", "transformer_2"))
    if first != second:
        diff = sorted(k for k in first if first[k] != second.get(k))
        raise ConfigError(f"--init-from {str(path)!r}: transformer/ and transformer_2/ differ in {diff}; both experts "
                          f"must have the same shape")
    return out


def checkpoint_arch(ckpt: CheckpointReader) -> str:
    """The architecture a checkpoint was written for (checkpoints before ``model.arch``: videodit)."""
    return ckpt.state.get("config", {}).get("model", {}).get("arch", "videodit")


def checkpoint_experts(ckpt: CheckpointReader) -> int:
    """Transformers a checkpoint holds: 2 when it trained both experts of a two-expert model."""
    return 2 if ckpt.state.get("config", {}).get("training", {}).get("expert") == "both" else 1


def is_fresh_part(name: str) -> bool:
    """Parameters a pretrained source may lack: the DSA offset head (``*.offsets.*``), which a
    model without 3D-DSA does not have, and the attention's per-head temperature (``*.tau``,
    ``attention.learn_temperature``). They start as a fresh model's (the head's last layer zero,
    ``tau`` zero: the swapped model starts as neighborhood attention at the source's temperature)."""
    return ".offsets." in name or name.endswith(".tau")


def model_names(cfg: Config) -> dict[str, tuple[tuple[int, ...], int, int]]:
    """Standard name -> (shape, shard, offset in the shard's flat buffer), from meta shards."""
    n, experts = num_shards(cfg), num_experts(cfg)
    out = {}
    for i in range(n):
        lay = ShardLayout.of(build_shard(cfg, i, "meta"), i)
        for name, shape, off in zip(lay.names, lay.shapes, lay.offsets):
            out[shard_prefix(i, n, cfg.model.arch, experts) + name] = (tuple(shape), i, off)
    return out


# ---------------------------------------------------------------------------------------------
# Sources: name -> where the tensor is, read from headers only
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    shape: tuple[int, ...]
    dtype: str
    file: str
    key: str              # tensor name inside the file (checkpoint sources: inside the shard)
    shard: int = -1       # checkpoint sources: the checkpoint shard that holds it


def index_source(path: str | Path, cfg: Config | None = None) -> dict[str, Entry]:
    """Standard name -> Entry for every tensor the source holds. A two-expert diffusers folder
    gives the transformer folders ``cfg.training.expert`` names (``both``: ``transformer_2/``'s
    tensors under ``EXPERT_2_PREFIX``)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--init-from {path}: no such file or directory")
    if is_checkpoint_dir(path):
        problems = check_checkpoint(path)
        if problems:
            raise PretrainedMismatchError(f"--init-from {path}: the checkpoint is damaged: {'; '.join(problems)}")
        return _index_checkpoint(path)
    if is_diffusers_dir(path):  # a diffusers model directory or its transformer folder(s): the weights' folders
        try:
            folders = diffusers_weight_dirs(path, cfg)
        except ConfigError as e:
            raise PretrainedMismatchError(str(e)) from None
        out: dict[str, Entry] = {}
        for folder, prefix in folders:
            out.update({prefix + k: e for k, e in _index_files(folder).items()})
        return out
    return _index_files(path)


def diffusers_weight_dirs(path: str | Path, cfg: Config | None) -> list[tuple[Path, str]]:
    """The transformer folders ``--init-from path`` loads, each with the prefix its names get:
    ``[(transformer/, "")]`` for a one-transformer model; for a two-expert model the expert
    ``cfg.training.expert`` names (``both``: both, the second under ``EXPERT_2_PREFIX``). Refuses a
    folder that is not a text-to-video Wan model, and an expert that contradicts the folder given."""
    check_init_folder(path)
    folder = describe_wan_folder(path)
    if not folder.two_experts:
        return [(transformer_dir(path), "")]
    expert = cfg.training.expert if cfg is not None else ""
    if folder.given is not None:  # one expert's folder
        named = "high" if folder.given == "transformer" else "low"
        if expert != named:
            raise ConfigError(f"--init-from {str(path)!r} is the {named}-noise expert ({folder.given}/) of "
                              f"{folder.name}, but training.expert={expert!r}; set training.expert={named!r}, or give "
                              f"the model folder {str(folder.root or folder.path.parent)!r} with training.expert=both")
        return [(folder.path, "")]
    if expert == "high":
        return [(folder.root / "transformer", "")]
    if expert == "low":
        return [(folder.root / "transformer_2", "")]
    if expert == "both":
        return [(folder.root / "transformer", ""), (folder.root / "transformer_2", EXPERT_2_PREFIX)]
    raise ConfigError(f"--init-from {str(path)!r} is {folder.name} ({folder.evidence}): set training.expert to both, "
                      f"high or low")


def _index_files(path: Path) -> dict[str, Entry]:
    """Standard name -> Entry of a .safetensors file or a folder of them."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise PretrainedMismatchError(f"--init-from {path}: a directory with no .safetensors files and no "
                                      f"state.json; give a .safetensors file, a directory of them, or a "
                                      f"checkpoint directory (RUN/checkpoints/step_N)")
    if path.is_file() and path.suffix != ".safetensors":
        raise PretrainedMismatchError(f"--init-from {path}: only .safetensors files are read (never pickled "
                                      f"formats such as .pt/.bin); convert the weights to safetensors first")
    damaged = [f"{file}: {problem.removeprefix(file.name + ' ')}" for file in files
               if (problem := safetensors_problem(file))]
    if damaged:
        raise PretrainedMismatchError(f"--init-from {path}: {len(damaged)} of its {len(files)} safetensors files "
                                      f"cannot be read:\n  " + "\n  ".join(damaged) + "\nCopy or download them "
                                      "again (a file cut short by an interrupted copy looks like this)")
    out: dict[str, Entry] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                if key in out:
                    raise PretrainedMismatchError(f"--init-from {path}: tensor {key} is in both {out[key].file} "
                                                  f"and {file}")
                out[key] = Entry(tuple(sl.get_shape()), sl.get_dtype(), str(file), key)
    return out


def _index_checkpoint(path: Path) -> dict[str, Entry]:
    try:
        ckpt = CheckpointReader(path)
    except FileNotFoundError as e:  # a shard file is missing
        raise PretrainedMismatchError(f"--init-from {path}: {e}") from None
    out: dict[str, Entry] = {}
    with ckpt:
        n, arch, experts = ckpt.num_shards, checkpoint_arch(ckpt), checkpoint_experts(ckpt)
        for i in range(n):
            lay, dtype = ckpt.layout(i), ckpt.dtype(i, "master")
            for name, shape in zip(lay.names, lay.shapes):
                out[shard_prefix(i, n, arch, experts) + name] = Entry(tuple(shape), dtype, str(ckpt.file(i)), name, i)
    return out


# ---------------------------------------------------------------------------------------------
# Check and load
# ---------------------------------------------------------------------------------------------


def check_pretrained(cfg: Config, path: str | Path) -> dict[str, Entry]:
    """Compare the source's names and shapes with the model's; raise one error listing every
    mismatch. Returns the source's index."""
    source = index_source(path, cfg)
    model = model_names(cfg)
    missing = [n for n in model if n not in source and not is_fresh_part(n)]
    unexpected = [n for n in source if n not in model]
    wrong_shape = [n for n in model if n in source and source[n].shape != model[n][0]]
    not_float = [n for n in model if n in source and source[n].dtype not in FLOAT_DTYPES]
    if missing or unexpected or wrong_shape or not_float:
        fmt = lambda s: "[" + ", ".join(str(d) for d in s) + "]"  # noqa: E731
        lines = [f"--init-from {path} does not match the model (preset {cfg.preset}, depth {cfg.model.depth}, "
                 f"hidden size {cfg.model.hidden_size}): {len(source)} tensors in the source, {len(model)} in the "
                 f"model"]
        if missing:
            lines.append(f"  missing from the source ({len(missing)}):")
            lines += [f"    {n} {fmt(model[n][0])}" for n in missing]
        if unexpected:
            lines.append(f"  unexpected in the source ({len(unexpected)}):")
            lines += [f"    {n} {fmt(source[n].shape)}" for n in unexpected]
        if wrong_shape:
            lines.append(f"  wrong shape ({len(wrong_shape)}):")
            lines += [f"    {n}: source {fmt(source[n].shape)}, model {fmt(model[n][0])}" for n in wrong_shape]
        if not_float:
            lines.append(f"  not floating point ({len(not_float)}):")
            lines += [f"    {n}: {source[n].dtype}" for n in not_float]
        lines.append("Use weights of the same model configuration (a run's config.toml: --config), or set "
                     "--model.* to match the weights.")
        raise PretrainedMismatchError("\n".join(lines))
    return source


def describe_init(cfg: Config, path: str | Path, source: dict[str, Entry]) -> str:
    """What ``--init-from`` loads, in one line: tensors and parameters from where, and which
    parameters start fresh (the offset heads a source without 3D-DSA lacks)."""
    model = model_names(cfg)
    loaded = [n for n in model if n in source]
    fresh = [n for n in model if n not in source]
    files = sorted({source[n].file for n in loaded})
    # the folder that holds them all (both experts' files: the model folder)
    where = (Path(os.path.commonpath([str(Path(f).parent) for f in files])) if files else Path(path)).resolve()
    numel = lambda names: sum(math.prod(model[n][0]) for n in names)  # noqa: E731
    line = (f"init-from: {len(loaded)} tensors ({numel(loaded):,} parameters) from {where} ({len(files)} file"
            f"{'s' if len(files) != 1 else ''})")
    taus = [n for n in fresh if n.endswith(".tau")]
    fresh = [n for n in fresh if n not in taus]
    if fresh:
        heads = sorted({n.split(".offsets.")[0] + ".offsets.*" for n in fresh})
        line += (f"; {len(fresh)} tensors ({numel(fresh):,} parameters) start fresh: the DSA offset heads "
                 f"({', '.join(heads[:3])}{', ...' if len(heads) > 3 else ''}), zero at the end, so the model starts "
                 f"as neighborhood attention")
    if taus:
        line += (f"; {len(taus)} per-head temperatures (*.tau, attention.learn_temperature) start at 0: the "
                 f"source's softmax")
    if not fresh and not taus:
        line += "; nothing starts fresh"
    return line


@torch.no_grad()
def load_pretrained_into(store, path: str | Path) -> None:
    """Fill a fresh store's shards from ``path``: master and w from the weights, m = v = 0,
    versions 0. Shard by shard; each file is opened once per shard that needs it. A store of a
    run on several nodes fills master, m, v of the shards it owns and ``w`` of all (the weights of
    a shard another node owns pass through one fp32 buffer of that shard's size)."""
    source = check_pretrained(store.cfg, path)
    model = model_names(store.cfg)
    by_shard: dict[int, list[str]] = {}
    for name, (_, shard, _) in model.items():
        by_shard.setdefault(shard, []).append(name)
    fresh = [n for n in model if n not in source]  # the offset heads a source without DSA lacks
    if fresh:
        log.info("%d parameters not in %s start fresh (offset heads: the model starts as neighborhood "
                 "attention): %s%s", len(fresh), path, ", ".join(fresh[:4]), " ..." if len(fresh) > 4 else "")
    ckpt = CheckpointReader(path) if is_checkpoint_dir(path) else None
    for i, lay in enumerate(store.layouts):
        owned = "master" in store.seg[i]
        master = store.seg[i]["master"] if owned else torch.empty(lay.numel, dtype=torch.float32)
        views = lay.views(master)
        prefix = shard_prefix(i, store.n, store.cfg.model.arch, num_experts(store.cfg))
        if any(model[n][1] == i for n in fresh):  # a fresh shard first, then the source on top
            module = build_shard(store.cfg, i, "cpu")
            initialize_shard(module, store.cfg.training.seed, i)
            lay.flatten_into(module, master)
            del module
        files: dict[str, list[str]] = {}
        for name in by_shard[i]:
            if name in source:
                files.setdefault(source[name].file, []).append(name)
        for file, names in files.items():
            for name, t in zip(names, read_source(ckpt, file, [source[name] for name in names])):
                views[name[len(prefix):]].copy_(t.reshape(source[name].shape).to(torch.float32))
        store.seg[i]["w"].copy_(master)
        if owned:
            store.seg[i]["m"].zero_()
            store.seg[i]["v"].zero_()
        del master, views
    if ckpt is not None:
        ckpt.close()
    store.versions.fill_(0)
    log.info("initialised %d shards from %s", store.n, path)


def read_source(ckpt: CheckpointReader | None, file: str, entries: list[Entry]):
    """The tensors of ``entries``, all in ``file``, one at a time. From our checkpoint (``ckpt``)
    one shard's flat ``master`` is read once and served by parameter name."""
    if ckpt is not None:
        tensors = ckpt.tensors(entries[0].shard, "master")
        for e in entries:
            yield tensors[e.key]
        return
    with safe_open(file, framework="pt") as f:
        for e in entries:
            yield f.get_tensor(e.key)


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


def check_export_target(out: str | Path, one_file: bool, overwrite: bool = False) -> None:
    """Refuse (ValueError naming ``out``) an export that would overwrite without ``overwrite``:
    an existing file, or a directory with anything in it; and one that cannot be written: a
    file where a directory goes (not ``.safetensors``), a directory where a file goes."""
    out = Path(out)
    if not out.exists():
        return
    if one_file and out.is_dir():
        raise ValueError(f"{out} is a directory: a one-file export needs a file path ending in .safetensors (or "
                         f"give the directory a name without that suffix to write one file per shard)")
    if not one_file and not out.is_dir():
        raise ValueError(f"{out} is an existing file and does not end in .safetensors: give OUT.safetensors for one "
                         f"file, or the path of a directory (new or empty) for one file per shard")
    if overwrite:
        return
    if out.is_file():
        raise ValueError(f"{out} exists: pass --overwrite to replace it, or give a new path")
    if any(out.iterdir()):
        raise ValueError(f"{out} is a directory with files in it: pass --overwrite to replace the export there, or "
                         f"give a new or empty directory")


def _remove_stale(out: Path, pattern: str, keep: list[str]) -> None:
    """An export over an earlier one: its files that this one does not write again go."""
    for old in out.glob(pattern):
        if str(old) not in keep and old.is_file():
            old.unlink()


def export_state_dict(checkpoint: str | Path, out: str | Path, kind: str = "master",
                      dtype: torch.dtype | None = None, overwrite: bool = False) -> list[str]:
    """Write a checkpoint's ``kind`` tensors (``master``, ``w``, or ``ema``: the moving average of
    the weights of a run with ``training.ema_decay``) under the standard model names: one file if ``out`` ends in ``.safetensors``, else one file per shard in the
    directory ``out``. An existing ``out`` is refused (``check_export_target``) unless
    ``overwrite``. Returns the files written."""
    checkpoint, out = Path(checkpoint), Path(out)
    if kind not in ("master", "w", "ema"):
        raise ValueError(f"kind={kind!r}; use 'master', 'w' or 'ema'")
    check_export_target(out, out.suffix == ".safetensors", overwrite)
    ckpt = CheckpointReader(checkpoint)
    n, arch, experts = ckpt.num_shards, checkpoint_arch(ckpt), checkpoint_experts(ckpt)
    one_file = out.suffix == ".safetensors"
    if not one_file:
        out.mkdir(parents=True, exist_ok=True)
    written, together = [], {}
    for i in range(n):
        tensors = {shard_prefix(i, n, arch, experts) + name: (t.to(dtype) if dtype else t).clone()
                   for name, t in ckpt.tensors(i, kind).items()}
        if one_file:
            together.update(tensors)
        else:
            path = out / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            save_file(tensors, str(path), metadata={"format": "pt"})
            written.append(str(path))
    if one_file:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(together, str(out), metadata={"format": "pt"})
        written.append(str(out))
    else:
        _remove_stale(out, "model-*-of-*.safetensors", written)
    ckpt.close()
    return written


DIFFUSERS_INDEX = "diffusion_pytorch_model.safetensors.index.json"


def export_diffusers(checkpoint: str | Path, out: str | Path, dtype: torch.dtype | None = None,
                     drop_offsets: bool = False, overwrite: bool = False, kind: str = "master") -> list[str]:
    """Write a ``wan`` checkpoint's master weights (``kind = ema``: their moving average) as a diffusers ``WanTransformer3DModel``
    folder: ``config.json``, one ``diffusion_pytorch_model-XXXXX-of-NNNNN.safetensors`` per
    shard and the index that maps each name to its file, so ``from_pretrained(out)`` loads it.
    diffusers' model has dense self-attention and no offset heads (``attn1.offsets.*``, kept in
    the files unless ``drop_offsets``): a model trained with another ``attention.kind`` gets a
    ``megaslide_dsa`` entry in ``config.json``, which ``megaslide_ray.models.diffusers_dsa.enable_dsa``
    reads to run it as trained, and whose note diffusers prints when it loads the folder alone.
    An existing ``out`` with files in it is refused (``check_export_target``) unless ``overwrite``.

    A checkpoint of both experts of a two-expert model (``training.expert = both``) is written as
    a pipeline folder instead: ``out/transformer/`` and ``out/transformer_2/`` (each as above) and
    ``model_index.json`` with its ``boundary_ratio`` (the other components' entries taken from the
    ``--init-from`` folder's ``model_index.json`` when there is one), which diffusers'
    ``WanPipeline.from_pretrained(out, vae=..., text_encoder=..., tokenizer=..., scheduler=...)``
    loads; copy ``vae/``, ``text_encoder/``, ``tokenizer/``, ``scheduler/`` of the original folder
    beside them to load it alone."""
    checkpoint, out = Path(checkpoint), Path(out)
    check_export_target(out, False, overwrite)
    with CheckpointReader(checkpoint) as ckpt:
        if checkpoint_arch(ckpt) != "wan":
            raise ValueError(f"{checkpoint} holds a {checkpoint_arch(ckpt)} model; --format diffusers exports "
                             f"model.arch = 'wan' checkpoints (use --format safetensors for this one)")
        cfg = config_from_dict(ckpt.state["config"])
        _check_diffusers_export(ckpt, cfg, kind)
        if checkpoint_experts(ckpt) == 1:
            return _write_transformer(ckpt, cfg, range(ckpt.num_shards), out, dtype, drop_offsets, kind)
        per = ckpt.num_shards // 2
        written = [*_write_transformer(ckpt, cfg, range(per), out / "transformer", dtype, drop_offsets, kind),
                   *_write_transformer(ckpt, cfg, range(per, 2 * per), out / "transformer_2", dtype, drop_offsets,
                                       kind)]
    (out / "model_index.json").write_text(json.dumps(_model_index(cfg), indent=2))
    return [*written, str(out / "model_index.json")]


def _check_diffusers_export(ckpt: CheckpointReader, cfg: Config, kind: str) -> None:
    """Refuse a diffusers export that would not be the model trained (ValueError naming why)."""
    if kind not in ("master", "ema"):
        raise ValueError(f"kind={kind!r}: a diffusers export writes fp32 weights, 'master' or 'ema'")
    if kind == "ema" and not ckpt.has(0, "ema"):
        raise ValueError(f"{ckpt.path} holds no moving average of the weights (its run had training.ema_decay = 0): "
                         f"export --kind master")
    if cfg.attention.learn_temperature:
        raise ValueError(f"{ckpt.path} was trained with attention.learn_temperature: diffusers' attention (and "
                         f"enable_dsa) has no per-head temperature, so a diffusers folder would run another model; "
                         f"export --format safetensors (the *.tau tensors are kept)")


def _diffusers_version() -> str:
    """The installed diffusers' version (what ``save_pretrained`` would record), else the oldest
    release with Wan2.2's two experts."""
    try:
        import diffusers
    except ImportError:
        return "0.35.0"
    return diffusers.__version__


def _model_index(cfg: Config) -> dict:
    """The ``model_index.json`` of a two-expert export: ``WanPipeline`` with both transformers and
    ``cfg``'s ``boundary_ratio``; the other entries from the ``--init-from`` folder's, else Wan2.2's."""
    index = {"_class_name": "WanPipeline", "_diffusers_version": _diffusers_version(), "expand_timesteps": False,
             "scheduler": ["diffusers", "UniPCMultistepScheduler"], "text_encoder": ["transformers", "UMT5EncoderModel"],
             "tokenizer": ["transformers", "T5TokenizerFast"], "vae": ["diffusers", "AutoencoderKLWan"]}
    source = Path(cfg.training.init_from) / "model_index.json" if cfg.training.init_from else None
    if source is not None and source.is_file():
        index.update(json.loads(source.read_text()))
        index["_diffusers_version"] = _diffusers_version()
    index.update({"transformer": ["diffusers", "WanTransformer3DModel"],
                  "transformer_2": ["diffusers", "WanTransformer3DModel"], "boundary_ratio": cfg.training.boundary_ratio})
    return index


def _write_transformer(ckpt: CheckpointReader, cfg: Config, shards: range, out: Path, dtype: torch.dtype | None,
                       drop_offsets: bool, kind: str = "master") -> list[str]:
    """One transformer (checkpoint shards ``shards``) as a diffusers folder ``out`` (``export_diffusers``)."""
    out.mkdir(parents=True, exist_ok=True)
    n = len(shards)
    weight_map, total, written = {}, 0, []
    for i, shard in enumerate(shards):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for key, t in ckpt.tensors(shard, kind).items():
            full = shard_prefix(i, n, "wan") + key
            if drop_offsets and is_fresh_part(full):
                continue
            tensors[full] = (t.to(dtype) if dtype else t).contiguous()
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        for full, t in tensors.items():
            weight_map[full] = name
            total += t.numel() * t.element_size()
        written.append(str(out / name))
    _remove_stale(out, "diffusion_pytorch_model-*-of-*.safetensors", written)
    (out / DIFFUSERS_INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                                   "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    config = diffusers_config(cfg)
    a = cfg.attention
    if a.kind != "dense":  # what enable_dsa needs, and the note diffusers prints on a plain load
        config[DSA_CONFIG_KEY] = export_settings(a.kind, a.window, a.scale, a.max_offset, a.offset_groups,
                                                 a.offset_kernel, a.offset_scale, offsets=not drop_offsets,
                                                 offset_condition=a.offset_condition, offset_source=a.offset_source,
                                                 offset_bound=a.offset_bound, dense_blocks=a.dense_blocks,
                                                 dense_above_t=a.dense_above_t)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return [*written, str(out / DIFFUSERS_INDEX), str(out / "config.json")]
