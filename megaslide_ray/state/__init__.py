"""Model state outside the model: the host shared-memory segments (``segments``), room for them
(``preflight``), the checkpoint format (``checkpoint``) and pretrained weights in and out
(``pretrained``)."""
