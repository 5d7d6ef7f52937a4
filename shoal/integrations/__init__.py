"""shoal's strategies inside other frameworks' training loops: a small adapter each, over the
own-loop API (`shoal.strategy`), never a copy of shoal's trainer.

- :mod:`shoal.integrations.accelerate`: Hugging Face Accelerate (``shoal[accelerate]``).
- :mod:`shoal.integrations.hf_trainer`: the Hugging Face ``Trainer`` (``shoal[transformers]``).
- :mod:`shoal.integrations.lightning`: Lightning's ``Trainer`` and Fabric (``shoal[lightning]``).
- :mod:`shoal.integrations.ray`: Ray Train's ``train_func`` (``shoal[ray]``).
- :mod:`shoal.integrations.coupling`: what they share (refusals, stepping, gathered state).
"""
