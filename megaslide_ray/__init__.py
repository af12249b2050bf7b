"""megaslide-ray: fine-tune video diffusion transformers larger than device memory.

Layers. Imports point down this list, never up:

    entry points   train (the main CLI), trainer (the driver loop), sample (CLI),
                   evaluate (the validation loss: decodes with the decoder's rules, streams
                   through the compute actor like sample; CLI),
                   precompute (the latent CLI: decodes with the decoder's rules, Ray encoder pool)
                   -> may import anything below
    pipelines/     streaming.py, decoder_pool.py: make the actor classes Ray actors, run the
                   step schedule, recover from failures
    actors/        param_store.py, compute.py, transfer.py, decoder.py: plain classes
    foundation     config, model, wan, chunking, shards, schedule, diffusion, captions, checkpoint,
                   latents, faults, metrics, manifest, index, demo_data, motion, motion_metric, plan,
                   baseline (and pretrained, report, preflight, offsets_view, which also read
                   what the actors' modules define: state paths, the decoder's clip rules)
    kernels/       the 3D-DSA operator and 3D shifted windows: imports nothing of the project

**Foundation modules** (this package) may be imported by actors/, pipelines/ and the entry
points. They never import actors/ or pipelines/ (``tests/test_docs.py`` checks it). They
import one another and ``kernels`` (``model`` calls the attention operators).

**Entry points** are what a user runs or what drives a run: ``train`` and ``trainer`` import
``pipelines`` (and through it the actors), ``sample`` imports ``actors.compute`` and
``actors.param_store`` to stream a checkpoint through the compute actor without Ray, and
``precompute`` imports ``actors.decoder`` to decode clips exactly as training would.

``model`` holds the ``videodit`` architecture and dispatches on ``model.arch``; ``wan`` is the
Wan 2.x transformer (diffusers' names); ``chunking`` holds what both blocks use to run token
chunks (``runtime.token_chunk``); ``latents`` reads and writes the latent manifests that
``precompute`` makes and the decoders load.

Several foundation modules also have a command line (``python -m megaslide_ray.NAME``) but
import only foundation modules: ``index``, ``demo_data``, ``motion``, ``motion_metric``,
``plan``, ``pretrained`` and ``report``. ``pretrained`` in particular is also a library: ``actors/param_store.py`` uses its
loader for ``--init-from``, and ``actors/decoder.py`` uses ``demo_data`` for the demo set.

The architecture is described in docs/architecture.md.
"""
