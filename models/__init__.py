"""The model zoo: the manifest, the committed trained models, their training script, data loaders
and the recipes that calibrate and score each model (run scripts as ``python -m models.train``)."""
