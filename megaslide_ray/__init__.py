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


def check_no_foreign_kernels() -> None:
    """Refuse to run beside the Hugging Face ``kernels`` distribution.

    This project's top-level package ``kernels`` (3D-DSA) and the Hub's ``kernels`` package
    (a dependency of transformers >= 5.25) share one import name: installed together, one hides
    the other. Either this project's imports fail, or transformers (and with it diffusers' Wan
    loading) imports this project's package as its own and fails. Said once, here, with the fix.
    """
    try:
        version = _metadata.version("kernels")
    except _metadata.PackageNotFoundError:
        return
    raise ImportError(
        f"the Hugging Face package 'kernels' {version} is installed in this environment; it shares "
        "the top-level import name 'kernels' with megaslide-ray's kernels package, and the two "
        "cannot be installed together (it comes with transformers >= 5.25). Fix: "
        "pip install 'transformers>=5,<5.25' && pip uninstall -y kernels && "
        "pip install --force-reinstall --no-deps -e .   (from the megaslide-ray checkout)"
    )


check_no_foreign_kernels()
