"""What a trained model does: the validation loss (``validation``), sampling (``sampling``), the
motion-fidelity metric (``motion_metric``), run reports (``report``) and the learned offset
field (``offsets_view``). Sampling and validation stream a checkpoint through the compute
actor's class, without Ray."""
