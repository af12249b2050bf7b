"""The planner: will a preset run on a machine, and what bounds its step?

``terms`` holds the formulas (parameters per shard, activations, attention's memory and
FLOPs), ``estimate`` adds them up into a ``Plan`` (``plan(cfg)``), ``search`` finds a token
chunk, a number of kept block inputs or the longest clip that fits, ``render`` prints them.
The command line is ``python -m megaslide_ray.plan``; docs/planner.md derives every term."""
