"""The mathematics of training that does not depend on placement: the flow-matching objective
(``flow``), the learning-rate schedule and clipping (``schedule``), the AdamW kernels the
parameter store runs (``adamw``) and the in-process reference trainer (``baseline``)."""
