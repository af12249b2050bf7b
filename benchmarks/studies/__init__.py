"""Research studies: what the model learns, as opposed to how fast the system runs it (the
performance benchmarks one folder up).

Each measures small models trained in process on the motion set (``megaslide_ray.data.motion_set``):
trained there and then, or saved by a ``quality`` run. Each runs as
``python -m benchmarks.studies.NAME``; their findings are in benchmarks/RESULTS.md.


``quality``        the attention kinds trained alike and compared on held-out motion;
``learning``       how many steps before a preset's samples show their prompts (or a trained run scored);
``region_loss``    a ``quality`` run's loss split into the moving object and the background;
``offset_signal``  whether dsa's offsets get a gradient that points along the motion;
``adaptation``     a dense teacher adapted to each kind (the paper's experiment), videodit or Wan;
``consistency``    a model-free temporal-consistency score in VBench's form (``adaptation`` uses it);
``wan_motion``     a small Wan model on the motion set (pixels as latents, a stand-in text encoder);
``harness``        what they share: training in process, saved weights, samples scored against
                   their captions, dsa's offsets against the ground truth.

Imports point one way: ``harness`` imports no study, and of the studies only ``region_loss``
imports another (``quality``, whose saved models it reads); ``consistency`` and ``wan_motion`` are
helpers of ``adaptation``, importing no study.
"""
