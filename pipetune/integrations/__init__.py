"""Training code written for other libraries, tuned as it is: each integration turns
that library's own objects into a :class:`~pipetune.workloads.Workload`.

- :mod:`pipetune.integrations.lightning`: a LightningModule and a LightningDataModule
  (``pip install 'pipetune[lightning]'``).
- :mod:`pipetune.integrations.transformers`: a Hugging Face ``Trainer``'s
  ``model_init``, datasets and ``TrainingArguments``
  (``pip install 'pipetune[transformers]'``).

Importing this package imports none of those libraries.
"""
