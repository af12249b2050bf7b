"""Performance benchmarks (``python -m benchmarks.NAME``: the pipeline's overhead, weight streaming,
attention, AdamW, decoding, latents, Wan, checkpoints, memory, faults, the GPU check), each
against a baseline in the same run; and in ``studies/`` the research studies
(``python -m benchmarks.studies.NAME``). Results of both: benchmarks/RESULTS.md."""
