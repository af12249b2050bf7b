"""megaslide-ray: fine-tune video diffusion transformers larger than device memory.

The package is organised by concern, in layers; a layer imports only the layers below it:

    command lines    train, sample, evaluate, plan, index, precompute, pretrained, report,
                     demo_data, motion, motion_metric (``python -m megaslide_ray.NAME``; all
                     of them as ``megaslide NAME``): parse the arguments, call the library
    trainer/         the Trainer loop, the components it delegates to (checkpoints,
                     validation, samples, metrics), the launch of a run (Ray, signals)
    evaluation/      the validation loss, sampling, the motion metric, reports
    pipelines/       (top level) the actors made Ray actors, the step schedule, recovery
    actors/          (top level) the parameter store, compute actor and decoders: plain classes
    data/ training/ state/
                     data sets, manifests, clips, latents; the objective, the schedule, AdamW,
                     the in-process reference trainer; shared-memory state, checkpoints,
                     pretrained weights
    planning/        the memory and step-time planner (config, models, the kernels' scratch)
    models/          videodit and wan, the one attention dispatch, chunking, the shard layout,
                     the registry ``model.arch`` selects from
    config/ runtime/ the configuration; fault points and Ray metrics
    kernels/         (top level) 3D-DSA and 3D shifted windows: imports nothing of the project

The rule, package by package, is ``LAYERS`` in tests/test_layers.py, which checks every import
in the code against it, finds any import circle, and refuses a function-local import of a
project module that does not say why (``# lazy: ...``). docs/architecture.md describes the
whole system and where each piece lives.
"""

import importlib.metadata as _metadata
import importlib.util as _util
import os as _os
import warnings as _warnings


def check_no_foreign_kernels() -> None:
    """Say what to do when the Hugging Face ``kernels`` distribution is installed.

    This project's top-level package ``kernels`` (3D-DSA) and the Hub's ``kernels`` package (a
    dependency of transformers >= 5.25) share one import name: installed together, one hides the
    other. Where theirs is what ``import kernels`` finds, this project cannot run: ImportError. Where
    ours is (a checkout's directory comes first on the path), this project runs, but transformers
    (and with it diffusers' Wan loading) imports our package as its own and fails: a warning.
    Both say the fix.
    """
    try:
        version = _metadata.version("kernels")
    except _metadata.PackageNotFoundError:
        return
    fix = ("Fix: pip install 'transformers>=5,<5.25' && pip uninstall -y kernels && "
           "pip install --force-reinstall --no-deps -e .   (from the megaslide-ray checkout)")
    what = (f"the Hugging Face package 'kernels' {version} is installed in this environment (it comes with "
            "transformers >= 5.25); it shares the top-level import name 'kernels' with megaslide-ray's "
            "kernels package")
    spec = _util.find_spec("kernels")
    origin = spec.origin if spec is not None and spec.origin else ""
    if not _os.path.exists(_os.path.join(_os.path.dirname(origin), "dsa_reference.py")):
        raise ImportError(f"{what}, and 'import kernels' finds theirs ({origin}): megaslide-ray cannot run. {fix}")
    _warnings.warn(f"{what}; 'import kernels' finds this project's, so transformers and diffusers' Wan loading "
                   f"may fail to import. {fix}", RuntimeWarning, stacklevel=2)


check_no_foreign_kernels()
