"""What a run carries besides the model: fault injection for drills (``faults``) and the run's
Ray metrics for the dashboard (``metrics``)."""
