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
    planning/        the memory and step-time planner (config and models only)
    models/          videodit and wan, the one attention dispatch, chunking, the shard layout,
                     the registry ``model.arch`` selects from
    config/ runtime/ the configuration; fault points and Ray metrics
    kernels/         (top level) 3D-DSA and 3D shifted windows: imports nothing of the project

The rule, package by package, is ``LAYERS`` in tests/test_layers.py, which checks every import
in the code against it, finds any import circle, and refuses a function-local import of a
project module that does not say why (``# lazy: ...``). docs/architecture.md describes the
whole system and where each piece lives.
"""
